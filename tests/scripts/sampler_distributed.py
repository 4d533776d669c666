"""Launched on 2 processes by tests/test_sampler_distributed.py; writes what each rank saw.

Usage: accelerate launch --num_processes 2 ... sampler_distributed.py OUT.json
"""

import json
import sys

import numpy as np
import torch.distributed as dist
from accelerate import Accelerator
from torch.utils.data import DataLoader

from tokenbatch import CostModel, TokenBudgetBatchSampler

LENGTHS = np.clip(np.round(np.random.default_rng(0).lognormal(np.log(50), 0.9, 1237)), 2, 400).astype(int)
SETTINGS = {"max_tokens": 2048, "cost": CostModel(quadratic=1 / 256), "seed": 11}


def main(out: str) -> None:
    # Built before Accelerator(): the world size must come from the launcher's environment.
    global_sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS)
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(DataLoader(list(range(len(LENGTHS))), batch_sampler=global_sampler))
    local_sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS, rank=dist.get_rank())
    plain = DataLoader(list(range(len(LENGTHS))), batch_sampler=local_sampler)

    report: dict[str, object] = {"world": global_sampler.num_replicas, "epochs": []}
    for epoch in range(2):
        global_sampler.set_epoch(epoch)
        local_sampler.set_epoch(epoch)
        seen = {
            "accelerate": {"len": len(prepared), "batches": [b.tolist() for b in prepared]},
            "ddp": {"len": len(plain), "batches": [b.tolist() for b in plain]},
        }
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, seen)
        report["epochs"].append(gathered)  # type: ignore[attr-defined]
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump(report, handle)
    accelerator.wait_for_everyone()
    # A gloo group left for interpreter teardown can abort a rank ("terminate called without
    # an active exception") when the machine is busy; end it while both ranks are here.
    accelerator.end_training()


if __name__ == "__main__":
    main(sys.argv[1])
