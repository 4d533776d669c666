"""OOMFallback: the guard around a training step's forward and backward, and its step protocol."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from tokenbatch import _checks, distributed
from tokenbatch.oom._accumulate import KeptGradients
from tokenbatch.oom._attempt import ForwardBackward, StepWork
from tokenbatch.oom._climb import Growth
from tokenbatch.oom._detect import free_memory
from tokenbatch.oom._eval import EvalGuard
from tokenbatch.oom._events import OOMEvent
from tokenbatch.oom._grow import Grow, GrowEvent, as_grow
from tokenbatch.oom._optimizer import guarded_step
from tokenbatch.oom._outcome import Outcome, next_event, raise_on_every_rank, share
from tokenbatch.oom._saved import guard_state, read_guard_state
from tokenbatch.oom._strategies import Strategy, as_strategy, moved_option
from tokenbatch.oom._stream import with_cursor
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

logger = logging.getLogger("tokenbatch.oom")

T = TypeVar("T")


class OOMFallback:
    """The guard around a training step: on out-of-memory, shrink the budget on every rank and carry on.

    Args:
        sampler: the :class:`~tokenbatch.TokenBudgetBatchSampler` feeding the training DataLoader,
            or the :class:`~tokenbatch.TokenBudgetStream` it reads (see :mod:`tokenbatch.oom._stream`).
        model: the model as returned by ``accelerator.prepare`` (DDP-wrapped on
            several processes), or a plain ``nn.Module``.
        accelerator: optional; its ``backward`` is used (loss scaling, gradient
            accumulation) and gradients are averaged only when it says ``sync_gradients``.
        mode: ``"split"`` keeps each planned batch and optimizer step and runs an
            over-budget batch as micro-batches that fit a smaller budget, with
            gradients accumulated; ``"halve"`` shrinks the sampler's budget,
            re-plans the rest of the epoch and skips the failed step. A
            :class:`~tokenbatch.oom.Split` (to set its options) or
            :class:`~tokenbatch.oom.Halve` may be passed instead of the name.
        factor: the budget multiplier per out-of-memory event, in (0, 1). The
            new budget is ``factor * min(budget, cost of the largest batch that failed)``.
        min_tokens: the floor; an out-of-memory error at the floor raises
            :class:`SampleTooLargeError` instead of trying again.
        overlap: with DDP, all-reduce gradients during backward in an order that a failed rank
            still completes (:mod:`tokenbatch.oom._overlap`); False: average them after backward.
        grow: after an OOM, try budgets between the largest that trained and the smallest that failed,
            each guarded like any step (:class:`~tokenbatch.oom.Grow` sets how; False: shrink only).
            A failed try is in ``events`` (``growth=True``), each one that trained in ``growth_events``.
            Default: on with a sampler, off with a stream (which has no plan to prove a budget on).

    Works with a plain module and with DDP (as ``accelerator.prepare`` wraps
    it); not with FSDP or DeepSpeed, which shard gradients themselves. The
    guard owns gradient synchronisation (see :mod:`tokenbatch.oom`): it runs
    DDP under ``no_sync()``, all-reduces gradients itself (``overlap``) and keeps
    them once every rank has said its step succeeded. Gradient accumulation (``accelerator.accumulate``,
    or several ``backward`` calls per optimizer step) works in both modes: a
    step runs into fresh gradients and adds the group's earlier ones on
    success, so a failed or dropped step loses only its own (this costs one
    gradient-sized buffer while earlier gradients exist). Split mode matches
    an unsplit run up to floating point when each sample's loss does not
    depend on how the batch is cut (see :class:`~tokenbatch.oom.Split`); with
    dropout it does not, as micro-batches draw other masks.

    To start from the budget an earlier run ended with, and remember each
    new one, see :func:`tokenbatch.remember_budget`.

    The training loop keeps its usual shape::

        for batch in fallback.iterate(train_dataloader):
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if loss is not None:  # None: the step was dropped (halve mode)
                fallback.step(optimizer)  # optimizer.step(), guarded too
                optimizer.zero_grad()

    ``fallback.step(optimizer)``: on out-of-memory in ``optimizer.step()`` (Adam's first step allocates
    its states), free memory and try once more if the failed step changed nothing, else raise
    :class:`~tokenbatch.oom.OptimizerOOMError` on every rank.

    Example:
        >>> import torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> from tokenbatch.testing import inject_oom
        >>> sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
        >>> model = torch.nn.Linear(4, 1)
        >>> fallback = OOMFallback(sampler, model, mode="split")
        >>> batches = [torch.ones(len(indices), 4) for indices in sampler]
        >>> with inject_oom(model, max_tokens=8, times=1):  # a batch of 16 tokens "runs out of memory" once
        ...     losses = [fallback.backward(x, lambda x: model(x).square().mean())
        ...               for x in fallback.iterate(batches)]
        >>> event = fallback.events[0]
        >>> event.step, event.where, event.old_max_tokens, event.new_max_tokens
        (0, ('forward',), 16.0, 8.0)
        >>> fallback.steps_done, None in losses, [g.new_max_tokens for g in fallback.growth_events]
        (3, False, [12.0])
    """

    def __init__(
        self,
        sampler: TokenBudgetBatchSampler | TokenBudgetStream,
        model: nn.Module,
        *,
        accelerator: Any = None,
        mode: str | Strategy = "split",
        factor: float = 0.5,
        min_tokens: float | None = None,
        overlap: bool = True,
        grow: bool | Grow | None = None,
        **moved: Any,
    ) -> None:
        if moved:
            raise moved_option(moved)
        # A stream's cursor, and in halve mode its own strategy: see oom/_stream.py (it checks the type).
        self._strategy, self._cursor = with_cursor(sampler, as_strategy(mode))
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model should be a torch.nn.Module, but got model of type {type(model).__name__}"
            )
        self.sampler, self.model, self.accelerator = sampler, model, accelerator
        self.factor = _checks.shrink_factor("factor", factor)
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
        self.events: list[OOMEvent] = []
        self.grow = as_grow(grow, stream=isinstance(sampler, TokenBudgetStream))
        self._growth = Growth(self.grow, sampler=sampler, model=model, strategy=self._strategy)
        self._passes = ForwardBackward(model, accelerator, cost=sampler.cost, strategy=self._strategy)
        self._passes.overlap, self._passes.fill = bool(overlap), self._growth.filling  # see _attempt.py
        self._micro_tokens = sampler.max_tokens  # split mode: the budget one forward/backward must fit
        self._listeners: list[Callable[[OOMFallback], None]] = []
        self._unreported = False  # events recorded since the listeners last ran
        weight = getattr(self._strategy, "weight", "samples")
        self.eval_guard = EvalGuard(model, cost=sampler.cost, factor=self.factor, min_tokens=self.min_tokens,
                                    weight=weight, pad_token_id=self._strategy.pad_token_id)  # fmt: skip

    # -- what it exposes -----------------------------------------------------------

    @property
    def mode(self) -> str:
        """``"split"`` or ``"halve"``."""
        return self._strategy.name

    @property
    def max_tokens(self) -> float:
        """The budget in force: the sampler's in halve mode, the micro-batch budget in split mode."""
        return self._micro_tokens if self._strategy.keeps_step else self.sampler.max_tokens

    @property
    def steps_done(self) -> int:
        """Steps trained in this epoch: what to pass to ``sampler.state_dict(steps_done=...)``."""
        return self._cursor.steps_done

    @property
    def restart_pending(self) -> bool:
        """After a halve-mode re-plan: the DataLoader must be iterated afresh (``iterate`` does it)."""
        return self._cursor.restart_pending

    @property
    def growth_events(self) -> list[GrowEvent]:
        """Each larger budget that trained a step (``events`` holds the out-of-memory ones)."""
        return self._growth.events

    def memory_changed(self) -> None:
        """Memory was freed (or the model changed): growth may try failed budgets again. On every rank."""
        self._growth.memory_changed()

    def state_dict(self) -> dict[str, Any]:
        """The budget, events and growth bracket, to save beside the sampler's ``state_dict``."""
        return guard_state(self.mode, self.max_tokens, self.events, self._growth.state())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume the micro-batch budget (split mode) and the event history from :meth:`state_dict`.

        Every field is checked before anything changes: on an error the fallback is as it was.

        Raises:
            TypeError, ValueError: the state is not this mode's ``state_dict()`` (version 2 or 1),
                or a field is wrong; the message names it.
        """
        max_tokens, events, growth = read_guard_state(state, self.mode)
        self._growth.load(growth)  # raises before anything changes
        if self._strategy.keeps_step:
            self._micro_tokens = min(self.sampler.max_tokens, max_tokens)
        self.events = events

    def start_from(self, max_tokens: float) -> bool:
        """Lower the budget in force to ``max_tokens`` before training (a budget known to fit).

        Split mode starts its micro-batches there; halve mode re-plans the
        rest of the epoch under it. Call it on every rank with the same value.

        Returns:
            False, changing nothing, when the budget in force is already at most ``max_tokens``.
        """
        max_tokens = _checks.positive_number("max_tokens", max_tokens)
        if max_tokens >= self.max_tokens:
            return False
        self._lower(max_tokens, steps_done=self._cursor.steps_done)
        return True

    def add_listener(self, callback: Callable[[OOMFallback], None]) -> None:
        """Call ``callback(fallback)``, on every rank, after each step that trained following new events.

        That is once the new budget has been shown to fit: the place to
        record it (what :func:`tokenbatch.remember_budget` does).
        """
        self._listeners.append(callback)

    def evaluate(self, batch: Any, fn: Callable[[Any], T], *, lower_training: bool = False) -> T:
        """``fn(batch)`` without gradients, in micro-batches on every rank after out-of-memory on any.

        See :class:`~tokenbatch.oom.EvalGuard` (``fallback.eval_guard``, which
        keeps the evaluation budget and events). The training budget stays as
        it is unless ``lower_training``: then, between steps, it drops to the
        evaluation budget after an out-of-memory error.
        """
        result = self.eval_guard.evaluate(batch, fn)
        budget = self.eval_guard.max_tokens
        lowered = lower_training and budget is not None and self.start_from(budget)
        if lowered and not self._strategy.keeps_step:
            self._cursor.replanned()  # halve: iterate() resumes afresh
        return result

    # -- the loop ------------------------------------------------------------------

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` on every rank together; out of memory: free memory and retry once, or raise.

        Raises:
            ~tokenbatch.oom.OptimizerOOMError: on every rank, naming the optimizer and the failed allocation.
            RankFailedError: another rank's step raised an error that is not out-of-memory.
        """
        guarded_step(optimizer, where=f"epoch {self.sampler.epoch}, step {max(self.steps_done - 1, 0)}")

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch, across any re-plans.

        After a halve-mode re-plan the abandoned DataLoader iterator (and the
        batches it read ahead from the old plan) is closed, and a fresh one
        resumes at the first step not yet trained.

        Raises:
            ValueError: ``dataloader`` does not draw its batches from the sampler,
                or reads its global plan (``rank=None``) itself on several processes.
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
            RuntimeError: halve mode, in a loop over the DataLoader itself: the
                batch is from a plan a re-plan replaced (the DataLoader read it
                ahead); :meth:`iterate` starts the DataLoader afresh instead.
        """
        step = self._cursor.current_step()
        passes = self._passes
        params = passes.params()
        unfed = self._cursor.unfed()  # a batch of the plan a re-plan replaced: refused on every rank
        # Accumulation: the step runs into fresh gradients; the group's earlier ones survive a failure.
        with passes.ddp.step(self.accelerator) as sync, KeptGradients(params) as kept:
            work = StepWork(batch)
            attempt = 0
            while True:
                outcome, error = Outcome(), None
                if unfed is not None:
                    outcome, error = Outcome("error"), unfed
                    passes.skip(work, params, sync=sync, kept=kept)  # the collectives the others issue
                elif work.loss is None:
                    micro = self._strategy.split_budget(self._micro_tokens, self.sampler.max_tokens)
                    outcome, error = passes.attempt(
                        work, loss_fn, params, micro_tokens=micro, sync=sync, kept=kept
                    )
                    if outcome.status == "oom":
                        kept.drop_step()
                        free_memory()
                flags = [p.grad is not None for p in params] if sync else []
                outcomes, any_grad = share(outcome, flags)
                if any(o.status == "error" for o in outcomes):
                    raise_on_every_rank(outcomes, error, f"epoch {self.sampler.epoch}, step {step}")
                if not any(o.status == "oom" for o in outcomes):
                    break
                passes.rewind(work, kept)  # overlapped: every rank drops the attempt's gradients
                event = next_event(
                    outcomes,
                    epoch=self.sampler.epoch,
                    step=step,
                    mode=self.mode,
                    max_tokens=self.max_tokens,
                    factor=self.factor,
                    min_tokens=self.min_tokens,
                    attempt=attempt,
                )
                event = self._growth.failed(event, outcomes)  # a failed try: back to the budget that trained
                self._record(event)
                if not self._strategy.keeps_step:
                    kept.restore()  # the step is dropped on every rank; the group's earlier gradients stay
                    self._replan(event)
                    return None
                self._lower(event.new_max_tokens, steps_done=step)  # and try again, in smaller micro-batches
                attempt += 1
            if work.average is not None:
                work.average.average_into_grads(any_grad)
            kept.release()
        self._cursor.steps_done = step + 1
        if self._growth.trained(step=step, budget=self.max_tokens, batch=batch):
            self._unreported = True  # a larger budget trained: the listeners remember it
        if self._unreported:
            self._unreported = False
            for listener in self._listeners:
                listener(self)
        if self._growth.try_larger(self.max_tokens, step + 1, self._lower):
            self._cursor.replanned()  # halve mode: iterate() resumes afresh under the larger budget
        return work.loss

    def _record(self, event: OOMEvent) -> None:
        self.events.append(event)
        self._unreported = True
        if distributed.rank() == 0:
            logger.warning("%s", event)

    def _lower(self, max_tokens: float, *, steps_done: int) -> None:
        """Put ``max_tokens`` in force (lower, or higher to grow): the micro-batch budget, or re-plan."""
        if self._strategy.keeps_step:
            self._micro_tokens = max_tokens
        if self._strategy.rebudgets:
            self.sampler.replan(max_tokens, steps_done=steps_done)

    def _replan(self, event: OOMEvent) -> None:
        # A sample over the new budget gets a batch of its own (the sampler admitted it): only when
        # it runs out of memory alone does next_event raise SampleTooLargeError, with its length.
        self._lower(event.new_max_tokens, steps_done=event.step)
        self._cursor.replanned()
