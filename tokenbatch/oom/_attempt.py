"""One attempt at a training step's forward and backward, on this rank alone, with no collective.

Everything that can fail on one rank only (splitting, reading the batch, the
forward and backward passes, the gradient buckets) happens in
:meth:`ForwardBackward.attempt`, which never raises: it reports an
:class:`~tokenbatch.oom._outcome.Outcome` for the ranks to share, so that no
rank is ever left waiting for another.
"""

from __future__ import annotations

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
        self.average: GradientAverage | None = None


class ForwardBackward:
    """Forward and backward of a batch or its micro-batches for one model, on this rank only."""

    def __init__(
        self, model: nn.Module, accelerator: Any = None, *, cost: CostModel, strategy: Strategy
    ) -> None:
        self.model = model
        self.ddp = DDPSync(model)
        self.accelerator = accelerator
        self.cost = cost
        self.strategy = strategy
        self.phase: Phase = ""
        """``"forward"`` or ``"backward"``: where the last attempt was."""
        self.rows: np.ndarray | None = None
        """Rows of the micro-batch last run (None: the whole batch)."""

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
        try:
            work.pieces = None
            if micro_tokens is not None:
                work.shape = work.shape or self.strategy.read(work.batch)
                if work.shape.cost(self.cost) > micro_tokens:
                    work.pieces = self.strategy.split(work.batch, work.shape, self.cost, micro_tokens)
            work.loss = self.run(work.batch, work.pieces, loss_fn)
            if kept is not None:  # before the buckets, which average the group's gradients
                kept.add_into_grads()
            if sync:  # buckets allocated here, where running out of memory is caught
                work.average = self.ddp.gradient_average(params)
            return Outcome(), None
        except Exception as exc:
            work.loss = work.average = None
            if not is_oom(exc):
                return Outcome("error", self.phase), exc
            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
        # Out of the except block the traceback, and the activations its frames hold, are gone.
        try:
            work.shape = work.shape or self.strategy.read(work.batch)
            return self.out_of_memory(work.shape), None
        except Exception as unreadable:  # a batch we cannot read: report it rather than guess
            return Outcome("error", self.phase), unreadable

    def run(self, batch: Any, pieces: Sequence[Piece] | None, loss_fn: Callable[[Any], Any]) -> torch.Tensor:
        """The detached loss of ``batch`` (or the weighted sum over ``pieces``), gradients accumulated."""
        parts: Sequence[tuple[Any, float, np.ndarray | None]] = (
            [(batch, 1.0, None)] if pieces is None else pieces
        )
        total: torch.Tensor | None = None
        with self.ddp.no_sync():
            for part, share, rows in parts:
                self.rows, self.phase = rows, "forward"
                self.ddp.before_forward()
                loss = _check_loss(loss_fn(part))
                self.phase = "backward"
                # Not split: the loss as returned, so a step without OOM is exactly the plain one.
                scaled = loss if pieces is None else loss * share
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
