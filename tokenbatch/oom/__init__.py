"""Surviving out-of-memory errors in training: shrink the budget and carry on, on every rank.

:class:`OOMFallback` guards the forward and backward pass of each training
step, and ``optimizer.step()`` through ``fallback.step(optimizer)``;
:class:`Split` and :class:`Halve` say what it does with a step that ran out
of memory. :class:`EvalGuard` (or ``OOMFallback.evaluate``) guards
evaluation batches the same way, splitting them into micro-batches.

Ranks never wait inside a pass that can fail: forward and backward run
under DDP's ``no_sync()``, the guard all-reduces gradients during backward in
a fixed order that a rank which fails still completes (``_overlap``; or, with
``overlap=False``, only after every rank succeeded), then one small
all-reduce tells every rank how every other rank's step went (ok, out of
memory, or another error). A rank that fails therefore never leaves another
waiting in a collective it will not reach.

Inside the package:

- ``_guard``: :class:`OOMFallback`, the budgets and the step protocol;
- ``_strategies``: :class:`Split` and :class:`Halve`;
- ``_grow``, ``_climb``, ``_peak``: climbing back after an OOM (:class:`Grow`,
  :class:`GrowEvent`): the bracket search, the guard's side of it, peak memory;
- ``_saved``: the guard's saved state (version 2; version 1 still read);
- ``_attempt``: one attempt of a step on this rank, with no collective;
- ``_accumulate``: the gradients accumulated before a step, kept through its failure;
- ``_optimizer``: ``optimizer.step()`` guarded the same way (``OOMFallback.step``);
- ``_outcome``: how each rank's attempt went, shared in one all-reduce, and
  the rule that derives the next :class:`OOMEvent` from it;
- ``_ddp``: the stand-in for DDP's reducer (``no_sync``, buffer broadcast,
  gradient averaging);
- ``_overlap``: gradient all-reduces overlapping backward, the same sequence on every rank;
- ``_eval``: :class:`EvalGuard`, guarded evaluation;
- ``_split``: reading a collated batch and cutting it into micro-batches;
- ``_detect`` and ``_events``: :func:`is_oom`, :func:`free_memory`, the event and the errors.
"""

from tokenbatch.oom._detect import free_memory, is_oom
from tokenbatch.oom._eval import EvalGuard
from tokenbatch.oom._events import OOMEvent, OptimizerOOMError, RankFailedError, SampleTooLargeError
from tokenbatch.oom._grow import Grow, GrowEvent
from tokenbatch.oom._guard import OOMFallback
from tokenbatch.oom._strategies import MODES, Halve, Split

__all__ = [
    "MODES",
    "EvalGuard",
    "Grow",
    "GrowEvent",
    "Halve",
    "OOMEvent",
    "OOMFallback",
    "OptimizerOOMError",
    "RankFailedError",
    "SampleTooLargeError",
    "Split",
    "free_memory",
    "is_oom",
]
