"""Surviving out-of-memory errors in training: shrink the budget and carry on, on every rank.

:class:`OOMFallback` guards each training step's forward and backward pass
(``mode="split"`` or ``"halve"``), ``optimizer.step()`` through
``fallback.step(optimizer)``, and evaluation batches through
``fallback.evaluate`` (or :class:`EvalGuard` on its own). :class:`Grow`
sets how it climbs back after an OOM; :class:`GrowEvent` records each larger
budget that trained. Ranks never wait inside a pass that can fail: forward
and backward run under DDP's ``no_sync()``, gradients are all-reduced in an
order a failed rank still completes, and one small all-reduce tells every
rank how every other rank's step went.

Inside the package, one topic per module:

- ``_guard``: :class:`OOMFallback`, the budgets, the step protocol and the loop's place in the epoch;
- ``_step``: one attempt of a step on this rank, the gradients kept through it, the ranks' outcomes;
- ``_ddp``: the stand-in for DDP's reducer (``no_sync``, buffers, gradient all-reduces);
- ``_fsdp``: under FSDP2, what is recovered in place and how a rank stops the job for a restart;
- ``_grow``: climbing back after an OOM;
- ``_split``: reading a collated batch and cutting it into micro-batches;
- ``_eval``: :class:`EvalGuard`, guarded evaluation;
- ``_optimizer``: ``optimizer.step()`` guarded the same way;
- ``_errors``: :func:`is_oom`, :func:`free_memory`, :class:`OOMEvent` and the errors.
"""

from tokenbatch.oom._errors import (
    OOMEvent,
    OptimizerOOMError,
    RankFailedError,
    SampleTooLargeError,
    free_memory,
    is_oom,
)
from tokenbatch.oom._eval import EvalGuard
from tokenbatch.oom._grow import Grow, GrowEvent
from tokenbatch.oom._guard import OOMFallback

__all__ = [
    "EvalGuard",
    "Grow",
    "GrowEvent",
    "OOMEvent",
    "OOMFallback",
    "OptimizerOOMError",
    "RankFailedError",
    "SampleTooLargeError",
    "free_memory",
    "is_oom",
]
