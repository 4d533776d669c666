"""Launched on 2 processes (gloo) by tests/test_stream_oom_distributed.py: OOMFallback over a stream.

Usage: torchrun --standalone --nproc_per_node 2 stream_oom_ddp.py OUT_DIR

Each rank reads its own part of the stream (rank and world from the process
group) into a DDP model; out-of-memory errors are injected on rank 1 only.
Writes, per mode, each trained step's example ids and the budgets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from oom_common import collate, loss_fn, make_rows, tiny_bert
from teardown import end_process_group

from tokenbatch import OOMFallback, TokenBudgetStream
from tokenbatch.testing import inject_oom

ROWS = 301  # odd: the ranks' parts differ by one example


def run(mode: str) -> dict[str, Any]:
    stream = TokenBudgetStream(make_rows(ROWS, seed=5, max_len=48), max_tokens=384, buffer_size=48, seed=3)
    model = DistributedDataParallel(tiny_bert())
    fallback = OOMFallback(stream, model, mode=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(stream, batch_size=None, collate_fn=collate)
    trained, costs = [], []
    with inject_oom(model, max_tokens=150, ranks=[1]):
        for batch in fallback.iterate(loader):
            costs.append(float(batch["input_ids"].shape[0] * batch["attention_mask"].sum(1).max()))
            loss = fallback.backward(batch, loss_fn(model))
            assert loss is not None
            fallback.step(optimizer)
            optimizer.zero_grad()
            trained.append(batch["idx"].tolist())
    run = stream._run
    assert run is not None
    return {
        "trained": trained,
        "costs": costs,
        "events": [[event.step, event.new_max_tokens] for event in fallback.events],
        "budget": fallback.max_tokens,
        "stream_budget": stream.max_tokens,
        "read": run.read,
        "left_out": run.left_out,
        "params": float(sum(p.detach().double().sum() for p in model.parameters())),
    }


def main(out: str) -> None:
    dist.init_process_group("gloo")
    report = {"rank": dist.get_rank(), **{mode: run(mode) for mode in ("halve", "split")}}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(report))
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1])
    end_process_group()
