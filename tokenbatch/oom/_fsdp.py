"""The guard under FSDP2: which failures it recovers from in place, and how it stops the job otherwise.

Under FSDP2 (``torch.distributed.fsdp.fully_shard``, accelerate's FSDP plugin
with ``fsdp_version=2``, the Trainer's ``fsdp`` options) the model's forward
all-gathers each unit's parameters and its backward reduce-scatters their
gradients: the ranks run in lockstep inside the passes. A rank that runs out
of memory half-way leaves the others inside a collective it will never
issue, and no later collective of its own can release them: they would take
it for the one they wait in. So where the guard recovers depends on when the
error comes:

- **in place**, where no collective of the step has started on any rank: a
  micro-batch split that runs out of memory on a rank before the step's
  agreement (:func:`agree_pieces`, one small all-reduce that also makes every
  rank run the same number of forward and backward passes), and
  ``optimizer.step()`` (rank-local on sharded parameters; its outcomes are
  shared as usual). On one process FSDP has no peer to wait for, and the guard
  recovers in place as for a plain module;
- **by restart**, inside forward or backward on several processes: this rank
  records the lowered budget where the restarted job reads it (the guard's
  listeners, :func:`tokenbatch.probe.remember_budget`), then ends its process
  with :data:`EXIT_CODE` (:func:`end_process`). Its closed connections
  fail the other ranks' pending gloo collectives at once, and ``torchrun``'s
  agent stops the rest and, under ``--max-restarts``, starts every rank
  again, from the last complete checkpoint and under the lowered budget.

The process ends rather than raises: whatever ran after a raise on this rank
(a ``finally`` with a barrier, a framework's teardown, a retry loop) would
issue a collective that the other ranks, still inside FSDP's, would take for
theirs; and a process that raises takes seconds to exit while it holds a
process group (``benchmarks/fsdp_stop.py``). Any other error in the passes
ends its process too, with status 1 (:func:`end_on_error`): on the other
ranks that is the error of the collective whose peer has gone, so they end at
once as well, whatever their SIGTERM handlers do.

FSDP1 (``FullyShardedDataParallel``) and DeepSpeed are refused
(:func:`check_sharding`): their engines run the same lockstep collectives, with
hooks and flat parameters of their own that tokenbatch has not been tested on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from typing import Any, NoReturn

from torch import nn

from tokenbatch import _distributed as distributed
from tokenbatch.oom._errors import OptimizerOOMError, RankFailedError, SampleTooLargeError

logger = logging.getLogger("tokenbatch.oom")

EXIT_CODE = 75
"""The exit status of a rank stopped for a restart: ``EX_TEMPFAIL``, a temporary failure worth a retry."""


def _fsdp() -> Any:
    """``torch.distributed.fsdp`` if something imported it (nothing is sharded otherwise), else None.

    Importing it takes seconds; a run that does not shard should not pay for it.
    """
    return sys.modules.get("torch.distributed.fsdp")


def is_fsdp2(model: nn.Module) -> bool:
    """True when ``model`` or one of its submodules is sharded by FSDP2 (``fully_shard``).

    ``FSDPModule`` is public since torch 2.6; before, FSDP2 was private and is not recognised.
    """
    fsdp2 = getattr(_fsdp(), "FSDPModule", None)
    return fsdp2 is not None and any(isinstance(m, fsdp2) for m in model.modules())


def in_lockstep(model: nn.Module) -> bool:
    """True when the model's passes hold collectives: FSDP2 on several processes."""
    return distributed.is_initialized() and distributed.world_size() > 1 and is_fsdp2(model)


def shard_count(model: nn.Module) -> int:
    """Into how many shards the model's parameters are cut (1 for a model that is not sharded).

    Read from the parameters' ``DTensor`` placements: the size of each mesh dimension they are
    sharded over (FSDP's group; with HSDP, the shard dimension, not the replicas).
    """
    count = 1
    for param in model.parameters():
        mesh, placements = getattr(param, "device_mesh", None), getattr(param, "placements", None)
        if mesh is None or placements is None:
            continue
        shards = 1
        for dim, placement in enumerate(placements):
            if placement.is_shard():
                shards *= int(mesh.size(dim))
        count = max(count, shards)
    return count


