"""End a test script's process group itself, after its models are gone.

Left to interpreter teardown, gloo's threads can abort a rank ("terminate
called without an active exception", SIGABRT) on a busy machine, and a DDP
model that outlives the group can deadlock it (pytorch/pytorch#56297).
"""

from __future__ import annotations

import gc

import torch.distributed as dist


def end_process_group() -> None:
    """Collect what the script left (DDP reducers first), then destroy the process group."""
    gc.collect()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
