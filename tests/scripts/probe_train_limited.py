"""Train a tiny BERT under a real address-space limit (RLIMIT_AS) at given token budgets.

Usage: python probe_train_limited.py SPEC_JSON, where the JSON holds ``config``
(BertConfig kwargs), ``seed``, ``lengths``, ``budgets`` (a list of
``max_tokens``), ``cost`` (CostModel kwargs), ``memory_limit`` (the limit
handed to the probe, in bytes of tensors) and ``max_steps``. Prints one JSON
line: a list with one report per budget, ``{"ok": true, ...}`` or
``{"ok": false, "oom": true, ...}``.

The model is built and warmed up once; each budget then trains in a forked
copy of this process, all at once. A fork starts from the state a fresh
process has after its warm-up (and none of them sees what another one's
failed allocations did to the heap), while torch and transformers are
imported once instead of once per budget, which was most of the time.

RLIMIT_AS caps virtual address space, and a torch process maps hundreds of
MiB (shared libraries, thread stacks, allocator arenas) that it never
touches, so an absolute limit says nothing. We calibrate instead: after the
warm-up step (optimizer state created, kernels loaded) each fork reads its own
VmSize and allows ``VmSize + memory_limit - held`` where ``held`` is what the
weights, buffers and optimizer state already occupy (the probe counts them in
its limit, and they are inside VmSize already). The parent runs us with
MALLOC_MMAP_THRESHOLD_ set, so glibc maps every tensor of 64 KiB or more on
its own and unmaps it when freed; with glibc's default sliding threshold,
freed blocks up to 32 MiB stay in the heap and the address space grows to
about twice the live tensor bytes, which is glibc's fragmentation, not the
model's memory.
"""

from __future__ import annotations

import functools
import json
import os
import resource
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch


def vm_status(field: str) -> int:
    """A ``Vm*`` line of /proc/self/status (VmSize, VmPeak), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def in_fork(fn: Callable[[], dict[str, Any]]) -> tuple[int, int]:
    """Start ``fn`` in a forked child; returns its pid and the pipe its JSON report comes back on."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            payload, code = json.dumps(fn()), 0
        except BaseException:
            payload, code = json.dumps({"ok": False, "crash": traceback.format_exc()}), 1
        with os.fdopen(write_end, "w") as handle:
            handle.write(payload)
        os._exit(code)  # no atexit handlers, no flushing the parent's buffers twice
    os.close(write_end)
    return pid, read_end


def main() -> None:
    # is_oom asks accelerate; import it here, not under the limit after an OOM.
    import accelerate.utils.memory  # noqa: F401
    from transformers import BertConfig, BertForSequenceClassification

    from tokenbatch import CostModel, TokenBudgetBatchSampler, is_oom
    from tokenbatch.probe._measure import held_bytes

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)  # also: no OpenMP thread pool to break in the forks
    torch.manual_seed(spec["seed"])
    config = BertConfig(**spec["config"])
    config._attn_implementation = "eager"
    model = BertForSequenceClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = spec["lengths"]
    generator = torch.Generator().manual_seed(spec["seed"])
    data = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]

    def step(indices: list[int]) -> None:
        width = max(lengths[i] for i in indices)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            ids[row, : lengths[i]] = data[i]
            mask[row, : lengths[i]] = 1
        labels = torch.zeros(len(indices), dtype=torch.long)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def train(max_tokens: float) -> dict[str, Any]:
        sampler = TokenBudgetBatchSampler(
            lengths, max_tokens, cost=CostModel(**spec["cost"]), seed=spec["seed"], oversize="error"
        )
        held = held_bytes(model, optimizer)
        base = vm_status("VmSize")
        allowed = base + spec["memory_limit"] - held
        report: dict[str, Any] = {"ok": True, "oom": False, "steps": 0, "base_vmsize": base, "held": held}
        report["error"] = None
        costs = []
        resource.setrlimit(resource.RLIMIT_AS, (allowed, resource.RLIM_INFINITY))
        try:
            for indices in sampler:
                costs.append(sampler.cost.cost(len(indices), max(lengths[i] for i in indices)))
                step(indices)
                report["steps"] += 1
                if report["steps"] >= spec["max_steps"]:
                    break
        except Exception as error:
            resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
            if not is_oom(error):
                raise
            report.update(ok=False, oom=True, error=str(error)[:300])
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        report.update(
            max_batch_cost=max(costs), allowed_growth=allowed - base, peak_growth=vm_status("VmPeak") - base
        )
        return report

    step([0])  # warm-up: optimizer state, kernels
    children = [in_fork(functools.partial(train, budget)) for budget in spec["budgets"]]
    reports = []
    for pid, pipe in children:
        with os.fdopen(pipe) as handle:
            reports.append(json.loads(handle.read()))
        os.waitpid(pid, 0)
    print(json.dumps(reports))


if __name__ == "__main__":
    main()
