"""OOMFallback: the guard around a training step, and the training loop's place in the epoch.

The guard is the loop's side of tokenbatch: it counts the steps trained in
the sampler's epoch (``steps_done``), iterates the DataLoader
(:meth:`OOMFallback.iterate`) and starts it afresh after a re-plan, and its
``state_dict()`` is the one checkpoint of a guarded run: the sampler's state
at the steps trained, the budget in force, the events and the growth
bracket. The sampler stays a plan that the guard moves through its public
methods only (``replan``, ``state_dict(steps_done=)``, ``load_state_dict``).

What happens to a step that runs out of memory is its ``mode``:

- ``"split"``: the step is kept; its batch runs again as micro-batches under
  a smaller budget, gradients accumulated (on a stream too);
- ``"halve"``: on a sampler, the step is dropped, the sampler's budget
  shrinks and the rest of the epoch is re-planned, failed batch included
  (accelerate's ``find_executable_batch_size``, without the restart). A
  stream has no plan: it forms its next batches under the new budget, and
  the step, like every batch formed before (read ahead), runs in
  micro-batches, so every batch a DataLoader gives is trained once::

      formed:   b0 b1 b2 | b3 (read ahead)     | b4 b5 ... (formed under the new budget)
      trained:  b0 b1 b2'(micro, after OOM)  b3'(micro)  b4 b5 ...
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from tokenbatch import _accelerate, _checks
from tokenbatch import _distributed as distributed
from tokenbatch._lr import BatchScaledLR, global_count, lr_options
from tokenbatch.oom import _fsdp
from tokenbatch.oom._errors import OOMEvent, SampleTooLargeError, free_memory
from tokenbatch.oom._eval import EvalGuard
from tokenbatch.oom._grow import Grow, GrowEvent, Growth, as_grow
from tokenbatch.oom._optimizer import guarded_step
from tokenbatch.oom._split import check_weight
from tokenbatch.oom._step import (
    ForwardBackward,
    KeptGradients,
    Outcome,
    StepWork,
    next_event,
    raise_on_every_rank,
    share,
    share_count,
)
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

logger = logging.getLogger("tokenbatch.oom")

T = TypeVar("T")
MODES = ("split", "halve")
_STATE_VERSION = 3  # 3: the sampler's (or stream's) state is part of the guard's
_STATE_KEYS = {"version", "mode", "max_tokens", "events", "growth", "sampler"}


class OOMFallback:
    """The guard around a training step: on out-of-memory, shrink the budget on every rank and carry on.

    Args:
        sampler: the :class:`~tokenbatch.TokenBudgetBatchSampler` feeding the training DataLoader,
            or the :class:`~tokenbatch.TokenBudgetStream` it reads.
        model: the model as returned by ``accelerator.prepare`` (DDP-wrapped on
            several processes), or a plain ``nn.Module``.
        accelerator: optional; its ``backward`` is used (loss scaling, gradient
            accumulation) and gradients are averaged only when it says ``sync_gradients``.
        mode: ``"split"`` keeps each planned batch and optimizer step and runs an
            over-budget batch as micro-batches that fit a smaller budget, with
            gradients accumulated; ``"halve"`` shrinks the sampler's budget,
            re-plans the rest of the epoch and skips the failed step (iterate
            with :meth:`iterate`, which starts the DataLoader afresh).
        factor: the budget multiplier per out-of-memory event, in (0, 1). The
            new budget is ``factor * min(budget, cost of the largest batch that failed)``.
        min_tokens: the floor; an out-of-memory error at the floor raises
            :class:`~tokenbatch.SampleTooLargeError` instead of trying again.
        grow: after an OOM, try budgets between the largest that trained and the smallest that
            failed, each guarded like any step (a :class:`~tokenbatch.oom.Grow` sets how; False:
            shrink only). A failed try is in ``events`` (``growth=True``), each one that trained
            in ``growth_events``. A stream has no plan to prove a budget on: it only shrinks.
        weight: how micro-batch losses add up to the batch's: ``"samples"`` (a
            loss averaged over samples), ``"tokens"`` (over real tokens; of a
            pack, over its labelled tokens, as ``model(**batch).loss`` of a
            flattened row averages), a function of a micro-batch returning its
            count, or None (default): ``"tokens"`` for a pack, ``"samples"`` otherwise.
        pad_token_id: read row lengths from ``input_ids`` where batches have no ``attention_mask``.
        overlap: with DDP, all-reduce gradients during backward in an order that a failed rank
            still completes (:mod:`tokenbatch.oom._ddp`); False: average them after backward.
        lr_scaling: ``"linear"`` or ``"sqrt"``: :meth:`step` runs each optimizer step at the
            learning rate times rule(step size / ``lr_reference``) and puts the rate back after it,
            so a scheduler keeps its schedule; ``"none"`` (default): unscaled. Token-budget steps
            vary in size and are larger than a fixed batch on average.
        lr_scaling_by: what a step's size counts, over all ranks and accumulated batches:
            ``"tokens"`` (real tokens) or ``"samples"``.
        lr_reference: the step size the learning rate was tuned for, over all ranks (a fixed batch
            of 32 texts on 2 processes is 64 samples, or 64 times the mean length in tokens).

    Works with a plain module, with DDP (as ``accelerator.prepare`` wraps
    it) and with FSDP2 (``fully_shard``); not with FSDP1 or DeepSpeed. Under
    DDP the guard owns gradient synchronisation: it runs DDP under
    ``no_sync()``, all-reduces gradients itself (``overlap``) and keeps them
    once every rank has said its step succeeded, so no ``find_unused_parameters``
    is needed. Under FSDP2 on several processes the model's passes hold
    collectives, so out of memory in them stops the job for a restart from
    the last checkpoint, with the lowered budget recorded by the listeners
    (:mod:`tokenbatch.oom._fsdp`, docs/restarts.md); growth is off there.
    Gradient accumulation (``accelerator.accumulate``, or several ``backward``
    calls per optimizer step) works in both modes: a failed or dropped step
    loses only its own gradients. Split mode matches an unsplit run up to
    floating point when each sample's loss does not depend on how the batch
    is cut (no dropout, no BatchNorm in training mode, padding masked out,
    ``weight`` saying what the loss averages over).

    Checkpoint the guard, not the sampler: ``state_dict()`` holds the
    sampler's state at the steps trained (``accelerator.register_for_checkpointing(fallback)``),
    and :meth:`load_state_dict` resumes both.

    The training loop keeps its usual shape::

        for batch in fallback.iterate(train_dataloader):
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if loss is not None:  # None: the step was dropped (halve mode)
                fallback.step(optimizer)  # optimizer.step(), guarded too
                optimizer.zero_grad()

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
        mode: str = "split",
        factor: float = 0.5,
        min_tokens: float | None = None,
        grow: bool | Grow = True,
        weight: str | Callable[[Any], float] | None = None,
        pad_token_id: int | None = None,
        overlap: bool = True,
        lr_scaling: str = "none",
        lr_scaling_by: str = "tokens",
        lr_reference: float | None = None,
    ) -> None:
        if not isinstance(sampler, TokenBudgetBatchSampler | TokenBudgetStream):
            raise TypeError(
                f"sampler should be the tokenbatch.TokenBudgetBatchSampler feeding the DataLoader (or the "
                f"TokenBudgetStream it reads), but got sampler of type {type(sampler).__name__}"
            )
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model should be a torch.nn.Module, but got model of type {type(model).__name__}"
            )
        # Before the world-size checks below: their fixes would not mend a launch accelerate misread.
        _accelerate.check_processes(getattr(accelerator, "num_processes", None))
        self.mode = _checks.one_of("mode", mode, MODES)
        check_weight(weight)
        _fsdp.check_sharding(model, accelerator)
        if getattr(accelerator, "split_batches", False) is True:
            raise ValueError(
                "split_batches should be False for TokenBudgetBatchSampler, but got split_batches=True: "
                "there is no fixed batch to split between the processes. Leave it at its default "
                "(Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=False))): the "
                "sampler's global plan already gives each process its own batch of every step"
            )
        self._lr = _lr_rule(lr_scaling, lr_scaling_by, lr_reference)
        self._lr_count = 0  # samples or tokens trained on this rank since the last optimizer step
        self._lr_scaling: BatchScaledLR | None = None
        self.sampler, self.model, self.accelerator = sampler, model, accelerator
        self.factor = _checks.shrink_factor("factor", factor)
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
        self.weight, self.pad_token_id = weight, pad_token_id
        self.events: list[OOMEvent] = []
        self._plan = isinstance(sampler, TokenBudgetBatchSampler)
        self._drops_step = self.mode == "halve" and self._plan  # halve on a stream keeps the step
        self._passes = ForwardBackward(
            model, accelerator, cost=sampler.cost, weight=weight, pad_token_id=pad_token_id, overlap=overlap
        )
        settings = as_grow(grow)  # checked on a stream too
        # FSDP on several processes: the passes hold collectives, and out of memory there stops the job.
        self._lockstep = _fsdp.in_lockstep(model)
        # The budget the listeners record on this rank before it stops for a restart (None: running).
        self._stopping: float | None = None
        if self._lockstep and settings is not None:
            logger.info(
                "OOMFallback: growth is off under FSDP on %d processes, where a larger budget that runs "
                "out of memory costs a restart of the job",
                distributed.world_size(),
            )
            settings = None
        self.grow = settings if isinstance(sampler, TokenBudgetBatchSampler) else None
        """The growth settings in force (None: shrink only; always for a stream, which has no plan)."""
        self._growth: Growth | None = None
        if self.grow is not None and isinstance(sampler, TokenBudgetBatchSampler):
            self._growth = Growth(
                self.grow,
                sampler=sampler,
                model=model,
                mode=self.mode,
                keeps_step=not self._drops_step,
                read=self._passes.read,
            )
        self._micro_tokens = sampler.max_tokens  # the budget one forward/backward must fit (keeping the step)
        self._listeners: list[Callable[[OOMFallback], None]] = []
        self._unreported = False  # events recorded since the listeners last ran
        # Where the loop is: the steps of the sampler's (or stream's) epoch trained, and the step being
        # trained while iterate() runs; the pass that restarts after a re-plan, while one runs.
        self._epoch, self._steps_done, self._since = 0, 0, (0, 0)
        self._sync()
        self._step: int | None = None
        self._batches: _Batches[Any] | None = None
        self.eval_guard = EvalGuard(
            model,
            cost=sampler.cost,
            factor=self.factor,
            min_tokens=self.min_tokens,
            weight=weight,
            pad_token_id=pad_token_id,
        )

    # -- what it exposes ---------------------------------------------------------------

    @property
    def max_tokens(self) -> float:
        """The budget in force: the sampler's in halve mode, the micro-batch budget in split mode."""
        if self._stopping is not None:
            return self._stopping
        return self.sampler.max_tokens if self._drops_step else self._micro_tokens

    @property
    def steps_done(self) -> int:
        """Steps trained in the sampler's (or stream's) current epoch, as this loop counts them."""
        return self._first_step() if self._moved() else self._steps_done

    @property
    def growth_events(self) -> list[GrowEvent]:
        """Each larger budget that trained a step (``events`` holds the out-of-memory ones)."""
        return [] if self._growth is None else self._growth.events

    def memory_changed(self) -> None:
        """Memory was freed (or the model changed): climb again towards the sampler's budget. On every rank.

        Growth forgets the budgets that failed and tries, at the next step boundaries, budgets between
        the costliest step that trained and the sampler's budget, as after a first OOM there.
        """
        if self._growth is not None:
            self._growth.memory_changed()

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
        self._lower(max_tokens, steps_done=self.steps_done)
        return True

    def add_listener(self, callback: Callable[[OOMFallback], None]) -> None:
        """Call ``callback(fallback)``, on every rank, after each step that trained following new events.

        That is once the new budget has been shown to fit: the place to
        record it (what :func:`tokenbatch.probe.remember_budget` does).
        """
        self._listeners.append(callback)

    # -- checkpoints ---------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's checkpoint: the sampler's state at the steps trained, the budget, events and bracket.

        Register the guard for checkpointing (``accelerator.register_for_checkpointing(fallback)``)
        rather than the sampler. A stream's state is its own reader's: on several
        ranks save each rank's ``state_dict()`` (``save_state`` keeps the main process's only).
        """
        if isinstance(self.sampler, TokenBudgetBatchSampler):
            sampler_state = self.sampler.state_dict(steps_done=self.steps_done)
        else:
            sampler_state = self.sampler.state_dict()
        return {
            "version": _STATE_VERSION,
            "mode": self.mode,
            "max_tokens": self.max_tokens,
            "events": [event.as_dict() for event in self.events],
            "growth": None if self._growth is None else self._growth.state(),
            "sampler": sampler_state,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the sampler at the first step not trained, the budget, the events.

        Every field is checked before anything changes: on an error the guard and the sampler are as
        they were.

        Raises:
            TypeError, ValueError: the state is not this mode's ``state_dict()``, or a field is wrong;
                the message names it.
        """
        resume = self._read_state(state)
        self.sampler.load_state_dict(state["sampler"])  # checks every field before it changes anything
        resume()

    def _load_own_state(self, state: dict[str, Any]) -> None:
        """:meth:`load_state_dict` but the sampler's part: for a loop that has put the sampler in place.

        The Trainer and Lightning's callback resume the sampler themselves, where their loops need it.
        """
        self._read_state(state)()

    def _read_state(self, state: Any) -> Callable[[], None]:
        """Check a :meth:`state_dict` but its sampler's part; returns what resumes the guard from it."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION or set(state) != _STATE_KEYS:
            raise ValueError(
                f"state should be an OOMFallback.state_dict() (version {_STATE_VERSION}, keys "
                f"{sorted(_STATE_KEYS)}), but got {state!r:.200}"
            )
        if state["mode"] != self.mode:  # a halve-mode budget is the sampler's, not a micro-batch one
            raise ValueError(
                f"state['mode'] should be {self.mode!r}, this fallback's mode, but got "
                f"state['mode']={state['mode']!r}; resume with OOMFallback(..., mode={state['mode']!r})"
            )
        max_tokens = _checks.positive_number("state['max_tokens']", state["max_tokens"])
        saved = state["events"]
        if not isinstance(saved, list | tuple):
            raise TypeError(f"state['events'] should be a list, but got state['events']={saved!r:.100}")
        events = [OOMEvent.from_dict(e, name=f"state['events'][{i}]") for i, e in enumerate(saved)]
        growth: Callable[[], None] = lambda: None  # noqa: E731
        if self._growth is not None:
            growth = self._growth.restore(state["growth"])

        def resume() -> None:
            growth()
            if not self._drops_step:
                self._micro_tokens = min(self.sampler.max_tokens, max_tokens)
            self.events = events
            self._sync()

        return resume

    # -- the loop ------------------------------------------------------------------------

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch, across any re-plans; counts the steps trained.

        A step is trained once its backward pass succeeded, or once the loop
        asks for the next batch. After a halve-mode re-plan the DataLoader
        iterator (and the batches it read ahead from the old plan) is closed,
        and a fresh one resumes at the first step not yet trained.

        Raises:
            ValueError: ``dataloader`` does not draw its batches from the sampler
                (or takes it as ``sampler=``), skips batches (``skip_first_batches``),
                or reads the global plan (``rank=None``) itself on several processes;
                or, over a stream, batches its batches again (``batch_size`` not None).
        """
        if isinstance(self.sampler, TokenBudgetStream):
            return self._iterate_stream(dataloader)
        self._check_feeds(dataloader)
        return self._iterate(_Batches(dataloader, self.sampler))

    def _iterate(self, batches: _Batches[T]) -> Iterator[T]:
        self._follow(batches)
        try:
            for step, batch in batches:
                self._step, restarts = step, batches.restarts
                yield batch
                if batches.restarts == restarts:  # the loop asked for the next batch: this one is done
                    self._trained(step)
        finally:
            self._step = None
            if self._batches is batches:
                self._batches = None
            batches.close()

    def _follow(self, batches: _Batches[Any], *, steps_done: int | None = None) -> None:
        """Count the steps of ``batches`` (a pass over the sampler's DataLoader); restart it on re-plans.

        ``steps_done``: the steps of the epoch trained so far, where the loop has drawn batches
        ahead of training (the Trainer's); by default none was drawn yet.
        """
        self._batches = batches
        self._sync(batches.next_step if steps_done is None else steps_done)

    def _iterate_stream(self, dataloader: Iterable[T]) -> Iterator[T]:
        dataset = getattr(dataloader, "dataset", self.sampler)
        if dataset is not self.sampler:
            raise ValueError(
                f"dataloader should read this fallback's stream, DataLoader(stream, batch_size=None, "
                f"collate_fn=...), but its dataset is a {type(dataset).__name__}; pass the stream given "
                f"to OOMFallback"
            )
        batch_size = getattr(dataloader, "batch_size", None)  # DataLoader's, public
        if batch_size is not None:
            raise ValueError(
                f"batch_size should be None in the DataLoader over a TokenBudgetStream, but got "
                f"batch_size={batch_size}: the stream yields whole batches (lists of examples), and the "
                f"DataLoader would put {batch_size} of them in a list for the collator; pass "
                f"DataLoader(stream, batch_size=None, collate_fn=...)"
            )
        self._sync()
        try:
            for step, batch in enumerate(dataloader, start=self._steps_done):
                self._step = step
                yield batch
                self._trained(step)
        finally:
            self._step = None

    def step(self, optimizer: torch.optim.Optimizer) -> float:
        """``optimizer.step()`` on every rank together; out of memory: free memory and retry once, or raise.

        With ``lr_scaling``, the step runs at the scaled learning rate (the batches trained since
        the last step, summed over ranks: one small all-reduce). Under ``accelerator.accumulate``,
        call it after every batch as accelerate's loops do: until the accelerator syncs gradients,
        accelerate's optimizer skips the step and the batches keep counting towards it.

        Returns:
            The learning-rate multiplier the step ran at (1.0 without ``lr_scaling``).

        Raises:
            ~tokenbatch.oom.OptimizerOOMError: on every rank, naming the optimizer and the failed allocation.
            RankFailedError: another rank's step raised an error that is not out-of-memory.
        """
        where = f"epoch {self.sampler.epoch}, step {max(self.steps_done - 1, 0)}"
        if self._lockstep:  # a collective that lost its peer (a rank stopped for a restart) ends this one
            with _fsdp.ends_on_error(where):
                return self._step_optimizer(optimizer, where)
        return self._step_optimizer(optimizer, where)

    def _step_optimizer(self, optimizer: torch.optim.Optimizer, where: str) -> float:
        accumulating = not getattr(self.accelerator, "sync_gradients", True)
        if self._lr is None or accumulating:
            # Inside accelerator.accumulate() between the group's last batches, accelerate's prepared
            # optimizer skips the step: the batches trained so far count towards the step to come.
            guarded_step(optimizer, where=where)
            return 1.0
        size, self._lr_count = global_count(self._lr_count), 0  # every rank, once per optimizer step
        if size == 0:  # nothing trained on any rank since the last step: the scheduler's rate stands
            guarded_step(optimizer, where=where)
            return 1.0
        rule, by, reference = self._lr
        if self._lr_scaling is None or self._lr_scaling.optimizer is not optimizer:
            self._lr_scaling = BatchScaledLR(optimizer, reference=reference, by=by, rule=rule)
        with self._lr_scaling.applied(size) as scale:
            guarded_step(optimizer, where=where)
        return scale

    def evaluate(self, batch: Any, fn: Callable[[Any], T], *, lower_training: bool = False) -> T:
        """``fn(batch)`` without gradients, in micro-batches on every rank after out-of-memory on any.

        See :class:`~tokenbatch.oom.EvalGuard` (``fallback.eval_guard``, which
        keeps the evaluation budget and events). The training budget stays as
        it is unless ``lower_training``: then, between steps, it drops to the
        evaluation budget after an out-of-memory error.
        """
        result = self.eval_guard.evaluate(batch, fn)
        budget = self.eval_guard.max_tokens
        if lower_training and budget is not None:
            self.start_from(budget)
        return result

    def backward(self, batch: Any, loss_fn: Callable[[Any], torch.Tensor]) -> torch.Tensor | None:
        """Run ``loss_fn(batch)`` and its backward pass; on out-of-memory, recover on every rank.

        Args:
            batch: the collated batch (dict of tensors with an ``attention_mask``, ...), or a
                flattened pack (``input_ids``, ``labels`` and ``position_ids`` in one row).
            loss_fn: forward pass returning the batch's scalar loss, averaged over its samples
                (of a pack: over its labelled tokens, see ``weight``).

        Returns:
            The detached loss (a weighted sum of micro-batch losses if split),
            or None when the step was dropped (halve mode): skip ``optimizer.step()``.

        Raises:
            SampleTooLargeError: even one sample does not fit, or the budget is at ``min_tokens``.
            RankFailedError: another rank raised an error that is not out-of-memory
                (that rank re-raises its own error unchanged).
            ValueError: halve mode on a sampler outside :meth:`iterate`, which is
                what starts the DataLoader afresh after a re-plan.
        """
        if self._drops_step and self._batches is None:
            raise ValueError(
                "mode='halve' re-plans the rest of the epoch after running out of memory, which needs "
                "the DataLoader iterated afresh, but backward() was called outside fallback.iterate(): "
                "loop with `for batch in fallback.iterate(train_dataloader):`, or use mode='split', "
                "which keeps every planned batch"
            )
        step = self._step if self._step is not None else self.steps_done
        if self._lockstep:
            return self._after_step(step, batch, self._lockstep_step(batch, loss_fn, step))
        passes = self._passes
        params = passes.params()
        # Accumulation: the step runs into fresh gradients; the group's earlier ones survive a failure.
        with passes.ddp.step(self.accelerator) as sync, KeptGradients(params) as kept:
            work = StepWork(batch)
            attempt = 0
            while True:
                outcome, error = Outcome(), None
                if work.loss is None:
                    micro = self._micro_budget()
                    fill = self._growth is not None and self._growth.filling()
                    outcome, error = passes.attempt(
                        work, loss_fn, params, micro_tokens=micro, sync=sync, kept=kept, fill=fill
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
                if self._growth is not None:  # a failed try: back to the budget before it
                    event = self._growth.failed(event, outcomes)
                self._record(event)
                # A sample over the new budget gets a batch of its own (the sampler admitted it): only when
                # it runs out of memory alone does next_event raise SampleTooLargeError, with its length.
                self._lower(event.new_max_tokens, steps_done=step)
                if self._drops_step:
                    kept.restore()  # the step is dropped on every rank; the group's earlier gradients stay
                    return None
                attempt += 1  # and try again, in smaller micro-batches
            if work.average is not None:
                work.average.average_into_grads(any_grad)
            kept.release()
        return self._after_step(step, batch, work.loss)

    def _after_step(self, step: int, batch: Any, loss: torch.Tensor | None) -> torch.Tensor | None:
        """Every rank's step trained: count it, grow, tell the listeners of new events."""
        self._trained(step)
        if self._lr is not None:  # this step's size, once, however many micro-batches it ran as
            shape = self._passes.read(batch)
            self._lr_count += shape.size if self._lr[1] == "samples" else int(shape.lengths.sum())
        if self._growth is not None:
            if self._growth.trained(step=step, budget=self.max_tokens, batch=batch):
                self._unreported = True  # a larger budget trained: the listeners remember it
            self._growth.try_larger(
                self.max_tokens, step + 1, self._lower, can_replan=self._batches is not None
            )
        if self._unreported:
            self._unreported = False
            for listener in self._listeners:
                listener(self)
        return loss

    def _lockstep_step(
        self, batch: Any, loss_fn: Callable[[Any], torch.Tensor], step: int
    ) -> torch.Tensor | None:
        """One step under FSDP on several processes (:mod:`tokenbatch.oom._fsdp`): its detached loss.

        After a lowered budget (split mode) each rank cuts its batch first, and one all-reduce
        shares how that went and how many passes every rank runs: out of memory there is
        recovered from in place, as no collective of the step has begun. Out of memory in the
        passes stops the job for a restart (:meth:`_stop_for_restart`). Nothing is shared after
        the passes: had a rank failed in them, the others could not have finished theirs.
        """
        passes = self._passes
        with KeptGradients(passes.params()) as kept:
            work = StepWork(batch)
            attempt = 0
            while True:
                micro = self._micro_budget()
                count = 1
                if micro is not None:  # the ranks may cut their batches into different numbers of passes
                    outcome, error = passes.prepare(work, micro_tokens=micro)
                    if outcome.status == "oom":
                        free_memory()
                    count = 1 if work.pieces is None else len(work.pieces)
                    outcomes, count = share_count(outcome, count)
                    if any(o.status == "error" for o in outcomes):
                        raise_on_every_rank(outcomes, error, f"epoch {self.sampler.epoch}, step {step}")
                    if any(o.status == "oom" for o in outcomes):
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
                        self._record(event)
                        self._lower(event.new_max_tokens, steps_done=step)
                        attempt += 1
                        continue
                outcome, error = passes.attempt_in_lockstep(work, loss_fn, passes=count, micro_tokens=micro)
                if error is not None:
                    _fsdp.end_on_error(error, f"epoch {self.sampler.epoch}, step {step}")
                if outcome.status == "oom":
                    self._stop_for_restart(outcome, step=step, attempt=attempt)
                break
            kept.add_into_grads()
            kept.release()
        return work.loss

    def _stop_for_restart(self, outcome: Outcome, *, step: int, attempt: int) -> None:
        """Out of memory in FSDP's passes on this rank: record the lowered budget, then end the process.

        The event is this rank's alone (the others are inside a collective and cannot be asked);
        the listeners (:func:`tokenbatch.probe.remember_budget`) write its budget where the
        restarted job reads it.

        One sample alone out of memory, or the budget at ``min_tokens``, ends the process with
        status 1 and the :class:`~tokenbatch.SampleTooLargeError` logged: a restart would fail again.
        """
        world, rank = distributed.world_size(), distributed.rank()
        outcomes = [Outcome()] * world
        outcomes[rank] = outcome
        try:
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
        except SampleTooLargeError as too_large:
            _fsdp.end_on_error(too_large, f"epoch {self.sampler.epoch}, step {step}")
        self.events.append(event)
        # What the listeners read as max_tokens; no re-plan on a rank about to end (the restart re-plans).
        self._stopping = event.new_max_tokens
        for listener in self._listeners:
            try:
                listener(self)
            except Exception:  # a listener must not keep this rank alive: the others wait for it
                logger.exception("OOMFallback: a listener failed before the stop for a restart")
        recorded = (
            f"the listeners ({len(self._listeners)}, e.g. tokenbatch.probe.remember_budget) have recorded "
            f"max_tokens={event.new_max_tokens:g} for the restarted job"
            if self._listeners
            else "nothing records the lowered budget, so the restarted job will run out of memory here "
            "again: call tokenbatch.probe.remember_budget(fallback, key, cache) after loading the checkpoint"
        )
        _fsdp.end_process(
            f"{event}. Under FSDP on {world} processes the other ranks wait inside the model's collectives, "
            f"so no rank can recover in place: {recorded}; rank {rank} exits with status "
            f"{_fsdp.EXIT_CODE} so that torchrun --max-restarts starts every rank again, from the last "
            f"complete checkpoint"
        )

    # -- inside --------------------------------------------------------------------------

    def _first_step(self) -> int:
        """The step the sampler's (or stream's) next pass starts at: 0, or where a resume left it."""
        if isinstance(self.sampler, TokenBudgetBatchSampler):
            return self.sampler.start_step
        run = self.sampler.state_dict()["run"]  # before a pass: the state loaded last, if any
        return int(run["yielded"]) if run else 0

    def _sync(self, steps_done: int | None = None) -> None:
        """Count from ``steps_done`` (default: where the sampler's next pass starts) in its epoch."""
        self._epoch = self.sampler.epoch
        self._steps_done = self._first_step() if steps_done is None else steps_done
        self._since = (self._epoch, self._steps_done)

    def _moved(self) -> bool:
        """The sampler is not where this count is: a new epoch, or a resume before any step trained."""
        if self._epoch != self.sampler.epoch:
            return True
        fresh = self._steps_done == self._since[1] and self._batches is None
        return (
            fresh
            and isinstance(self.sampler, TokenBudgetBatchSampler)
            and self._first_step() != self._since[1]
        )

    def _trained(self, step: int) -> None:
        if self._moved():
            self._sync()
        self._steps_done = max(self._steps_done, step + 1)

    def _micro_budget(self) -> float | None:
        """The budget to cut this attempt's batch to, or None to run it as formed."""
        if self._drops_step:
            return None
        # Until the budget drops below what the batches were formed under, they run as they come.
        sampler = self.sampler
        formed = sampler.ceiling if isinstance(sampler, TokenBudgetStream) else sampler.max_tokens
        return self._micro_tokens if self._micro_tokens < formed else None

    def _record(self, event: OOMEvent) -> None:
        self.events.append(event)
        self._unreported = True
        if distributed.rank() == 0:
            logger.warning("%s", event)

    def _lower(self, max_tokens: float, *, steps_done: int) -> None:
        """Put ``max_tokens`` in force (lower, or higher to grow): the micro-batch budget, or re-plan."""
        if not self._drops_step:
            self._micro_tokens = max_tokens
        if self.mode == "halve":
            self.sampler.replan(max_tokens, steps_done=steps_done)
        if self._drops_step and self._batches is not None:
            self._batches.restart()

    def _check_feeds(self, dataloader: object) -> None:
        """Refuse a DataLoader that the sampler does not feed (re-plans would not reach it).

        Also one that skips batches, or reads the global plan as it is on
        several processes (every rank would train every sample).
        """
        chain = _accelerate.batch_samplers(dataloader)  # DataLoader -> BatchSamplerShard -> ...
        skipped = _accelerate.skipped_batches(chain)
        if skipped:  # accelerate's skip_first_batches: the steps would be numbered from the wrong one
            raise ValueError(
                f"dataloader should not skip batches under OOMFallback, but it comes from "
                f"skip_first_batches(..., {skipped}): the sampler resumes by itself at the first step "
                f"not yet trained. Checkpoint the fallback (fallback.state_dict(), or "
                f"accelerator.register_for_checkpointing(fallback)) and iterate the prepared "
                f"DataLoader itself after loading it"
            )
        if any(getattr(source, "sampler", None) is self.sampler for source in chain):  # torch's BatchSampler
            raise ValueError(
                "dataloader should take the sampler as its batch_sampler, but it got it as sampler=: it "
                "then batches the sampler's batches again (batch_size=1); pass DataLoader(dataset, "
                "batch_sampler=sampler, collate_fn=...)"
            )
        if chain and not any(source is self.sampler for source in chain):
            raise ValueError(
                f"dataloader should draw its batches from this fallback's sampler, but its batch "
                f"samplers are {' -> '.join(type(s).__name__ for s in chain)}; pass DataLoader(dataset, "
                f"batch_sampler=sampler) (prepared by accelerate or not) for the sampler given to OOMFallback"
            )
        world = distributed.world_size()
        if chain and chain[0] is self.sampler and self.sampler.rank is None and world > 1:
            raise ValueError(
                f"rank should be this process's rank when a DataLoader reads the sampler itself "
                f"on {world} processes (plain DDP), but got rank=None: the sampler then yields "
                f"the global plan, every rank's batches, and every rank would train every "
                f"sample; pass rank=torch.distributed.get_rank(), or let "
                f"accelerator.prepare(dataloader) share the plan out"
            )


class _Batches(Generic[T]):
    """``(step, batch)`` for the rest of the sampler's epoch, from a DataLoader over it; restartable.

    The DataLoader is iterated lazily, from the sampler's ``start_step``.
    :meth:`restart` (after a re-plan) closes the DataLoader iterator and the
    batches it read ahead from the old plan; the next batch is then the new
    plan's first step not yet trained. ``restarts`` counts them, so that a
    loop which reads batches ahead of training (the Trainer's) can tell a
    batch of a replaced plan.
    """

    def __init__(self, dataloader: Iterable[T], sampler: TokenBudgetBatchSampler) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.next_step = sampler.start_step
        """The step of the next batch this gives."""
        self.restarts = 0
        self._iterator: Iterator[T] | None = None
        self._exhausted = False

    def __iter__(self) -> _Batches[T]:
        return self

    def __next__(self) -> tuple[int, T]:
        if self._exhausted:
            raise StopIteration
        if self._iterator is None:
            set_epoch = getattr(self.dataloader, "set_epoch", None)
            if callable(set_epoch):
                # accelerate's DataLoaderShard passes its own count of full passes to the sampler's
                # set_epoch when iterated on one process, and an abandoned pass is not counted: align
                # it with the sampler, or a resumed or restarted epoch would be sent back to another.
                set_epoch(self.sampler.epoch)
            self._iterator = iter(self.dataloader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = None
            self._exhausted = True
            raise
        step = self.next_step
        self.next_step += 1
        return step, batch

    def restart(self) -> None:
        """After a re-plan: continue at the step the sampler's next pass starts at."""
        self.close()
        self.next_step = self.sampler.start_step
        self._exhausted = False
        self.restarts += 1

    def close(self) -> None:
        """Stop an unfinished DataLoader iterator (and unregister it from accelerate's gradient state)."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        close = getattr(iterator, "close", None)
        if callable(close):
            close()  # a generator (accelerate's DataLoaderShard) stops reading ahead
        del iterator  # a DataLoader iterator shuts its workers down when dropped
        end = getattr(self.dataloader, "end", None)
        if callable(end) and hasattr(self.dataloader, "gradient_state"):
            # accelerate registers a DataLoader with its GradientState until the end of an
            # iteration, and an abandoned one never gets there: end it here.
            with contextlib.suppress(ValueError):  # older accelerate: it had already ended
                end()


def _lr_rule(rule: Any, by: Any, reference: Any) -> tuple[str, str, float] | None:
    """``(rule, by, reference)`` of the ``lr_scaling`` options, or None for no scaling."""
    rule, by, given = lr_options(rule, by, reference)
    if rule == "none":
        return None
    if given is None:
        raise ValueError(
            f"lr_reference should be the step size (in {by}, over all ranks) the learning rate was tuned "
            f"for with lr_scaling={rule!r}, but got lr_reference=None; e.g. 32 texts on 2 processes "
            f"are lr_reference=64 samples, or 64 * mean_length tokens"
        )
    return rule, by, given
