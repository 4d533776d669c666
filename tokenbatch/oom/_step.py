"""One guarded step on this rank: its attempt, the gradients kept through it, and the ranks' outcomes.

A step runs in three parts, and only the last one talks to the other ranks:

1. :class:`KeptGradients`: with gradient accumulation the parameters hold
   the group's earlier gradients when the step starts. The step runs into
   fresh gradients, the earlier ones moved aside (references, not copies)
   and added back once this rank's passes succeed, so a step that fails
   half-way leaves them intact.
2. :meth:`ForwardBackward.attempt`: the forward and backward passes of the
   batch, or of its micro-batches, never raising. Everything that can fail
   on one rank only (splitting, reading the batch, the passes) happens here;
   the only collectives it may issue are the overlapped gradient
   all-reduces of :mod:`tokenbatch.oom._ddp`, all of them on every attempt,
   failed or not, in the same order.
3. :func:`share`: one small all-reduce in which each rank writes its
   :class:`Outcome` into its own slot of a float64 tensor, so every rank
   holds every rank's outcome; from them every rank derives the same next
   :class:`~tokenbatch.oom.OOMEvent` (:func:`next_event`, pure) or raises
   the same way (:func:`raise_on_every_rank`). No rank is ever left waiting.

Why fresh gradients rather than a copy of the earlier ones: the price, only
while earlier gradients exist, is one gradient-sized buffer at the end of
the backward pass (the fresh gradients, allocated as the activations are
freed); a copy before the step would cost the same buffer for the whole
forward pass, at its activation peak. Zero gradients left by
``zero_grad(set_to_none=False)`` count as earlier ones.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.oom._ddp import DDPSync, GradientAverage, OverlapReducer, Round, unsupported
from tokenbatch.oom._errors import OOMEvent, RankFailedError, SampleTooLargeError, is_oom
from tokenbatch.oom._split import BatchShape, Piece, Weight, inspect_batch, split_batch

logger = logging.getLogger("tokenbatch.oom")


# -- the gradients accumulated before the step, kept through it ------------------------


class KeptGradients:
    """The gradients of ``params`` before a step, put back unless :meth:`release` was called.

    Use it as a context manager around the step: on entry the parameters'
    gradients are moved aside (when there are any); :meth:`add_into_grads`,
    after this rank's passes succeed, adds them into the step's fresh
    gradients; :meth:`release` (every rank succeeded) lets them go;
    :meth:`restore` (the step is dropped) and leaving the block without a
    release (an error) drop the step's gradients and put the earlier ones back.

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> weight.grad = torch.full((2,), 10.0)  # from an earlier batch of the group
        >>> with KeptGradients([weight]) as kept:
        ...     (weight * 2).sum().backward()  # the step, into a fresh gradient
        ...     kept.add_into_grads()
        ...     kept.release()
        >>> weight.grad
        tensor([12., 12.])
        >>> with KeptGradients([weight]):
        ...     (weight * 3).sum().backward()  # a step that fails after this, or is dropped
        >>> weight.grad
        tensor([12., 12.])
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        grads = [p.grad for p in self.params]
        self._kept: list[torch.Tensor | None] | None = grads if any(g is not None for g in grads) else None

    def __enter__(self) -> KeptGradients:
        if self._kept is not None:
            for param in self.params:
                param.grad = None
        return self

    @property
    def earlier(self) -> list[torch.Tensor | None] | None:
        """The gradients held aside, per parameter (None: there were none); not to be changed."""
        return self._kept

    def add_into_grads(self) -> None:
        """This rank's step has run: the parameters' gradients become the step's plus the earlier ones.

        The earlier tensors stay unchanged (the sum goes into the fresh
        gradient), so :meth:`restore` can still put them back.
        """
        if self._kept is None:
            return
        with torch.no_grad():
            for param, kept in zip(self.params, self._kept, strict=True):
                if kept is None:
                    continue
                fresh = param.grad
                if fresh is None:  # not used by this step: the earlier gradient, as it is
                    param.grad = kept
                elif fresh.is_sparse and not kept.is_sparse:
                    param.grad = kept + fresh  # a sparse tensor cannot take a dense one in place
                else:
                    fresh.add_(kept)

    def drop_step(self) -> None:
        """Set the gradients to None: what a failed attempt left is partial (the earlier ones stay aside)."""
        for param in self.params:
            param.grad = None

    def restore(self) -> None:
        """Drop the step's gradients and put the earlier ones back."""
        if self._kept is None:
            self.drop_step()
            return
        for param, kept in zip(self.params, self._kept, strict=True):
            param.grad = kept
        self._kept = None

    def release(self) -> None:
        """Every rank's step succeeded: the parameters keep the sums, the earlier tensors go."""
        self._kept = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._kept is not None:
            self.restore()


