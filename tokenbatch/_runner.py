"""One attempt at a training step's forward and backward, with no collective inside it.

The OOM fallback runs each attempt through :class:`StepRunner`, which keeps
DDP from synchronising anything (gradients or buffers) during the passes, so
that a rank failing half-way leaves no other rank waiting, and which
describes what went wrong as an outcome row for the ranks to share.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tokenbatch import distributed
from tokenbatch._oom_types import ERROR, OK, OOM, PHASES, RankFailedError, is_oom
from tokenbatch._split import BatchShape, inspect_batch, split_batch
from tokenbatch.cost import CostModel

logger = logging.getLogger("tokenbatch.oom")

Piece = tuple[Any, float, np.ndarray]
"""A micro-batch, its loss weight, and its rows in the batch."""


class StepWork:
    """One step's batch and what has been made of it so far."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch
        self.shape: BatchShape | None = None
        self.pieces: list[Piece] | None = None
        self.loss: torch.Tensor | None = None
        self.average: distributed.GradientAverage | None = None


class StepRunner:
    """Forward and backward of a batch or its micro-batches for one model, on this rank only."""

    def __init__(
        self,
        model: nn.Module,
        accelerator: Any = None,
        *,
        cost: CostModel,
        weight: str | Callable[[Any], float] = "samples",
        pad_token_id: int | None = None,
        trim: bool = True,
    ) -> None:
        self.model = model
        self.ddp = model if isinstance(model, DistributedDataParallel) else None
        self.accelerator = accelerator
        self.cost = cost
        self.weight = weight
        self.pad_token_id = pad_token_id
        self.trim = trim
        self.phase = ""
        """``"forward"`` or ``"backward"``: where the last attempt was."""
        self.rows: np.ndarray | None = None
        """Rows of the micro-batch last run (None: the whole batch)."""
        self._warned_accumulation = False

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
    ) -> tuple[list[float], Exception | None]:
        """Run the batch, split to ``micro_tokens`` if it costs more; never raises.

        Returns this rank's outcome row, and the error if it was not out of
        memory. Everything that can fail on one rank only (splitting, reading
        the batch, the forward and backward passes, the gradient buckets)
        happens in here, before the ranks compare outcomes, so that no rank
        is ever left waiting for another.
        """
        self.phase, self.rows = "forward", None  # splitting counts as forward
        try:
            work.pieces = None
            if micro_tokens is not None:
                work.shape = work.shape or inspect_batch(work.batch, self.pad_token_id)
                if work.shape.cost(self.cost) > micro_tokens:
                    work.pieces = split_batch(
                        work.batch, work.shape, self.cost, micro_tokens, weight=self.weight, trim=self.trim
                    )
            work.loss = self.run(work.batch, work.pieces, loss_fn)
            if sync:  # buckets allocated here, where running out of memory is caught
                bucket_bytes = int(getattr(self.ddp, "bucket_bytes_cap", 25 * 2**20))
                work.average = distributed.GradientAverage(params, bucket_bytes=bucket_bytes)
            return [OK, 0.0, 0.0, 0.0, 0.0], None
        except Exception as exc:
            work.loss = work.average = None
            if not is_oom(exc):
                return self.error_row(), exc
            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
        # Out of the except block the traceback, and the activations its frames hold, are gone.
        try:
            work.shape = work.shape or inspect_batch(work.batch, self.pad_token_id)
            return self.oom_row(work.shape), None
        except Exception as unreadable:  # a batch we cannot read: report it rather than guess
            return self.error_row(), unreadable

    def run(self, batch: Any, pieces: Sequence[Piece] | None, loss_fn: Callable[[Any], Any]) -> torch.Tensor:
        """The detached loss of ``batch`` (or the weighted sum over ``pieces``), gradients accumulated."""
        parts: Sequence[tuple[Any, float, np.ndarray | None]] = (
            [(batch, 1.0, None)] if pieces is None else pieces
        )
        total: torch.Tensor | None = None
        context = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
        with context:
            for part, share, rows in parts:
                self.rows, self.phase = rows, "forward"
                if self.ddp is not None:
                    # DDP would broadcast buffers here, where a rank that already failed never comes;
                    # the fallback broadcasts them itself at the start of the step.
                    self.ddp.require_forward_param_sync = False
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

    def oom_row(self, shape: BatchShape) -> list[float]:
        """The outcome row for running out of memory in what was last tried."""
        failed = shape.lengths if self.rows is None else shape.lengths[self.rows]
        longest = int(failed.max())
        return [OOM, float(PHASES.index(self.phase)), float(len(failed) * self.cost.sample_cost(longest)),
                float(longest), float(len(failed))]  # fmt: skip

    def error_row(self) -> list[float]:
        return [ERROR, float(PHASES.index(self.phase)), 0.0, 0.0, 0.0]

    def drop_grads(self, params: Sequence[nn.Parameter], had_grads: bool) -> None:
        """Set gradients to None (what a failed or skipped step leaves is partial)."""
        if had_grads and not self._warned_accumulation:
            self._warned_accumulation = True
            logger.warning(
                "gradients accumulated before this step are dropped with the failed step's; "
                "OOMFallback expects optimizer.zero_grad() after every optimizer.step()"
            )
        for param in params:
            param.grad = None


def raise_on_every_rank(rows: list[list[float]], error: Exception | None, where: str) -> None:
    """Raise on every rank: the original error where it happened, :class:`RankFailedError` elsewhere.

    Every rank has seen an error status in the shared rows, so every rank
    comes here and the gather of error messages cannot be missed.
    """
    summary = None if error is None else f"{type(error).__name__}: {error}"
    summaries = distributed.all_gather_objects(summary)
    if error is not None:
        raise error
    rank = next(r for r, row in enumerate(rows) if row[0] == ERROR)
    raise RankFailedError(
        f"rank {rank} raised {summaries[rank]} during {PHASES[int(rows[rank][1])] or 'its step'} "
        f"at {where}; this rank stops too rather than wait for it (see rank {rank}'s traceback)",
        rank=rank,
        error=str(summaries[rank]),
    )


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""
        raise TypeError(
            f"loss_fn should return the batch's loss as a scalar tensor (e.g. lambda batch: "
            f"model(**batch).loss), but it returned {type(loss).__name__}{shape}"
        )
    return loss
