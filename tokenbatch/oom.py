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

import logging
import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from tokenbatch import _checks, distributed
from tokenbatch._epoch import EpochCursor
from tokenbatch._oom_types import (
    ERROR,
    OK,
    OOM,
    OOMEvent,
    RankFailedError,
    SampleTooLargeError,
    free_memory,
    is_oom,
    next_event,
)
from tokenbatch._runner import StepRunner, StepWork, raise_on_every_rank
from tokenbatch.budget_cache import BudgetCache, BudgetKey
from tokenbatch.plan import OversizeSampleError
from tokenbatch.sampler import TokenBudgetBatchSampler

__all__ = ["OOMEvent", "OOMFallback", "RankFailedError", "SampleTooLargeError", "is_oom"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
MODES = ("split", "halve")


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

    Works with a plain module and with DDP (as ``accelerator.prepare`` wraps
    it); not with FSDP or DeepSpeed, which shard gradients themselves. The
    guard owns gradient synchronisation: it runs DDP under ``no_sync()`` and
    averages gradients itself once every rank has succeeded. A failed step's
    gradients are set to None, so zero them after every optimizer step (no
    accumulation across ``backward`` calls). Split mode matches an unsplit
    run up to floating point when the model is deterministic (no dropout);
    with dropout, micro-batches draw different masks.

    The training loop keeps its usual shape::

        for batch in fallback.iterate(train_dataloader):
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if loss is not None:  # None: the step was dropped (halve mode)
                optimizer.step()
                optimizer.zero_grad()

    Example:
        >>> import torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> from tokenbatch.testing import inject_oom
        >>> sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
        >>> model = torch.nn.Linear(4, 1)
        >>> fallback = OOMFallback(sampler, model, mode="split")
        >>> batches = [torch.ones(len(indices), 4) for indices in sampler]
        >>> with inject_oom(model, max_tokens=8, times=1):  # a batch of 16 tokens "runs out of memory"
        ...     losses = [fallback.backward(x, lambda x: model(x).square().mean())
        ...               for x in fallback.iterate(batches)]
        >>> event = fallback.events[0]
        >>> event.step, event.where, event.old_max_tokens, event.new_max_tokens, fallback.max_tokens
        (0, ('forward',), 16.0, 8.0, 8.0)
        >>> fallback.steps_done == sampler.plan.num_steps and None not in losses
        True
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
        self.events: list[OOMEvent] = []
        self._runner = StepRunner(
            model,
            accelerator,
            cost=sampler.cost,
            weight=weight,
            pad_token_id=pad_token_id,
            trim=_checks.boolean("trim_padding", trim_padding),
        )
        self._micro_tokens = sampler.max_tokens  # split mode: the budget one forward/backward must fit
        self._cursor = EpochCursor(sampler)
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
        return self._cursor.steps_done

    @property
    def restart_pending(self) -> bool:
        """After a halve-mode re-plan: the DataLoader must be iterated afresh (``iterate`` does it)."""
        return self._cursor.restart_pending

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

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch, across any re-plans.

        After a halve-mode re-plan the abandoned DataLoader iterator (and the
        batches it read ahead from the old plan) is closed, and a fresh one
        resumes at the first step not yet trained.

        Raises:
            ValueError: ``dataloader`` does not draw its batches from the sampler.
        """
        return self._cursor.iterate(dataloader)

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
        step = self._cursor.current_step()
        runner, ddp = self._runner, self._runner.ddp
        world = distributed.world_size() if distributed.is_initialized() else 1
        sync = ddp is not None and world > 1 and bool(getattr(self.accelerator, "sync_gradients", True))
        params = runner.params()
        had_grads = any(p.grad is not None for p in params)
        forward_sync = ddp.require_forward_param_sync if ddp is not None else False
        if ddp is not None and world > 1:
            distributed.broadcast_module_buffers(ddp)  # before anything that can fail
        try:
            work = StepWork(batch)
            attempt = 0
            while True:
                row, error = [OK, 0.0, 0.0, 0.0, 0.0], None
                if work.loss is None:
                    split = self.mode == "split" and self._micro_tokens < self.sampler.max_tokens
                    micro = self._micro_tokens if split else None
                    row, error = runner.attempt(work, loss_fn, params, micro_tokens=micro, sync=sync)
                    if row[0] == OOM:
                        runner.drop_grads(params, had_grads)
                        free_memory()
                flags = [p.grad is not None for p in params] if sync else []
                rows, any_grad = distributed.share_rows(row, flags)
                if any(r[0] == ERROR for r in rows):
                    raise_on_every_rank(rows, error, f"epoch {self.sampler.epoch}, step {step}")
                if not any(r[0] == OOM for r in rows):
                    break
                event = next_event(
                    rows,
                    epoch=self.sampler.epoch,
                    step=step,
                    mode=self.mode,
                    max_tokens=self.max_tokens,
                    factor=self.factor,
                    min_tokens=self.min_tokens,
                    attempt=attempt,
                )
                self._record(event)
                if self.mode == "halve":
                    runner.drop_grads(params, had_grads)
                    self._replan(event)
                    return None
                self._micro_tokens = event.new_max_tokens
                attempt += 1
            if work.average is not None:
                work.average.average_into_grads(any_grad)
        finally:
            if ddp is not None:
                ddp.require_forward_param_sync = forward_sync
        self._cursor.steps_done = step + 1
        self._save_budget()
        return work.loss

    def _record(self, event: OOMEvent) -> None:
        self.events.append(event)
        self._cache_pending = True
        if distributed.rank() == 0:
            logger.warning("%s", event)

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
        self._cursor.restart_pending = True

    # -- remembering the budget ----------------------------------------------------------

    def _start_from_cache(self, key: BudgetKey) -> None:
        assert self.cache is not None
        entry = self.cache.get(key)
        mine = float(entry["max_tokens"]) if entry is not None else math.inf
        # Ranks on other machines may read other files: all take the smallest, so plans agree.
        cached = -distributed.all_reduce_max([-mine], device=distributed.collective_device())[0]
        if cached >= self.max_tokens:
            return
        if self.mode == "split":
            self._micro_tokens = cached
        else:
            try:
                self.sampler.replan(cached, steps_done=self._cursor.steps_done)
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
            try:
                self.cache.put(self.remember, self.max_tokens, source="oom", mode=self.mode)
            except (OSError, ValueError) as error:  # a cache is a convenience: never stop training for it
                logger.warning(
                    "could not remember max_tokens=%g in %s: %s", self.max_tokens, self.cache.path, error
                )
