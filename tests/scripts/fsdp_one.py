"""Run by tests/test_fsdp.py under ``torchrun --nproc_per_node 1``: FSDP on one process, and FSDP1.

Usage: fsdp_one.py OUT

On one process FSDP2 has no peer to wait for: the guard recovers in place, as for a plain
module, from out of memory in a forward pass and in a backward pass (``inject_oom``'s backward
hook under FSDP2, whose sharded parameters are not in the graph). FSDP1's
``FullyShardedDataParallel`` is refused. Writes ``OUT/one.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.oom._fsdp import in_lockstep, shard_count
from tokenbatch.testing import inject_oom


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 4), torch.nn.Linear(4, 1))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    lengths = [2 + i % 5 for i in range(24)]
    sampler = TokenBudgetBatchSampler(lengths, 24, seed=0, rank=0)
    batches = [torch.tensor([[i % 20] * max(lengths[j] for j in ids) for i in ids]) for ids in sampler]
    fallback = OOMFallback(sampler, model, mode="split")
    losses = []
    with inject_oom(model, max_tokens=12, times=1), inject_oom(model, 12, where="backward", after=2, times=1):
        for batch in fallback.iterate(batches):
            losses.append(fallback.backward(batch, lambda b: model(b).square().mean()))
    try:
        OOMFallback(sampler, FullyShardedDataParallel(torch.nn.Linear(2, 2), device_id=torch.device("cpu")))
        refused = ""
    except ValueError as error:
        refused = str(error)
    report = {
        "lockstep": in_lockstep(model),
        "shards": shard_count(model),
        "events": [event.as_dict() for event in fallback.events],
        "steps": fallback.steps_done,
        "batches": len(batches),
        "trained": sum(loss is not None for loss in losses),
        "fsdp1": refused,
    }
    Path(out, "one.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
