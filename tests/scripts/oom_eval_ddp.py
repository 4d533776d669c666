"""Guarded evaluation on 2 real processes (torchrun, gloo, a DDP-wrapped tiny BERT), OOM on one rank.

Usage: python -m torch.distributed.run --nproc_per_node 2 oom_eval_ddp.py OUT_DIR

Each rank evaluates its own batches of the plan (of other sizes than the
other rank's at the same step), in every scenario below, and writes what
tests/test_oom_eval.py checks to ``OUT_DIR/rank{r}.pt``:

- ``plain``: no guard, the model called directly (DDP broadcasts its buffers in every forward);
- ``guarded``: through ``OOMFallback.evaluate``, no out-of-memory error;
- ``oom``: batches over ``LIMIT`` padded tokens run out of memory on rank 1 only;
- ``error``: rank 1 raises a ValueError at its third batch;
- ``too_large``: every batch runs out of memory on rank 0, down to single samples.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import collate, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.oom import RankFailedError
from tokenbatch.testing import inject_oom

BUDGET = 256
LIMIT = 150  # rank 1's batches above this many padded tokens run out of memory (scenario oom)


def evaluate(scenario: str) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    rows = make_rows(96, seed=1)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], BUDGET, shuffle=False, rank=rank)
    batches = [collate([rows[i] for i in indices]) for indices in sampler]
    model = DistributedDataParallel(tiny_bert(0)).eval()
    fallback = OOMFallback(sampler, model)
    injector = None
    if scenario in ("oom", "too_large"):
        injector = inject_oom(model, LIMIT if scenario == "oom" else 1, ranks=[1 if scenario == "oom" else 0])

    def forward(batch: dict[str, torch.Tensor]) -> Any:
        if scenario == "error" and rank == 1 and fallback.eval_guard.batches == 3:
            raise ValueError("not an OOM: rank 1 at its third batch")
        inputs = {k: v for k, v in batch.items() if k != "idx"}
        out = model(**inputs)
        return out.loss, out.logits, batch["idx"]

    results, error = [], None
    try:
        for batch in batches:
            if scenario == "plain":
                with torch.no_grad():
                    results.append(forward(batch))
            else:
                results.append(fallback.evaluate(batch, forward))
    except (ValueError, RankFailedError, SampleTooLargeError) as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {
        "sizes": [len(b["idx"]) for b in batches],
        "results": results,
        "events": [e.as_dict() for e in fallback.eval_guard.events],
        "eval_max_tokens": fallback.eval_guard.max_tokens,
        "max_tokens": fallback.max_tokens,
        "injected": None if injector is None else injector.count,
        "error": error,
    }


def main() -> None:
    quiet()
    dist.init_process_group("gloo")
    out = Path(sys.argv[1])
    results = {name: evaluate(name) for name in ("plain", "guarded", "oom", "error", "too_large")}
    torch.save(results, out / f"rank{dist.get_rank()}.pt")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
