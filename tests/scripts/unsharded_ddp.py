"""Launched on 2 processes by tests/test_sampler_distributed.py: plain DDP with a sampler left without rank=.

Usage: python -m torch.distributed.run --nproc_per_node 2 unsharded_ddp.py OUT_DIR

The guarded loop reads the global plan with a plain DataLoader on both ranks,
which would train every sample on every rank: ``fallback.iterate``, handed
that DataLoader, refuses it, and each rank writes the error it got to
``OUT_DIR/rank{r}.json``. (A loop over the DataLoader itself is not refused:
the sampler cannot tell a DataLoader from accelerate's sharding without
looking at its callers; ``docs/sampler.md`` says to pass ``rank=``.) A barrier
after the scenario shows that no rank was left waiting.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler

LENGTHS = [4 + i % 13 for i in range(64)]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(1, 1))
    sampler = TokenBudgetBatchSampler(LENGTHS, 64, seed=0)  # rank= forgotten
    loader = DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler)
    fallback = OOMFallback(sampler, model)

    def guarded_loop() -> None:
        for batch in fallback.iterate(loader):
            fallback.backward(batch, lambda b: model(b.float().unsqueeze(1)).sum())

    errors = {}
    for name, loop in (("guarded", guarded_loop),):
        try:
            loop()
            errors[name] = None
        except ValueError as error:
            errors[name] = {"type": type(error).__name__, "message": str(error)}
        dist.barrier()
    Path(sys.argv[1], f"rank{rank}.json").write_text(json.dumps(errors))


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
