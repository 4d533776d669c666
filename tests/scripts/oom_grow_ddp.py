"""Growth after OOM on 2 processes, a limit per rank; run by tests/test_oom_grow_distributed.py.

Usage: python -m torch.distributed.run --nproc_per_node 2 oom_grow_ddp.py OUT_DIR

Rank 0's batches run out of memory above 200 padded tokens, rank 1's above
150: the ranks must still agree on every budget (each derives it from the
same shared outcomes and the same plan), train every sample exactly once,
and never wait for each other forever. Each scenario writes, per rank, what
it trained, the events, the budgets and the final parameters.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom

BUDGET = 500  # 3.3x rank 1's limit: halving lands at 125, below it
LIMITS = (200, 150)  # per rank
EPOCHS = 3


def train(accelerator: Any, *, mode: str, where: str) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    rows = make_rows()
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], BUDGET, seed=0)
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode)
    injector = inject_oom(model, LIMITS[accelerator.process_index], where=where)
    forward = loss_fn(model)
    trained: list[list[int]] = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        trained.append([])
        for batch in fallback.iterate(loader):
            if fallback.backward(batch, forward) is not None:
                trained[-1] += batch["idx"].tolist()
                optimizer.step()
                optimizer.zero_grad()
    injector.remove()
    return {
        "trained": trained,
        "num_samples": len(rows),
        "events": [e.as_dict() for e in fallback.events],
        "growth_events": [e.as_dict() for e in fallback.growth_events],
        "max_tokens": fallback.max_tokens,
        "sampler_max_tokens": sampler.max_tokens,
        "injected": injector.count,
        "params": flat_params(model),
    }


SCENARIOS = {
    "halve_forward": {"mode": "halve", "where": "forward"},
    "split_backward": {"mode": "split", "where": "backward"},
}


def main() -> None:
    quiet()
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    out = Path(sys.argv[1])
    results = {name: train(accelerator, **options) for name, options in SCENARIOS.items()}
    torch.save(results, out / f"rank{accelerator.process_index}.pt")
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
