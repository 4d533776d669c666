"""Under torchrun on CPU without ACCELERATE_USE_CPU=1: accelerate trains alone on each of 2 processes.

``Accelerator()`` then starts the process group of the launch (world size 2) and
reports ``DistributedType.NO``, one process, so each process would train every
sample. Each way in is refused on every rank, before a batch is drawn: the guard
made with the accelerator, the guard made without it, the sampler read by the
prepared DataLoader in a loop of one's own, and a stream on these ranks. Each
rank writes ``rank<r>.json``: the error of each case (None if none was raised)
and whether any batch came out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler, TokenBudgetStream

LENGTHS = [3 + (i * 37) % 53 for i in range(64)]


def error_of(action: Any) -> str | None:
    try:
        action()
    except RuntimeError as error:
        return f"{type(error).__name__}: {error}"
    return None


def main(out: str) -> None:
    accelerator = Accelerator()
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    sampler = TokenBudgetBatchSampler(LENGTHS, 256)
    loader = accelerator.prepare(
        DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler, collate_fn=list)
    )
    drawn: list[Any] = []
    stream = TokenBudgetStream([{"input_ids": [0] * n} for n in LENGTHS], 256, buffer_size=16)
    report = {
        "world": dist.get_world_size(),
        "num_processes": accelerator.num_processes,
        "guard": error_of(lambda: OOMFallback(sampler, model, accelerator=accelerator)),
        "guard, no accelerator": error_of(lambda: OOMFallback(sampler, model)),
        "loop": error_of(lambda: drawn.extend(batch for batch in loader)),
        "stream": error_of(lambda: drawn.extend(DataLoader(stream, batch_size=None, collate_fn=list))),
    }
    report["drawn"] = len(drawn)
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1])
