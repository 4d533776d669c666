"""Launched on 2 processes by tests/test_integration_accelerate.py: gather_samples, then finish.

Usage: ``accelerate launch --num_processes 2 ... accelerate_gather.py OUT_DIR``; every rank
writes ``OUT_DIR/rank<r>.json`` with what it gathered, so the test can count the ids.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.integrations.accelerate import finish, gather_samples

# Lengths from 2 to 150: token-budget batches of very different sizes, 101 examples (odd).
LENGTHS = np.clip(np.round(np.random.default_rng(3).lognormal(np.log(30), 0.8, 101)), 2, 150).astype(int)
SETTINGS = {"max_tokens": 1200, "cost": CostModel(quadratic=1 / 64), "shuffle": False}
FIXED = 9  # examples in the fixed-size loader: batches of 5 on 2 processes, so accelerate repeats one


def collate(items: list[dict[str, int]]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([item["id"] for item in items])
    # Per example: its id, and a 2-D row that says which example it came from.
    return {"id": ids, "row": torch.stack([ids * 10, ids * 10 + 1, ids * 10 + 2], dim=1).float()}


def errors(accelerator: Accelerator) -> dict[str, str]:
    """What each process raises when one process passes something that does not fit."""
    rank, raised = accelerator.process_index, {}
    cases: dict[str, Any] = {
        # rank 1's rows are 3 wide, rank 0's 2 wide: no gather could put them together
        "width": torch.zeros(2, 2 + rank),
        # rank 1 passes a string where rank 0 passes a tensor
        "type": torch.zeros(2) if rank == 0 else "not a tensor",
        # rank 1's two tensors disagree on the batch size
        "rows": (torch.zeros(2), torch.zeros(2 + rank)),
    }
    for name, data in cases.items():
        try:
            gather_samples(accelerator, data)
        except (TypeError, ValueError) as error:
            raised[name] = f"{type(error).__name__}: {error}"
        else:
            raised[name] = "nothing"
    return raised


def main(out: Path) -> None:
    # Built before Accelerator(): the sampler reads the world size from the launcher's environment.
    sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS)
    accelerator = Accelerator(cpu=True)
    rank = accelerator.process_index
    items = [{"id": i} for i in range(len(LENGTHS))]
    budget = accelerator.prepare(DataLoader(items, batch_sampler=sampler, collate_fn=collate))
    report: dict[str, Any] = {"rank": rank, "world": accelerator.num_processes}

    # 1. Token-budget batches: sizes differ between the ranks at most steps.
    sizes, ids, rows = [], [], []
    for batch in budget:
        sizes.append(len(batch["id"]))
        got_ids, got_rows = gather_samples(accelerator, (batch["id"], batch["row"]))
        ids += got_ids.tolist()
        rows += got_rows.tolist()
    report["budget"] = {"sizes": sizes, "ids": ids, "rows": rows}

    # 2. Direct calls: rank r passes r + 2 rows, then rank 1 none at all; a dict keeps its keys.
    mine = torch.arange(rank + 2) + 100 * rank
    report["direct"] = gather_samples(accelerator, mine).tolist()
    empty = torch.arange(3) if rank == 0 else torch.zeros(0, dtype=torch.long)
    report["empty"] = gather_samples(accelerator, empty).tolist()
    nested = gather_samples(accelerator, {"a": mine, "b": mine.float() / 2})
    report["nested"] = {key: value.tolist() for key, value in nested.items()}

    # 3. A fixed-size loader: accelerate completes the last step by repeating an example;
    # equal batch sizes go through gather_for_metrics, which drops the repeat.
    fixed = accelerator.prepare(DataLoader(items[:FIXED], batch_size=5, collate_fn=collate))
    report["fixed"] = [i for batch in fixed for i in gather_samples(accelerator, batch["id"]).tolist()]

    # 4. Mismatches raise on every rank, and the ranks stay in step afterwards.
    report["errors"] = errors(accelerator)
    report["after_errors"] = gather_samples(accelerator, torch.tensor([rank])).tolist()

    # 5. A DDP model trained one step, then the clean shutdown.
    def train() -> None:
        model = accelerator.prepare(torch.nn.Linear(3, 1))
        model(torch.ones(4, 3)).sum().backward()
        report["ddp"] = type(model).__name__

    train()  # returns: its reference to the DDP model is gone before finish()
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    finish(accelerator)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
