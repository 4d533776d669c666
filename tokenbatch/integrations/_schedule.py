"""How many optimizer steps a token-budget run takes, and a learning-rate schedule that can follow a change.

Trainer sizes the run (``state.max_steps``, the scheduler's length) from
``len(train_dataloader)`` once. Here the plans of all epochs count instead:
they are pure functions of (seed, epoch, budget), so the exact number of
optimizer steps is known before training. A halve-mode re-plan makes the rest
of training take more steps (smaller batches): :func:`grow_run` then raises
``state.max_steps`` so that no epoch is cut short, and :class:`StretchedSchedule`
spreads the rest of the original schedule over the new steps, rather than
restart it (a new warmup) or run past its end (a learning rate of zero).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

from transformers import TrainerCallback

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
    later = range(sampler.epoch + 1, epochs)
    rest = sum(planned_updates(sampler, e, sampler.max_tokens, accumulation) for e in later)
    return global_step + 1 + math.ceil(remaining / accumulation) + rest


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
    """Wraps an LR scheduler built for ``length`` steps; :meth:`stretch` spreads its rest over more steps.

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


class EpochProgress(TrainerCallback):
    """Sets ``state.epoch`` from the share of the epoch's plan trained (Trainer assumes a fixed count).

    ``sampler`` gives the training sampler, or None before there is one.
    """

    def __init__(self, sampler: Callable[[], TokenBudgetBatchSampler | None]) -> None:
        self.sampler = sampler

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        sampler = self.sampler()
        if sampler is not None:
            state.epoch = sampler.epoch + sampler.position.trained / max(1, sampler.plan.num_steps)