# -- how the step went on each rank, shared in one all-reduce ----------------------------

Status = Literal["ok", "oom", "error"]
Phase = Literal["", "forward", "backward"]
STATUSES: tuple[Status, ...] = ("ok", "oom", "error")
PHASES: tuple[Phase, ...] = ("", "forward", "backward")


@dataclass(frozen=True)
class Outcome:
    """How one rank's attempt at a step went.

    For ``"oom"``, ``cost``, ``longest`` and ``rows`` describe what failed:
    the whole batch, or the micro-batch that ran out of memory.
    """

    status: Status = "ok"
    phase: Phase = ""
    """Where it stopped: ``"forward"`` (splitting counts as forward) or ``"backward"``."""
    cost: float = 0.0
    longest: int = 0
    rows: int = 0

    def floats(self) -> list[float]:
        """The outcome as the floats of its slot in the all-reduce."""
        return [
            float(STATUSES.index(self.status)),
            float(PHASES.index(self.phase)),
            float(self.cost),
            float(self.longest),
            float(self.rows),
        ]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> Outcome:
        status, phase, cost, longest, rows = values
        return cls(STATUSES[int(status)], PHASES[int(phase)], float(cost), int(longest), int(rows))


WIDTH = len(dataclasses.fields(Outcome))


def pack(outcome: Outcome, flags: Sequence[bool], *, rank: int, world: int) -> torch.Tensor:
    """This rank's contribution to the all-reduce: ``outcome`` in its own slot, then ``flags``.

    Summed over the ranks, the tensor holds every rank's outcome and, per
    flag, how many ranks set it.

    Example:
        >>> ok, failed = Outcome(), Outcome("oom", "backward", cost=900.0, longest=90, rows=10)
        >>> summed = pack(ok, [True, False], rank=0, world=2) + pack(failed, [False, False], rank=1, world=2)
        >>> unpack(summed, world=2) == ([ok, failed], [True, False])
        True
    """
    tensor = torch.zeros(world * WIDTH + len(flags), dtype=torch.float64)
    tensor[rank * WIDTH : (rank + 1) * WIDTH] = torch.tensor(outcome.floats(), dtype=torch.float64)
    if len(flags):
        tensor[world * WIDTH :] = torch.tensor(list(flags), dtype=torch.float64)
    return tensor


def unpack(summed: torch.Tensor, world: int) -> tuple[list[Outcome], list[bool]]:
    """Every rank's outcome, in rank order, and per flag whether any rank set it."""
    values = summed.tolist()
    outcomes = [Outcome.from_floats(values[r * WIDTH : (r + 1) * WIDTH]) for r in range(world)]
    return outcomes, [v > 0 for v in values[world * WIDTH :]]


def share(outcome: Outcome, flags: Sequence[bool] = ()) -> tuple[list[Outcome], list[bool]]:
    """Every rank's outcome and, per position, whether any rank set ``flags``: one all-reduce.

    ``flags`` must have the same length on every rank.
    """
    if not distributed.is_initialized() or distributed.world_size() == 1:
        return [outcome], [bool(f) for f in flags]
    world = distributed.world_size()
    summed = distributed.all_reduce_sum(pack(outcome, flags, rank=distributed.rank(), world=world))
    return unpack(summed, world)


def share_count(outcome: Outcome, count: int) -> tuple[list[Outcome], int]:
    """Every rank's outcome and the largest ``count`` of any rank: one all-reduce.

    The pre-step agreement of a guard under FSDP: how each rank's split went, and how many
    forward and backward passes every rank then runs (the most any rank needs).

    Example:
        >>> share_count(Outcome(), 3)  # one process: its own
        ([Outcome(status='ok', phase='', cost=0.0, longest=0, rows=0)], 3)
    """
    if not distributed.is_initialized() or distributed.world_size() == 1:
        return [outcome], count
    world, rank, width = distributed.world_size(), distributed.rank(), WIDTH + 1
    tensor = torch.zeros(world * width, dtype=torch.float64)
    tensor[rank * width : (rank + 1) * width] = torch.tensor([*outcome.floats(), float(count)])
    values = distributed.all_reduce_sum(tensor).tolist()
    slots = [values[r * width : (r + 1) * width] for r in range(world)]
    return [Outcome.from_floats(slot[:WIDTH]) for slot in slots], int(max(slot[WIDTH] for slot in slots))