def check_sharding(model: nn.Module, accelerator: Any = None) -> None:
    """Refuse FSDP1 and DeepSpeed, saying why and what works instead.

    Raises:
        ValueError: ``model`` is wrapped by ``FullyShardedDataParallel`` or is a DeepSpeed engine.
    """
    deepspeed = type(model).__module__.startswith("deepspeed") or (
        str(getattr(accelerator, "distributed_type", "")).endswith("DEEPSPEED")
    )
    if deepspeed:
        raise ValueError(
            "model should be a plain module, a DDP one or an FSDP2 one (fully_shard) for OOMFallback, but "
            "got a DeepSpeed engine: its backward and step are the engine's (accelerator.backward calls "
            "engine.backward, which also steps at accumulation boundaries), so the guard can neither run "
            "a batch again nor tell a rank's failure from a finished step. Use FSDP2 (accelerate's "
            "FullyShardedDataParallelPlugin(fsdp_version=2), whose parameters, gradients and optimizer "
            "state are sharded like ZeRO-3's), or train under DeepSpeed without the guard"
        )
    fsdp1 = getattr(_fsdp(), "FullyShardedDataParallel", None)
    if fsdp1 is not None and any(isinstance(m, fsdp1) for m in model.modules()):
        raise ValueError(
            "model should be sharded with FSDP2 (torch.distributed.fsdp.fully_shard; accelerate's "
            "FullyShardedDataParallelPlugin(fsdp_version=2); the Trainer's fsdp_config={'fsdp_version': 2}) "
            "for OOMFallback, but got FSDP1's FullyShardedDataParallel, whose flat parameters and hooks "
            "the guard does not handle; switch to fsdp_version=2"
        )


def end_process(message: str, *, status: int = EXIT_CODE, error: BaseException | None = None) -> NoReturn:
    """End this process with ``status`` after logging ``message`` (and ``error``'s traceback), logs flushed.

    Nothing else runs on this rank (no ``finally``, no ``atexit``): see the module.
    """
    logger.error("%s", message, exc_info=(type(error), error, error.__traceback__) if error else None)
    # A handler or stream that cannot flush must not keep the process alive: the other ranks wait.
    for flushable in [*logging.getLogger().handlers, *logger.handlers, sys.stdout, sys.stderr]:
        with contextlib.suppress(Exception):
            flushable.flush()
    os._exit(status)


@contextlib.contextmanager
def ends_on_error(where: str) -> Iterator[None]:
    """Around the guard's agreements under FSDP: an error that not every rank raises ends the process.

    The guard's own verdicts (:class:`~tokenbatch.oom.OptimizerOOMError`, ...) come on every rank
    together and are raised; anything else (a collective whose peer has gone) goes to
    :func:`end_on_error`.
    """
    try:
        yield
    except (OptimizerOOMError, RankFailedError, SampleTooLargeError):
        raise
    except Exception as error:
        end_on_error(error, where)


def end_on_error(error: BaseException, where: str) -> NoReturn:
    """An error that is not out-of-memory in the passes: log it and end the process with status 1.

    Raised instead, it would take seconds to end a process holding a process group (measured in
    ``benchmarks/fsdp_stop.py``), and whatever the loop runs on the way out could meet the other
    ranks in the wrong collective. On the other ranks it is often the error of a collective that
    lost its peer (gloo: "Connection closed by peer"): this ends them at once, even where a
    SIGTERM handler would keep torchrun from doing so.
    """
    end_process(
        f"{type(error).__name__} at {where} on rank {distributed.rank()}, under FSDP on "
        f"{distributed.world_size()} processes, where no rank can recover in place: this process ends "
        f"(status 1) rather than raise, so that no rank waits for it",
        status=1,
        error=error,
    )
