"""Launched on 2 processes by tests/test_sampler_distributed.py: resume states saved on 1 and 3 processes.

Usage: accelerate launch --num_processes 2 ... sampler_resume.py STATES.json OUT.json

STATES.json holds sampler states saved by 1 and 3 processes; each rank resumes
each of them twice, through accelerate's prepared DataLoader (the global plan)
and through a plain DDP sampler for its rank, and reports the batches it got.
"""

import json
import sys

import torch.distributed as dist
from accelerate import Accelerator
from sampler_distributed import LENGTHS, SETTINGS
from torch.utils.data import DataLoader

from tokenbatch import TokenBudgetBatchSampler


def main(states_path: str, out: str) -> None:
    with open(states_path) as handle:
        states = json.load(handle)
    # Built before Accelerator(): the world size must come from the launcher's environment.
    global_sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS)
    accelerator = Accelerator(cpu=True)
    prepared = accelerator.prepare(DataLoader(list(range(len(LENGTHS))), batch_sampler=global_sampler))
    local_sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS, rank=dist.get_rank())
    plain = DataLoader(list(range(len(LENGTHS))), batch_sampler=local_sampler)
    report: dict[str, object] = {"world": global_sampler.num_replicas, "resumed": {}}
    for name, state in states.items():
        global_sampler.load_state_dict(state)  # every rank loads the one state saved
        local_sampler.load_state_dict(state)
        seen = {
            "start_step": local_sampler.start_step,
            "accelerate": {"len": len(prepared), "batches": [b.tolist() for b in prepared]},
            "ddp": {"len": len(plain), "batches": [b.tolist() for b in plain]},
        }
        gathered: list[object] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, seen)
        report["resumed"][name] = gathered  # type: ignore[index]
    if accelerator.is_main_process:
        with open(out, "w") as handle:
            json.dump(report, handle)
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    from teardown import end_process_group

    end_process_group()