def next_event(
    outcomes: Sequence[Outcome],
    *,
    epoch: int,
    step: int,
    mode: str,
    max_tokens: float,
    factor: float,
    min_tokens: float | None,
    attempt: int,
) -> OOMEvent:
    """The event all ranks derive from the shared outcomes of a step in which some rank ran out of memory.

    The new budget is ``factor * min(max_tokens, cost of the costliest batch
    that failed)``, so a batch far under the budget that still fails is
    split at once, and never below ``min_tokens``.

    Raises:
        SampleTooLargeError: a rank ran out of memory on a single sample, or
            ``max_tokens`` is already at ``min_tokens``.

    Example:
        >>> outcomes = [Outcome(), Outcome("oom", "backward", cost=900.0, longest=90, rows=10)]
        >>> event = next_event(outcomes, epoch=0, step=3, mode="split", max_tokens=1024,
        ...                    factor=0.5, min_tokens=None, attempt=0)
        >>> event.new_max_tokens, event.ranks, event.where, event.longest
        (450.0, (1,), ('backward',), 90)
    """
    failing = {r: o for r, o in enumerate(outcomes) if o.status == "oom"}
    if not failing:
        raise ValueError("next_event needs at least one outcome with an out-of-memory status")
    longest = max(o.longest for o in failing.values())
    new = factor * min(max_tokens, max(o.cost for o in failing.values()))
    single = [r for r, o in failing.items() if o.rows == 1]
    if single:
        rank, length = single[0], failing[single[0]].longest
        raise SampleTooLargeError(
            f"a single sample of {length} tokens ran out of memory on its own (rank {rank}, epoch "
            f"{epoch}, step {step}, max_tokens={_checks.budget(max_tokens)}); nothing smaller is left to "
            f"try: truncate sequences below {length} tokens (the tokenizer's max_length), or free memory "
            f"(a smaller model or dtype, gradient checkpointing)",
            length=length,
            max_tokens=max_tokens,
            step=step,
            rank=rank,
        )
    if min_tokens is not None:
        if max_tokens <= min_tokens:
            raise SampleTooLargeError(
                f"out of memory at epoch {epoch}, step {step} on rank(s) {list(failing)} (longest sequence "
                f"{longest} tokens) with max_tokens={_checks.budget(max_tokens)} already at "
                f"min_tokens={_checks.budget(min_tokens)}; "
                f"lower min_tokens, truncate sequences, or free memory",
                length=longest,
                max_tokens=max_tokens,
                step=step,
                rank=next(iter(failing)),
            )
        new = max(new, min_tokens)
    return OOMEvent(
        epoch=epoch,
        step=step,
        mode=mode,
        old_max_tokens=float(max_tokens),
        new_max_tokens=float(new),
        longest=longest,
        ranks=tuple(failing),
        where=tuple(o.phase for o in failing.values()),
        attempt=attempt,
    )


def raise_on_every_rank(outcomes: Sequence[Outcome], error: Exception | None, where: str) -> None:
    """Raise on every rank: the original error where it happened, :class:`RankFailedError` elsewhere.

    Every rank has seen an error status in the shared outcomes, so every
    rank comes here and the gather of error messages cannot be missed.
    """
    summary = None if error is None else f"{type(error).__name__}: {error}"
    summaries = distributed.all_gather_objects(summary)
    if error is not None:
        raise error
    rank = next(r for r, o in enumerate(outcomes) if o.status == "error")
    raise RankFailedError(
        f"rank {rank} raised {summaries[rank]} during {outcomes[rank].phase or 'its step'} "
        f"at {where}; this rank stops too rather than wait for it (see rank {rank}'s traceback)",
        rank=rank,
        error=str(summaries[rank]),
    )


# -- one attempt of the step on this rank, with no collective ---------------------------


