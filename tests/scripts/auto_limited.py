"""``max_tokens="auto"`` from nothing under a real address-space limit (RLIMIT_AS), then training.

Usage: python auto_limited.py SPEC_JSON, where the JSON holds ``config``
(BertConfig kwargs), ``lengths``, ``room`` (bytes of address space allowed
beyond this process's VmSize after warm-up), ``max_steps`` and ``cache``
(the budget cache file). Prints one JSON line: the budget ``auto_budget``
chose with no ``memory_limit`` argument (so from ``RLIMIT_AS``), where it came
from, and two training runs in forks under the same limit: at that budget and
at twice it.

Run with ``MALLOC_MMAP_THRESHOLD_=65536`` (see probe_train_limited.py): address
space then tracks tensor bytes rather than glibc's heap fragmentation.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is run

from probe_train_limited import in_fork, vm_status


def main() -> None:
    import accelerate.utils.memory  # noqa: F401  # is_oom asks accelerate: import it before the limit
    from transformers import BertConfig, BertForSequenceClassification

    from tokenbatch import TokenBudgetBatchSampler, auto_budget, is_oom
    from tokenbatch.probe import BudgetCache

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(**spec["config"])
    config._attn_implementation = "eager"
    model = BertForSequenceClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = spec["lengths"]

    def step(indices: list[int]) -> None:
        width = max(lengths[i] for i in indices)
        ids = torch.randint(0, config.vocab_size, (len(indices), width))
        mask = torch.ones(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            mask[row, lengths[i] :] = 0
        labels = torch.zeros(len(indices), dtype=torch.long)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step([0])  # warm-up: optimizer state, kernels
    # OpenBLAS maps its buffers at the first call (the probe's least squares): before the limit.
    np.linalg.lstsq(np.ones((4, 2)), np.ones(4), rcond=None)
    limit = vm_status("VmSize") + spec["room"]
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
    sampler = TokenBudgetBatchSampler(lengths, max_tokens="auto", seed=0)
    chosen = auto_budget(model, sampler, optimizer=optimizer, cache=BudgetCache(spec["cache"]))
    after_probe = vm_status("VmSize")

    def train(max_tokens: float) -> dict[str, Any]:
        run = TokenBudgetBatchSampler(lengths, max_tokens, seed=0)
        report: dict[str, Any] = {"steps": 0, "oom": False, "error": None}
        # The plan's costliest batches first: whether a budget fits is decided by its costliest
        # batches, which the first steps of a shuffled epoch need not hold.
        costs = run.plan.batch_costs(run.lengths, run.cost)
        try:
            for index in np.argsort(-costs, kind="stable"):
                step(run.plan.batch(int(index)).tolist())
                report["steps"] += 1
                if report["steps"] >= spec["max_steps"]:
                    break
        except Exception as error:
            if not is_oom(error):
                raise
            report.update(oom=True, error=str(error)[:200])
        return report

    children = [in_fork(functools.partial(train, b)) for b in (chosen.max_tokens, 2 * chosen.max_tokens)]
    runs = []
    for pid, pipe in children:
        with os.fdopen(pipe) as handle:
            runs.append(json.loads(handle.read()))
        os.waitpid(pid, 0)
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    report = {
        "max_tokens": chosen.max_tokens,
        "source": chosen.source,
        "memory_limit": chosen.memory_limit,
        "estimate": chosen.estimate,
        "key_memory": chosen.key.memory_bytes,
        "rlimit": limit,
        "vm_after_probe": after_probe,
        "at_budget": runs[0],
        "at_double": runs[1],
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
