"""How many optimizer steps a token-budget run takes, and a learning-rate schedule that can follow a change.

Trainer sizes the run (``state.max_steps``, the scheduler's length) from
``len(train_dataloader)`` once. Here the plans of all epochs count instead:
they are pure functions of (seed, epoch, budget), so the exact number of
optimizer steps is known before training (:func:`run_length`), and
:class:`RunProgress`, a callback, makes Trainer's state say so. A halve-mode re-plan makes the rest
of training take more steps (smaller batches): :func:`grow_run` then raises
``state.max_steps`` so that no epoch is cut short, and :class:`StretchedSchedule`
spreads the rest of the original schedule over the new steps, rather than
restart it (a new warmup) or run past its end (a learning rate of zero).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

from tokenbatch import _checks
from tokenbatch.integrations.transformers._feed import BudgetLoader, StreamLoader
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.integrations.transformers")
_KEY = "tokenbatch_stretch"


def planned_updates(
    sampler: TokenBudgetBatchSampler, epoch: int, max_tokens: float, accumulation: int
) -> int:
    """Optimizer steps the plan of ``epoch`` makes under ``max_tokens``, ``accumulation`` batches a step."""
    return math.ceil(sampler.steps_in_epoch(epoch, max_tokens) / accumulation)


def grown_length(
    sampler: TokenBudgetBatchSampler, *, remaining: int, global_step: int, accumulation: int, epochs: int
) -> int:
    """Optimizer steps of the whole run after a re-plan, from optimizer step ``global_step`` on.

    ``remaining``: the batches of this epoch's plan not yet handed out; later
    epochs, up to ``epochs``, are planned under the sampler's budget in force.
    """
    left = updates_left(sampler, remaining=remaining, accumulation=accumulation, epochs=epochs)
    return global_step + 1 + left


def updates_left(sampler: TokenBudgetBatchSampler, *, remaining: int, accumulation: int, epochs: int) -> int:
    """Optimizer steps for ``remaining`` batches of this epoch's plan, then epochs up to ``epochs``.

    Later epochs are planned under the sampler's budget in force, on its world size.
    """
    this = math.ceil(remaining / accumulation) if sampler.epoch < epochs else 0
    later = range(sampler.epoch + 1, epochs)
    return this + sum(planned_updates(sampler, e, sampler.max_tokens, accumulation) for e in later)


def grow_run(state: Any, lr_scheduler: Any, callbacks: list[Any], total: int) -> None:
    """Raise ``state.max_steps`` to ``total`` and stretch the schedule and the progress bar to it."""
    state.max_steps = total
    if isinstance(lr_scheduler, StretchedSchedule):
        lr_scheduler.stretch(total)
    for callback in callbacks:  # the progress bar's total
        bar = getattr(callback, "training_bar", None)
        if bar is not None:
            bar.total = total
            bar.refresh()


class StretchedSchedule:
    """Wraps an LR scheduler built for ``length`` steps; :meth:`stretch` spreads its rest over other steps.

    Until the first :meth:`stretch`, each ``step()`` is one step of the
    wrapped scheduler. After ``stretch(total)`` at optimizer step ``d``, the
    remaining ``length - position`` scheduler steps are spread evenly over the
    remaining ``total - d`` optimizer steps (the wrapped scheduler steps on
    some optimizer steps and holds on the others). Everything else is the
    wrapped scheduler's; the stretch is saved with its state.
    """

    def __init__(self, scheduler: Any, length: int) -> None:
        self.scheduler = scheduler
        self.length = int(length)
        self.done = 0  # optimizer steps (step() calls)
        self.position = 0.0  # where in the wrapped schedule they have got to
        self.taken = 0  # steps of the wrapped scheduler: floor(position)
        self.rate = 1.0

    def step(self) -> None:
        self.done += 1
        self.position += self.rate
        while self.taken < math.floor(self.position + 1e-9):
            self.scheduler.step()
            self.taken += 1

    def stretch(self, total_steps: int) -> None:
        """Reach the end of the wrapped schedule at optimizer step ``total_steps``."""
        remaining = total_steps - self.done
        if remaining > 0:
            self.rate = max(0.0, (self.length - self.position) / remaining)

    def get_last_lr(self) -> list[float]:
        return list(self.scheduler.get_last_lr())

    def state_dict(self) -> dict[str, Any]:
        stretch = {"length": self.length, "done": self.done, "position": self.position, "taken": self.taken}
        return {"scheduler": self.scheduler.state_dict(), _KEY: {**stretch, "rate": self.rate}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if _KEY not in state:  # saved by a plain scheduler: nothing stretched yet
            self.scheduler.load_state_dict(state)
            self.done = self.taken = int(getattr(self.scheduler, "last_epoch", 0))
            self.position, self.rate = float(self.done), 1.0
            return
        self.scheduler.load_state_dict(state["scheduler"])
        saved = state[_KEY]
        self.length, self.done, self.taken = int(saved["length"]), int(saved["done"]), int(saved["taken"])
        self.position, self.rate = float(saved["position"]), float(saved["rate"])

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (while unpickling): do not recurse
            raise AttributeError(name)
        return getattr(self.scheduler, name)


@dataclass
class Run:
    """One ``train()`` call of a token-budget run: its loader and lengths, and the counts its logs need."""

    loader: BudgetLoader | StreamLoader
    schedule_length: int
    """Optimizer steps the learning-rate schedule is built for (the plans' count at the start of the run)."""
    max_steps: int
    """The run's optimizer steps: ``schedule_length``, or a resumed run's (grown by re-plans or not)."""
    resumed: bool
    first_step: int = 0
    """The global step it starts at (a resumed run's saved one)."""
    saved_max_steps: int | None = None
    """A resumed run's length as saved; on another number of processes its plans make another."""
    samples_since_log: int = 0
    logged_step: int = 0


def run_length(loader: BudgetLoader, args: Any, max_tokens: float, resume: dict[str, Any] | None) -> Run:
    """The run over ``loader`` (its sampler resumed, if it is) with ``TrainingArguments`` ``args``.

    Its length is ``args.max_steps`` when set; else exact: the plans under
    ``max_tokens`` are pure functions of (seed, epoch). A resumed run keeps
    its saved schedule length, and lasts the global step it resumes at plus
    the optimizer steps left from where the sampler resumed (on another number
    of processes, other than what the saving run had left).
    """
    sampler, resumed = loader.sampler, resume is not None
    first = 0 if resume is None else int(resume["global_step"])
    if args.max_steps > 0:
        return Run(loader, args.max_steps, args.max_steps, resumed, first)
    accumulation = args.gradient_accumulation_steps
    epochs = int(args.num_train_epochs)
    if resume is not None:
        remaining = sampler.plan.num_steps - sampler.start_step
        left = updates_left(sampler, remaining=remaining, accumulation=accumulation, epochs=epochs)
        saved = int(resume["max_steps"])
        return Run(loader, int(resume["schedule_length"]), first + left, True, first, saved)
    total = sum(planned_updates(sampler, epoch, max_tokens, accumulation) for epoch in range(epochs))
    return Run(loader, total, total, False)


class RunProgress(TrainerCallback):
    """Trainer's counts made true for a token-budget run (``run()`` gives it; None: not one).

    Trainer sizes the run from the loader's length (a bound, see
    :mod:`tokenbatch.integrations.transformers._feed`) and assumes a fixed count of batches
    per epoch: at the start of training this sets ``state.max_steps`` (and the
    logging, evaluation and saving steps given as a share of it) to the plans'
    count; after each optimizer step it sets ``state.epoch`` from the share of
    the epoch's plan trained, and ends the epoch once the plan is trained.
    Put it before Trainer's own callbacks (the progress bar reads ``max_steps``).
    """

    def __init__(self, run: Callable[[], Run | None]) -> None:
        self.run = run

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run()
        if run is None:
            return
        run.samples_since_log, run.logged_step = 0, state.global_step
        if args.max_steps > 0:
            return
        if not run.resumed:  # a resumed state has them from the run that saved it
            for kind in ("logging", "eval", "save"):  # a share of the run, as Trainer resolves it
                share = getattr(args, f"{kind}_steps", None)
                if share is not None and share < 1:
                    setattr(state, f"{kind}_steps", math.ceil(run.schedule_length * share))
        elif run.saved_max_steps is not None and run.saved_max_steps != run.max_steps:
            # Resumed on another number of processes (or for more epochs): what is left was planned
            # again, in other optimizer steps. The schedule's rest is spread over them, without a jump.
            logger.info(
                "resumed at optimizer step %d: %d optimizer steps in all instead of %d, as the plans "
                "make them on %d processes",
                run.first_step,
                run.max_steps,
                run.saved_max_steps,
                run.loader.sampler.num_replicas,
            )
            scheduler = kwargs.get("lr_scheduler")
            if isinstance(scheduler, StretchedSchedule):
                scheduler.stretch(run.max_steps)
        state.max_steps = run.max_steps
        logger.info(
            "max_tokens=%s: %d optimizer steps over %d epochs, as the token-budget plans make them",
            _checks.budget(run.loader.sampler.max_tokens),
            run.max_steps,
            int(args.num_train_epochs),
        )

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run()
        if run is None or isinstance(run.loader, StreamLoader):  # a stream's epoch ends when it is read out
            return
        sampler, trained = run.loader.sampler, run.loader.trained
        steps = sampler.plan.num_steps
        state.epoch = sampler.epoch + trained / max(1, steps)
        if run.loader.feed is not None and trained >= steps:
            control.should_epoch_stop = True  # the plan is trained: Trainer's count of batches is a bound

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        run = self.run()
        if run is not None:
            run.loader.close()

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on_epoch_end(args, state, control)
