"""One attempt at a training step's forward and backward, on this rank alone, with no collective.

Everything that can fail on one rank only (splitting, reading the batch, the
forward and backward passes, the gradient buckets) happens in
:meth:`ForwardBackward.attempt`, which never raises: it reports an
:class:`~tokenbatch.oom._outcome.Outcome` for the ranks to share, so that no
rank is ever left waiting for another. The only collectives it may issue are
the overlapped gradient all-reduces of :mod:`tokenbatch.oom._overlap`, and it
issues all of them on every attempt, failed or not, in the same order.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenbatch import distributed
from tokenbatch.cost import CostModel
from tokenbatch.oom._accumulate import KeptGradients
from tokenbatch.oom._ddp import DDPSync, GradientAverage
from tokenbatch.oom._detect import is_oom
from tokenbatch.oom._outcome import Outcome, Phase
from tokenbatch.oom._overlap import OverlapReducer, Round, unsupported
from tokenbatch.oom._split import BatchShape, Piece
from tokenbatch.oom._strategies import Strategy

logger = logging.getLogger("tokenbatch.oom")


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
    """Forward and backward of a batch or its micro-batches for one model, on this rank only."""

    def __init__(
        self,
        model: nn.Module,
        accelerator: Any = None,
        *,
        cost: CostModel,
        strategy: Strategy,
        overlap: bool = True,
    ) -> None:
        self.model = model
        self.overlap = overlap
        self._reducer: OverlapReducer | None = None
        self._unsupported: str | None = None  # why the overlapped path cannot run this model
        self.ddp = DDPSync(model)
        self.accelerator = accelerator
        self.cost = cost
        self.strategy = strategy
        self.phase: Phase = ""
        """``"forward"`` or ``"backward"``: where the last attempt was."""
        self.rows: np.ndarray | None = None
        """Rows of the micro-batch last run (None: the whole batch)."""
        self.fill: Callable[[], bool] = lambda: False
        """True while growth tries a larger budget: the first micro-batch fills it (the guard sets it)."""

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
    ) -> tuple[Outcome, Exception | None]:
        """Run the batch, split to ``micro_tokens`` if it costs more; never raises.

        ``kept``: the gradients accumulated before the step, added in once it has run.
        Returns this rank's outcome, and the error if it was not out of memory.
        """
        self.phase, self.rows = "forward", None  # splitting counts as forward
        work.reduction = self.begin_round(params, kept) if sync else None
        try:
            work.pieces = None
            if micro_tokens is not None:
                work.shape = work.shape or self.strategy.read(work.batch)
                if work.shape.cost(self.cost) > micro_tokens:
                    work.pieces = self.strategy.split(
                        work.batch, work.shape, self.cost, micro_tokens, fill=self.fill()
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
            work.shape = work.shape or self.strategy.read(work.batch)
            return self.out_of_memory(work.shape), None
        except Exception as unreadable:  # a batch we cannot read: report it rather than guess
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
        longest = int(failed.max())
        cost = float(len(failed) * self.cost.sample_cost(longest))
        return Outcome("oom", self.phase, cost=cost, longest=longest, rows=len(failed))


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn should return the batch's loss as a scalar tensor (e.g. lambda batch: "
            f"model(**batch).loss), but it returned {type(loss).__name__}{shape}"
        )
    return loss
