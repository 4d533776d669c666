"""Multi-process OOM scenarios, run by tests/test_oom_distributed.py under torchrun (2 ranks, gloo).

Usage: python -m torch.distributed.run --nproc_per_node 2 oom_ddp.py OUT_DIR

Every scenario trains a tiny BERT for two epochs from the same seed, with the
model wrapped by ``accelerator.prepare`` (so DDP is real), and writes what the
test checks to ``OUT_DIR/rank{r}.pt``: the sample indices each rank trained
on, the budgets, the events, the errors raised, and the final parameters.
The scenarios run one after the other in the same processes, which also
shows that the process group is still usable after each failure.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.oom import RankFailedError
from tokenbatch.testing import inject_oom

BUDGET = 256
LIMIT = 200  # rank 1's batches above this many padded tokens "run out of memory"
EPOCHS = 2


def train(
    accelerator: Any,
    *,
    mode: str,
    where: str | None = None,
    fail: str | None = None,
    plain: bool = False,
    unguarded: bool = False,
) -> dict[str, Any]:
    """One run; ``where`` injects OOM on rank 1, ``fail`` raises something else there."""
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    rows = make_rows()
    lengths = [len(r["input_ids"]) for r in rows]
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank = accelerator.process_index
    if plain:  # torch DDP without accelerate: the sampler yields this rank's batches itself
        sampler = TokenBudgetBatchSampler(lengths, BUDGET, seed=0, rank=rank)
        loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
        model = DistributedDataParallel(model)
        fallback = OOMFallback(sampler, model, mode=mode, grow=False)  # plain halving: oom_grow_ddp.py grows
    else:
        sampler = TokenBudgetBatchSampler(lengths, BUDGET, seed=0)
        loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode, grow=False)
    injector = None
    if where is not None:
        limit = 5 if fail == "too_large" else LIMIT
        injector = inject_oom(model, limit, where=where, ranks=[1])
    forward = loss_fn(model)
    if fail == "error":
        # Raised before the model is called: DDP's own buffer broadcast would wait for it forever.
        def forward(batch: dict[str, torch.Tensor], plain_forward: Any = forward) -> torch.Tensor:
            if rank == 1 and fallback.steps_done == 2:
                raise ValueError("not an OOM: rank 1 at step 2")
            return plain_forward(batch)

    trained: list[int] = []
    losses: list[float] = []
    error = None
    start = time.perf_counter()
    try:
        for epoch in range(EPOCHS):
            sampler.set_epoch(epoch)
            for batch in fallback.iterate(loader):
                if unguarded:  # the plain accelerate loop, for comparison
                    loss = forward(batch)
                    accelerator.backward(loss)
                else:
                    loss = fallback.backward(batch, forward)
                if loss is not None:
                    trained += batch["idx"].tolist()
                    losses.append(float(loss))
                    optimizer.step()
                    optimizer.zero_grad()
    except (ValueError, RankFailedError, SampleTooLargeError) as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {
        "trained": trained,
        "losses": losses,
        "max_tokens": fallback.max_tokens,
        "sampler_max_tokens": sampler.max_tokens,
        "events": [e.as_dict() for e in fallback.events],
        "injected": None if injector is None else injector.count,
        "error": error,
        "params": flat_params(model),
        "seconds": time.perf_counter() - start,
    }


SCENARIOS: dict[str, dict[str, Any]] = {
    "unguarded": {"mode": "split", "unguarded": True},
    "reference": {"mode": "split"},
    "split_forward": {"mode": "split", "where": "forward"},
    "split_backward": {"mode": "split", "where": "backward"},
    "halve_forward": {"mode": "halve", "where": "forward"},
    "halve_backward": {"mode": "halve", "where": "backward"},
    "halve_backward_plain_ddp": {"mode": "halve", "where": "backward", "plain": True},
    "error": {"mode": "split", "fail": "error"},
    "too_large": {"mode": "split", "where": "backward", "fail": "too_large"},
}


def main() -> None:
    quiet()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s rank? %(name)s: %(message)s")
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
