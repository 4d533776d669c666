"""Surviving out-of-memory errors in training: shrink the budget and carry on, on every rank.

:class:`OOMFallback` guards the forward and backward pass of each training
step. Ranks never synchronise inside a pass that can fail: forward and
backward run under DDP's ``no_sync()``, then one small all-reduce tells every
rank how every other rank's step went (ok, out of memory, or another error),
and only when all succeeded does one bucketed all-reduce average the
gradients. A rank that fails therefore never leaves another waiting in a
collective it will not reach.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tokenbatch import _checks, distributed
from tokenbatch._oom_types import OOMEvent, RankFailedError, SampleTooLargeError, free_memory, is_oom
from tokenbatch._split import BatchShape, inspect_batch, split_batch
from tokenbatch.budget_cache import BudgetCache, BudgetKey
from tokenbatch.plan import OversizeSampleError
from tokenbatch.sampler import TokenBudgetBatchSampler

__all__ = ["OOMEvent", "OOMFallback", "RankFailedError", "SampleTooLargeError", "is_oom"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
MODES = ("split", "halve")
_OK, _OOM, _ERROR = 0.0, 1.0, 2.0
_PHASES = ("", "forward", "backward")
_DEFAULT_BUCKET_BYTES = 25 * 2**20


class OOMFallback:
    """The guard around a training step: on out-of-memory, shrink the budget on every rank and carry on.

    Args:
        sampler: the :class:`~tokenbatch.TokenBudgetBatchSampler` feeding the training DataLoader.
        model: the model as returned by ``accelerator.prepare`` (DDP-wrapped on
            several processes), or a plain ``nn.Module``.
        accelerator: optional; its ``backward`` is used (loss scaling, gradient
            accumulation) and gradients are averaged only when it says ``sync_gradients``.
        mode: ``"split"`` keeps each planned batch and optimizer step and runs an
            over-budget batch as micro-batches that fit a smaller budget, with
            gradients accumulated; ``"halve"`` shrinks the sampler's budget,
            re-plans the rest of the epoch and skips the failed step.
        factor: the budget multiplier per out-of-memory event, in (0, 1). The
            new budget is ``factor * min(budget, cost of the largest batch that failed)``.
        min_tokens: the floor; an out-of-memory error at the floor raises
            :class:`SampleTooLargeError` instead of trying again.
        weight: the micro-batch loss weights in split mode: ``"samples"`` (for a
            loss averaged over samples), ``"tokens"`` (averaged over real
            tokens), or a function of a micro-batch returning its count.
        pad_token_id: read row lengths from ``input_ids`` when batches have no ``attention_mask``.
        trim_padding: cut each micro-batch to its longest row (right-padded batches).
        remember: a :class:`~tokenbatch.budget_cache.BudgetKey`: start from the
            budget cached for it if smaller, and cache the budget after each change.
        cache: the cache file for ``remember`` (default ``BudgetCache()``).

    Example:
        >>> import torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> sampler = TokenBudgetBatchSampler([3, 5, 2, 4], max_tokens=8, seed=0)
        >>> model = torch.nn.Linear(1, 1)
        >>> fallback = OOMFallback(sampler, model, mode="halve")
        >>> batches = [torch.ones(len(b), 1) for b in sampler]
        >>> losses = [fallback.backward(x, lambda x: model(x).mean()) for x in fallback.iterate(batches)]
        >>> fallback.steps_done, fallback.events
        (3, [])
    """

    def __init__(
        self,
        sampler: TokenBudgetBatchSampler,
        model: nn.Module,
        *,
        accelerator: Any = None,
        mode: str = "split",
        factor: float = 0.5,
        min_tokens: float | None = None,
        weight: str | Callable[[Any], float] = "samples",
        pad_token_id: int | None = None,
        trim_padding: bool = True,
        remember: BudgetKey | None = None,
        cache: BudgetCache | None = None,
    ) -> None:
        if not isinstance(sampler, TokenBudgetBatchSampler):
            raise TypeError(
                f"sampler should be the tokenbatch.TokenBudgetBatchSampler feeding the DataLoader, "
                f"but got sampler of type {type(sampler).__name__}"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model should be a torch.nn.Module, but got model of type {type(model).__name__}"
            )
        self.sampler = sampler
        self.model = model
        self.accelerator = accelerator
        self.mode = _checks.one_of("mode", mode, MODES)
        self.factor = _checks.positive_number("factor", factor)
        if self.factor >= 1:
            raise ValueError(f"factor should be below 1 (the budget must shrink), but got factor={factor!r}")
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
        if not (weight in ("samples", "tokens") or callable(weight)):
            raise ValueError(f"weight should be 'samples', 'tokens' or a function, but got weight={weight!r}")
        self.weight = weight
        self.pad_token_id = pad_token_id
        self.trim_padding = bool(trim_padding)
        self.events: list[OOMEvent] = []
        self._ddp = model if isinstance(model, DistributedDataParallel) else None
        self._micro_tokens = sampler.max_tokens  # split mode: the budget one forward/backward must fit
        self._epoch = sampler.epoch
        self._steps_done = self._first_step()
        self._step = self._steps_done
        self._iterating = False
        self.restart_pending = False
        """After a halve-mode re-plan: the DataLoader must be iterated afresh (``iterate`` does it)."""
        self._phase = ""
        self._tried_rows: Any = None  # rows of the micro-batch being run (None: the whole batch)
        self._warned_accumulation = False
        self.remember = remember
        self.cache = cache if cache is not None or remember is None else BudgetCache()
        self._cache_pending = False
        if remember is not None:
            self._start_from_cache(remember)

    # -- what it exposes -----------------------------------------------------------

    @property
    def max_tokens(self) -> float:
        """The budget in force: the sampler's in halve mode, the micro-batch budget in split mode."""
        return self.sampler.max_tokens if self.mode == "halve" else self._micro_tokens

    @property
    def steps_done(self) -> int:
        """Steps trained in this epoch: what to pass to ``sampler.state_dict(steps_done=...)``."""
        return self._steps_done

    def state_dict(self) -> dict[str, Any]:
        """The budget and events, to save beside the sampler's ``state_dict``."""
        return {
            "version": 1,
            "mode": self.mode,
            "max_tokens": self.max_tokens,
            "events": [event.as_dict() for event in self.events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the micro-batch budget (split mode) and the event history from :meth:`state_dict`."""
        expected = {"version", "mode", "max_tokens", "events"}
        if not isinstance(state, dict) or set(state) != expected or state["version"] != 1:
            raise ValueError(
                f"state should be an OOMFallback.state_dict() (version 1, keys {sorted(expected)}), "
                f"but got {state!r:.200}"
            )
        if self.mode == "split":
            self._micro_tokens = min(
                self.sampler.max_tokens, _checks.positive_number("max_tokens", state["max_tokens"])
            )
        self.events = [OOMEvent.from_dict(e) for e in state["events"]]

    # -- the loop ------------------------------------------------------------------

    def _first_step(self) -> int:
        """The step the sampler's next iteration starts at (after a resume or re-plan)."""
        plan = self.sampler.plan
        per_step = 1 if self.sampler.rank is not None else plan.num_replicas
        return plan.num_steps - len(self.sampler) // per_step

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch, across any re-plans.

        After a halve-mode re-plan the abandoned DataLoader iterator (and the
        batches it read ahead from the old plan) is closed, and a fresh one
        resumes at the first step not yet trained.
        """
        self._epoch = self.sampler.epoch
        self._steps_done = self._first_step()
        step = self._steps_done
        self._iterating = True
        try:
            while True:
                self.restart_pending = False
                iterator = iter(dataloader)
                try:
                    for batch in iterator:
                        self._step = step
                        yield batch
                        if self.restart_pending:
                            break
                        step += 1
                        self._steps_done = max(self._steps_done, step)
                finally:
                    close = getattr(iterator, "close", None)
                    if callable(close):
                        close()
                    del iterator
                if not self.restart_pending:
                    return
                step = self._steps_done
        finally:
            self._iterating = False

    def backward(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor | None:
        """Run ``loss_fn(batch)`` and its backward pass; on out-of-memory, recover on every rank.

        Args:
            batch: the collated batch (dict of tensors with an ``attention_mask``, ...).
            loss_fn: forward pass returning the batch's scalar loss, averaged over its samples.

        Returns:
            The detached loss (a weighted sum of micro-batch losses if split),
            or None when the step was dropped (halve mode): skip ``optimizer.step()``.

        Raises:
            SampleTooLargeError: even one sample does not fit, or the budget is at ``min_tokens``.
            RankFailedError: another rank raised an error that is not out-of-memory
                (that rank re-raises its own error unchanged).
        """
        step = self._step if self._iterating else self._steps_done
        if not self._iterating and self.sampler.epoch != self._epoch:
            self._epoch, step = self.sampler.epoch, 0
        ddp = self._ddp
        world = distributed.world_size() if distributed.is_initialized() else 1
        sync = ddp is not None and world > 1 and bool(getattr(self.accelerator, "sync_gradients", True))
        params = [p for p in self.model.parameters() if p.requires_grad]
        had_grads = any(p.grad is not None for p in params)
        forward_sync = ddp.require_forward_param_sync if ddp is not None else False
        if ddp is not None and world > 1:
            self._sync_buffers(ddp)
        try:
            shape: BatchShape | None = None
            pieces = None
            if self.mode == "split" and self._micro_tokens < self.sampler.max_tokens:
                shape = inspect_batch(batch, self.pad_token_id)
                if shape.cost(self.sampler.cost) > self._micro_tokens:
                    pieces = self._split(batch, shape)
            loss: torch.Tensor | None = None
            attempt = 0
            while True:
                row = [_OK, 0.0, 0.0, 0.0, 0.0]
                error: Exception | None = None
                if loss is None:
                    try:
                        loss = self._forward_backward(batch, pieces, loss_fn)
                    except Exception as exc:
                        if not is_oom(exc):
                            error = exc
                            row = [_ERROR, float(_PHASES.index(self._phase)), 0.0, 0.0, 0.0]
                        else:
                            shape = shape or inspect_batch(batch, self.pad_token_id)
                            row = self._oom_row(shape)
                            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
                    # Out of the except block, the traceback (and the activations its frames hold) is gone.
                    if row[0] == _OOM:
                        self._drop_grads(params, had_grads)
                        free_memory()
                flags = [p.grad is not None for p in params] if sync else []
                rows, any_grad = distributed.share_rows(row, flags)
                if any(r[0] == _ERROR for r in rows):
                    self._raise_error(rows, error, step)
                if not any(r[0] == _OOM for r in rows):
                    break
                event = self._record(rows, step, attempt)
                if self.mode == "halve":
                    self._drop_grads(params, had_grads)
                    self._replan(event)
                    return None
                self._micro_tokens = event.new_max_tokens
                if loss is None:
                    assert shape is not None  # set when this rank ran out of memory
                    pieces = self._split(batch, shape)
                attempt += 1
            if sync:
                self._average_gradients(params, any_grad, ddp)
        finally:
            if ddp is not None:
                ddp.require_forward_param_sync = forward_sync
        self._steps_done = step + 1
        self._save_budget()
        return loss

    # -- one attempt -------------------------------------------------------------------

    def _split(self, batch: Any, shape: BatchShape) -> list[tuple[Any, float, Any]]:
        return split_batch(
            batch,
            shape,
            self.sampler.cost,
            self._micro_tokens,
            weight=self.weight,
            trim=self.trim_padding,
        )

    def _forward_backward(
        self, batch: Any, pieces: list[tuple[Any, float, Any]] | None, loss_fn: Callable[[Any], torch.Tensor]
    ) -> torch.Tensor:
        parts = [(batch, 1.0, None)] if pieces is None else pieces
        total: torch.Tensor | None = None
        context = self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()
        with context:
            for part, share, rows in parts:
                self._tried_rows = rows
                self._phase = "forward"
                if self._ddp is not None:
                    # DDP would broadcast buffers here, where a rank that already failed never comes.
                    self._ddp.require_forward_param_sync = False
                loss = _check_loss(loss_fn(part))
                self._phase = "backward"
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

    def _oom_row(self, shape: BatchShape) -> list[float]:
        """This rank's report of an out-of-memory error: phase, failed cost, longest row, rows."""
        rows = self._tried_rows
        failed = shape.lengths if rows is None else shape.lengths[rows]
        return [
            _OOM,
            float(_PHASES.index(self._phase)),
            float(len(failed) * self.sampler.cost.sample_cost(int(failed.max()))),
            float(failed.max()),
            float(len(failed)),
        ]

    # -- after the agreement -------------------------------------------------------------

    def _record(self, rows: list[list[float]], step: int, attempt: int) -> OOMEvent:
        """The event every rank derives from the shared rows; raises when no smaller budget is left."""
        failing = [r for r, row in enumerate(rows) if row[0] == _OOM]
        old = self.max_tokens
        largest = max(rows[r][2] for r in failing)
        longest = int(max(rows[r][3] for r in failing))
        new = self.factor * min(old, largest)
        single = [r for r in failing if rows[r][4] == 1]
        event = OOMEvent(
            epoch=self.sampler.epoch,
            step=step,
            mode=self.mode,
            old_max_tokens=old,
            new_max_tokens=new,
            longest=longest,
            ranks=tuple(failing),
            where=tuple(_PHASES[int(rows[r][1])] for r in failing),
            attempt=attempt,
        )
        if single:
            rank = single[0]
            raise SampleTooLargeError(
                f"a single sample of {int(rows[rank][3])} tokens ran out of memory on its own "
                f"(rank {rank}, epoch {event.epoch}, step {step}, max_tokens={old:g}); nothing smaller is "
                f"left to try: truncate sequences below {int(rows[rank][3])} tokens (the tokenizer's "
                f"max_length), or free memory (a smaller model or dtype, gradient checkpointing)",
                length=int(rows[rank][3]),
                max_tokens=old,
                step=step,
                rank=rank,
            )
        if self.min_tokens is not None:
            if old <= self.min_tokens:
                raise SampleTooLargeError(
                    f"out of memory at epoch {event.epoch}, step {step} on rank(s) {list(failing)} "
                    f"(longest sequence {longest} tokens) with max_tokens={old:g} already at "
                    f"min_tokens={self.min_tokens:g}; lower min_tokens, truncate sequences, or free memory",
                    length=longest,
                    max_tokens=old,
                    step=step,
                    rank=failing[0],
                )
            event = event.replace(new_max_tokens=max(new, self.min_tokens))
        self.events.append(event)
        self._cache_pending = True
        if distributed.rank() == 0:
            logger.warning("%s", event)
        return event

    def _replan(self, event: OOMEvent) -> None:
        try:
            self.sampler.replan(event.new_max_tokens, steps_done=event.step)
        except OversizeSampleError as error:
            raise SampleTooLargeError(
                f"out of memory at epoch {event.epoch}, step {event.step}; the rest of the epoch cannot "
                f"be re-planned under max_tokens={event.new_max_tokens:g}: {error}",
                length=event.longest,
                max_tokens=event.new_max_tokens,
                step=event.step,
                rank=event.ranks[0],
            ) from error
        self.restart_pending = True

    def _raise_error(self, rows: list[list[float]], error: Exception | None, step: int) -> None:
        """Raise on every rank: the original error where it happened, RankFailedError elsewhere."""
        summary = None if error is None else f"{type(error).__name__}: {error}"
        summaries = distributed.all_gather_objects(summary)  # every rank knows to come here
        if error is not None:
            raise error
        rank = next(r for r, row in enumerate(rows) if row[0] == _ERROR)
        raise RankFailedError(
            f"rank {rank} raised {summaries[rank]} during {_PHASES[int(rows[rank][1])] or 'its step'} "
            f"at epoch {self.sampler.epoch}, step {step}; this rank stops too rather than wait for it "
            f"(see rank {rank}'s traceback)",
            rank=rank,
            error=str(summaries[rank]),
        )

    def _drop_grads(self, params: list[nn.Parameter], had_grads: bool) -> None:
        if had_grads and not self._warned_accumulation:
            self._warned_accumulation = True
            logger.warning(
                "gradients accumulated before this step are dropped with the failed step's; "
                "OOMFallback expects optimizer.zero_grad() after every optimizer.step()"
            )
        for param in params:
            param.grad = None

    # -- collectives -------------------------------------------------------------------

    def _sync_buffers(self, ddp: DistributedDataParallel) -> None:
        """DDP's per-forward buffer broadcast, moved to the top of the step where every rank arrives."""
        if not getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True)):
            return
        if not ddp.require_forward_param_sync:
            return
        ignored = set(getattr(ddp, "parameters_to_ignore", ()))
        buffers = [b for name, b in ddp.module.named_buffers() if name not in ignored]
        if buffers:
            distributed.broadcast_(buffers, src=0)

    def _average_gradients(
        self, params: list[nn.Parameter], any_grad: list[bool], ddp: DistributedDataParallel | None
    ) -> None:
        grads = []
        for param, present in zip(params, any_grad, strict=True):
            if present:
                if param.grad is None:  # unused here but used on another rank, as DDP does
                    param.grad = torch.zeros_like(param)
                grads.append(param.grad)
        distributed.average_(grads, bucket_bytes=getattr(ddp, "bucket_bytes_cap", _DEFAULT_BUCKET_BYTES))

    # -- remembering the budget ----------------------------------------------------------

    def _start_from_cache(self, key: BudgetKey) -> None:
        assert self.cache is not None
        entry = self.cache.get(key)
        if entry is None or float(entry["max_tokens"]) >= self.max_tokens:
            return
        cached = float(entry["max_tokens"])
        if self.mode == "split":
            self._micro_tokens = cached
        else:
            try:
                self.sampler.replan(cached, steps_done=self._steps_done)
            except OversizeSampleError as error:
                logger.warning("not starting from the cached max_tokens=%g for %s: %s", cached, key, error)
                return
        logger.info("starting from max_tokens=%g remembered for %s", cached, key)

    def _save_budget(self) -> None:
        """Cache the budget once a step has trained under it (main process only)."""
        if not self._cache_pending:
            return
        self._cache_pending = False
        if self.remember is not None and self.cache is not None and distributed.rank() == 0:
            self.cache.put(self.remember, self.max_tokens, source="oom", mode=self.mode)


def _check_loss(loss: Any) -> torch.Tensor:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise TypeError(
            f"loss_fn should return the batch's loss as a scalar tensor (e.g. lambda batch: "
            f"model(**batch).loss), but it returned {type(loss).__name__}"
            + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else "")
        )
    return loss
