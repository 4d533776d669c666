"""How the readers of a :class:`~tokenbatch.TokenBudgetStream` on several ranks agree, and what they refuse.

An agreement is the element-wise maximum of a short list of floats over all
ranks: ``agree([a, b]) -> [max a, max b]`` (a minimum is the maximum of the
negated values). By default it runs over ``torch.distributed``: on the
default group when its backend reduces CPU tensors (gloo), else on a gloo
group made once for it, so that the agreement never waits for the GPU
(an NCCL all-reduce plus ``.tolist()`` would block the host on every batch
until the queued backward has finished).
"""

from __future__ import annotations

import sys
import types
from typing import Any

import torch
import torch.distributed as dist

from tokenbatch import distributed
from tokenbatch.stream._run import Agree

_CPU_GROUPS: dict[int, Any] = {}

WORKERS_AND_RANKS = (
    "TokenBudgetStream with num_replicas={world} is being read in DataLoader worker {worker} of "
    "{workers}, where no process group reaches the other ranks, so the ranks cannot agree when to end "
    "the epoch (one rank would wait forever for another). Use num_workers=0 for the stream on several "
    "ranks (batching is cheap; tokenize in a datasets.map or the collate_fn), or pass agree= a function "
    "that agrees across the ranks' workers"
)
ACCELERATE = (
    "TokenBudgetStream is being read through accelerate's {wrapper}, which {what}; that breaks its "
    "batches on several processes (and its agreement between ranks would wait forever). Build the "
    "DataLoader on every rank, DataLoader(stream, batch_size=None, collate_fn=...), and do not pass it "
    "to accelerator.prepare (prepare the model and optimizer; move each batch to accelerator.device); "
    "register the stream with accelerator.register_for_checkpointing(stream) to save its position"
)
_WRAPPERS = {
    "DataLoaderDispatcher": "reads on process 0 only and splits each batch between processes "
    "(dispatch_batches=True, the default for iterable datasets)",
    "IterableDatasetShard": "reads the whole stream on every process and keeps every num_processes-th item",
}


def _cpu_group() -> Any:
    """The group to agree on with CPU tensors: the default one under gloo, else a gloo group made once."""
    if "gloo" in str(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:  # new_group is collective: every rank reaches its first agreement together
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]


def process_group(num_replicas: int) -> Agree:
    """The default agreement over ``torch.distributed``, after checking it spans ``num_replicas`` ranks."""
    if not distributed.is_initialized():
        raise RuntimeError(
            f"TokenBudgetStream with num_replicas={num_replicas} needs the ranks to agree when to end an "
            f"epoch, but no torch.distributed process group is initialised; initialise it (torchrun, "
            f"accelerate launch, or Accelerator()) before iterating, or pass agree="
        )
    if dist.get_world_size() != num_replicas:
        raise ValueError(
            f"num_replicas should be the process group's world size {dist.get_world_size()}, but got "
            f"num_replicas={num_replicas}; leave it None, or pass agree= to agree among other ranks"
        )
    group = _cpu_group()

    def agree(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        result: list[float] = tensor.tolist()
        return result

    return agree


def accelerate_wrapper() -> str | None:
    """The refusal message if an accelerate wrapper that breaks batches is iterating the stream, else None.

    Looks up the calling frames for the wrapper's ``self``, once per pass;
    wrappers in another process (a DataLoader worker's parent) cannot be seen.
    """
    frame: types.FrameType | None = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        owner = type(frame.f_locals.get("self"))
        if owner.__name__ in _WRAPPERS and owner.__module__.startswith("accelerate"):
            return ACCELERATE.format(wrapper=owner.__name__, what=_WRAPPERS[owner.__name__])
        frame = frame.f_back
    return None