class StepWork:
    """One step's batch and what has been made of it so far."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.shape: BatchShape | None = None
        self.pieces: list[Piece] | None = None
        self.loss: torch.Tensor | None = None
        self.average: GradientAverage | Round | None = None
        self.reduction: Round | None = None
        """The overlapped all-reduces of the attempt under way (overlap on), failed or not."""


class ForwardBackward:
    """Forward and backward of a batch or its micro-batches for one model, on this rank only.

    ``weight`` and ``pad_token_id`` say how a batch is read and cut into
    micro-batches (see :class:`~tokenbatch.OOMFallback`).
    """

    def __init__(
        self,
        model: nn.Module,
        accelerator: Any = None,
        *,
        cost: CostModel,
        weight: Weight = None,
        pad_token_id: int | None = None,
        overlap: bool = True,
    ) -> None:
        self.model = model
        self.overlap = overlap
        self._reducer: OverlapReducer | None = None
        self._unsupported: str | None = None  # why the overlapped path cannot run this model
        self.ddp = DDPSync(model)
        self.accelerator = accelerator
        self.cost = cost
        self.weight = weight
        self.pad_token_id = pad_token_id
        self.phase: Phase = ""
        """``"forward"`` or ``"backward"``: where the last attempt was."""
        self.rows: np.ndarray | None = None
        """Rows of the micro-batch last run (None: the whole batch)."""

    def read(self, batch: Any) -> BatchShape:
        """The batch's rows and their real lengths (what ran out of memory, and what to split)."""
        return inspect_batch(batch, self.pad_token_id)

    def params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def attempt(
        self,
        work: StepWork,
        loss_fn: Callable[[Any], Any],
        params: list[nn.Parameter],
        *,
        micro_tokens: float | None,
        sync: bool,
        kept: KeptGradients | None = None,
        fill: bool = False,
    ) -> tuple[Outcome, Exception | None]:
        """Run the batch, split to ``micro_tokens`` if it costs more; never raises.

        ``kept``: the gradients accumulated before the step, added in once it has run.
        ``fill``: cut the first micro-batch as large as the budget allows (growth's try).
        Returns this rank's outcome, and the error if it was not out of memory.
        """
        self.phase, self.rows = "forward", None  # splitting counts as forward
        work.reduction = self.begin_round(params, kept) if sync else None
        try:
            work.pieces = None
            if micro_tokens is not None:
                work.shape = work.shape or self.read(work.batch)
                if work.shape.cost(self.cost) > micro_tokens:
                    work.pieces = split_batch(
                        work.batch, work.shape, self.cost, micro_tokens, weight=self.weight, fill=fill
                    )
            work.loss = self.run(work.batch, work.pieces, loss_fn, work.reduction)
            if work.reduction is not None:  # the group's earlier gradients went into the all-reduces
                work.average = work.reduction.finish()
                return Outcome(), None
            if kept is not None:  # before the buckets, which average the group's gradients
                kept.add_into_grads()
            if sync:  # buckets allocated here, where running out of memory is caught
                work.average = self.ddp.gradient_average(params)
            return Outcome(), None
        except Exception as exc:
            work.loss = work.average = None
            if not is_oom(exc):
                if work.reduction is not None:
                    work.reduction.abandon()
                return Outcome("error", self.phase), exc
            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
        # Out of the except block the traceback, and the activations its frames hold, are gone.
        if work.reduction is not None:  # the other ranks' collectives, before the outcome's
            work.reduction.abandon()
        try:
            work.shape = work.shape or self.read(work.batch)
            return self.out_of_memory(work.shape), None
        except Exception as unreadable:  # a batch we cannot read: report it rather than guess
            return Outcome("error", self.phase), unreadable

    def prepare(self, work: StepWork, *, micro_tokens: float) -> tuple[Outcome, Exception | None]:
        """Cut the batch into micro-batches that fit ``micro_tokens``, on this rank alone; never raises.

        Under FSDP this runs before the step's agreement (:func:`share_count`), where an
        out-of-memory error is recovered from in place: no collective of the step has begun.
        """
        self.phase, self.rows = "forward", None
        try:
            work.shape = work.shape or self.read(work.batch)
            work.pieces = None
            if work.shape.cost(self.cost) > micro_tokens:
                work.pieces = split_batch(work.batch, work.shape, self.cost, micro_tokens, weight=self.weight)
            return Outcome(), None
        except Exception as exc:
            work.pieces = None
            if not is_oom(exc):
                return Outcome("error", self.phase), exc
        try:
            work.shape = work.shape or self.read(work.batch)
            return self.out_of_memory(work.shape), None
        except Exception as unreadable:
            return Outcome("error", self.phase), unreadable

    def attempt_in_lockstep(
        self, work: StepWork, loss_fn: Callable[[Any], Any], *, passes: int, micro_tokens: float | None
    ) -> tuple[Outcome, Exception | None]:
        """The batch in ``passes`` forward and backward passes, as many as on every other rank; never raises.

        Under FSDP the passes hold the model's collectives, so every rank runs the same number:
        its micro-batches (:meth:`prepare`), cut further where it has fewer, and where it has
        fewer rows than ``passes``, passes of its last micro-batch whose loss counts for nothing.
        """
        self.phase, self.rows = "forward", None
        try:
            pieces: list[Piece] | None = work.pieces
            if passes > (1 if pieces is None else len(pieces)):
                work.shape = work.shape or self.read(work.batch)
                budget = math.inf if micro_tokens is None else micro_tokens
                pieces = split_batch(
                    work.batch, work.shape, self.cost, budget, weight=self.weight, at_least=passes
                )
                pieces += [(pieces[-1][0], 0.0, pieces[-1][2])] * (passes - len(pieces))
            work.loss = self.run(work.batch, pieces, loss_fn)
            return Outcome(), None
        except Exception as exc:
            work.loss = None
            if not is_oom(exc):
                return Outcome("error", self.phase), exc
            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
        try:
            work.shape = work.shape or self.read(work.batch)
            return self.out_of_memory(work.shape), None
        except Exception as unreadable:
            return Outcome("error", self.phase), unreadable

    def begin_round(self, params: list[nn.Parameter], kept: KeptGradients | None) -> Round | None:
        """The overlapped all-reduces of one attempt, or None where today's path (average after) runs."""
        if not self.overlap or self.ddp.ddp is None:
            return None
        if self._reducer is None or not self._reducer.matches(params):
            self._unsupported = unsupported(self.model)
            if self._unsupported is not None:
                logger.info("gradients averaged after the backward pass: %s", self._unsupported)
            bucket_bytes = int(getattr(self.ddp.ddp, "bucket_bytes_cap", 25 * 2**20))
            # A gradient the size of a bucket (or 1 MiB) is all-reduced in place, as its own unit.
            inplace = min(bucket_bytes, 2**20)
            self._reducer = OverlapReducer(params, bucket_bytes=bucket_bytes, inplace_bytes=inplace)
        if self._unsupported is not None:
            return None
        return self._reducer.begin(None if kept is None else kept.earlier)

    def skip(self, work: StepWork, params: list[nn.Parameter], *, sync: bool, kept: KeptGradients) -> None:
        """This rank refuses the step without running it: it still issues the step's collectives."""
        work.reduction = self.begin_round(params, kept) if sync else None
        if work.reduction is not None:
            work.reduction.abandon()

    def rewind(self, work: StepWork, kept: KeptGradients) -> None:
        """Some rank failed: an overlapped attempt's gradients are sums of partial ones; drop them.

        Every rank then runs the step again (the ranks that succeeded too: their
        gradients were averaged in place), so that every rank issues the next
        attempt's collectives. Today's path keeps a successful rank's gradients.
        """
        if work.reduction is None:
            return
        work.reduction.wait()
        work.reduction = work.average = work.loss = None
        kept.drop_step()

    def run(
        self,
        batch: Any,
        pieces: Sequence[Piece] | None,
        loss_fn: Callable[[Any], Any],
        reduction: Round | None = None,
    ) -> torch.Tensor:
        """The detached loss of ``batch`` (or the weighted sum over ``pieces``), gradients accumulated.

        With ``reduction``, the last backward pass (the only one, or the last
        micro-batch's) issues the gradient all-reduces as it goes.
        """
        parts: Sequence[tuple[Any, float, np.ndarray | None]] = (
            [(batch, 1.0, None)] if pieces is None else pieces
        )
        total: torch.Tensor | None = None
        with self.ddp.no_sync():
            for number, (part, share, rows) in enumerate(parts):
                self.rows, self.phase = rows, "forward"
                self.ddp.before_forward()
                loss = _check_loss(loss_fn(part))
                self.phase = "backward"
                # Not split: the loss as returned, so a step without OOM is exactly the plain one.
                scaled = loss if pieces is None else loss * share
                last = reduction is not None and number == len(parts) - 1
                with reduction.armed() if last and reduction is not None else contextlib.nullcontext():
                    if self.accelerator is not None:
                        self.accelerator.backward(scaled)
                    else:
                        torch.autograd.backward(scaled)
                value = scaled.detach()
                total = value if total is None else total + value
        assert total is not None
        return total

    def out_of_memory(self, shape: BatchShape) -> Outcome:
        """The outcome of running out of memory in what was last tried."""
        failed = shape.lengths if self.rows is None else shape.lengths[self.rows]
        cost = shape.cost(self.cost, self.rows)  # a pack costs as a pack
        return Outcome("oom", self.phase, cost=cost, longest=int(failed.max()), rows=len(failed))


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn should return the batch's loss as a scalar tensor (e.g. lambda batch: "
            f"model(**batch).loss), but it returned {type(loss).__name__}{shape}"
        )
    return loss
