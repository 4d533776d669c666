"""Which process am I, how many are there, and do we all agree.

Where tokenbatch touches ``torch.distributed`` (besides the OOM guard's
stand-in for DDP's gradient reducer, ``tokenbatch.oom._ddp``). When no process
group is initialised yet, the launchers' environment variables (``WORLD_SIZE``
and ``RANK``, set by ``torchrun`` and ``accelerate launch``) answer instead, so
a sampler built before ``Accelerator()`` still plans for the right world size.

The agreements between ranks are small and generic: the element-wise maximum
or sum of a few floats, and a gather of picklable objects.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    """True inside an initialised ``torch.distributed`` process group."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes: the process group's, else ``$WORLD_SIZE``, else 1."""
    if is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: the process group's, else ``$RANK``, else 0."""
    if is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def all_reduce_max(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (identity on one process).

    ``device`` must be one the process group's backend can reduce on (CUDA
    tensors for NCCL, CPU tensors for gloo).
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_objects(value: object) -> list[object]:
    """``value`` from every rank, in rank order (``[value]`` on one process)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: the current GPU for NCCL, else CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` summed element-wise over all ranks, returned on the CPU (itself on one process).

    The sum runs on :func:`collective_device`, so a CPU tensor may be passed
    whatever the backend.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return tensor
    tensor = tensor.to(collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor.cpu()
