"""Gradient accumulation and optimizer steps under OOM, on 2 real processes (torchrun, gloo, accelerate).

Usage: python -m torch.distributed.run --nproc_per_node 2 oom_steps_ddp.py OUT_DIR [SCENARIO ...]

Run by tests/test_oom_steps_distributed.py. Every scenario trains a tiny BERT
without dropout for one epoch from the same seed, with model, optimizer and
data loader through ``accelerator.prepare`` (DDP is real), and writes what
the test checks to ``OUT_DIR/rank{r}.pt``:

- ``accumulate_*``: ``gradient_accumulation_steps=3`` under
  ``accelerator.accumulate``, one OOM on rank 1 in the 2nd (not syncing) or
  3rd (syncing) batch of a group; the batches each optimizer step trained and
  the parameters a hand-made DDP replay of those groups gives;
- ``step_*``: ``fallback.step(optimizer)`` with a FlakyAdam that runs out of
  memory on rank 1 (once, twice, or raises another error).
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flaky_optimizer import FlakyAdam
from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.oom import OptimizerOOMError, RankFailedError
from tokenbatch.testing import inject_oom

ROWS = make_rows(96)
BUDGET = 128  # 6 steps per rank: groups of steps (0, 1, 2) and (3, 4, 5)
LIMIT = 110  # rank 1's batches above this many padded tokens "run out of memory"
STEPS = 3  # gradient_accumulation_steps
LAST, MIDDLE = 2, 4  # the OOM hits the 3rd batch of the first group, or the 2nd of the second


def train(
    accelerator: Any,
    *,
    mode: str = "split",
    where: str | None = None,
    at: int = 0,
    accumulate: bool = False,
    unguarded: bool = False,
    optimizer: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    accelerator.gradient_accumulation_steps = STEPS if accumulate else 1
    accelerator.step = 0
    model = tiny_bert(0)
    if optimizer is None:
        opt: torch.optim.Optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        opt = FlakyAdam(model.parameters(), lr=1e-3, ranks=[1], **optimizer)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in ROWS], BUDGET, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode)
    injector = None if where is None else inject_oom(model, LIMIT, where=where, ranks=[1], after=at, times=1)
    forward = loss_fn(model)
    groups: list[list[list[int]]] = []  # per optimizer step, this rank's batches (sample indices)
    pending: list[list[int]] = []
    error = None
    start = time.perf_counter()
    try:
        for batch in fallback.iterate(loader):
            with accelerator.accumulate(model):
                if unguarded:  # the plain accelerate loop, for comparison
                    loss = forward(batch)
                    accelerator.backward(loss)
                else:
                    loss = fallback.backward(batch, forward)
                if loss is not None:
                    pending.append(batch["idx"].tolist())
                    fallback.step(opt)
                    opt.zero_grad()
                    if accelerator.sync_gradients:
                        groups.append(pending)
                        pending = []
    except (OptimizerOOMError, RankFailedError, ValueError) as exc:
        error = {"type": type(exc).__name__, "message": str(exc), "retried": getattr(exc, "retried", None)}
    seconds = time.perf_counter() - start
    return {
        "groups": groups,
        "pending": pending,
        "params": flat_params(model),
        "replayed": replay(groups) if accumulate and error is None else None,
        "events": [e.as_dict() for e in fallback.events],
        "injected": None if injector is None else injector.count,
        "calls": None if optimizer is None else opt.optimizer.calls,
        "error": error,
        "seconds": seconds,
    }


def replay(groups: list[list[list[int]]]) -> torch.Tensor:
    """DDP by hand over the same groups: each rank's batches, loss / STEPS, gradients averaged, a step."""
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = loss_fn(model)
    world = dist.get_world_size()
    for group in groups:
        for indices in group:
            (forward(collate([ROWS[i] for i in indices])) / STEPS).backward()
        for param in model.parameters():
            grad = torch.zeros_like(param) if param.grad is None else param.grad
            grad.div_(world)
            dist.all_reduce(grad)
            param.grad = grad
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


SCENARIOS: dict[str, dict[str, Any]] = {
    "step_reference": {"optimizer": {}},
    "step_retry": {"optimizer": {"fail": {1}, "partial": "states"}},
    "step_persistent": {"optimizer": {"fail": {1, 2}, "partial": "states"}},
    "step_error": {"optimizer": {"fail": {2}, "partial": "value_error"}},
    "accumulate_unguarded": {"accumulate": True, "unguarded": True},
    "accumulate_reference": {"accumulate": True},
    "accumulate_split_middle": {"accumulate": True, "where": "backward", "at": MIDDLE},
    "accumulate_split_last": {"accumulate": True, "where": "backward", "at": LAST},
    "accumulate_halve_middle": {"accumulate": True, "mode": "halve", "where": "backward", "at": MIDDLE},
    "accumulate_halve_last": {"accumulate": True, "mode": "halve", "where": "forward", "at": LAST},
}


def main() -> None:
    quiet()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out = Path(sys.argv[1])
    names = sys.argv[2:] or list(SCENARIOS)
    results = {name: train(accelerator, **SCENARIOS[name]) for name in names}
    torch.save(results, out / f"rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
