"""Validation at evenly spaced steps of every epoch, timed in training seconds only.

Validating once per epoch makes every "time to macro-F1 X" an epoch boundary:
on a 3-epoch run a 0.005 difference in F1 can decide between 2 and 3 epochs.
:class:`ValidationPoints` validates ``per_epoch`` times an epoch instead, and
keeps the clock of training apart from the clock of validation, so that arms
validated at the same points are compared by their training time alone::

    points = ValidationPoints(per_epoch=4, steps_per_epoch=len(loader), validate=score)
    for epoch in range(epochs):
        for batch in loader:
            ...  # one optimizer step
            points.after_step(epoch, tokens=int(batch["attention_mask"].sum()))
    points.records  # [{"epoch": 0.25, "step": 9, "train_seconds": ..., "macro_f1": ...}, ...]
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any


def steps_to_validate(steps_per_epoch: int, per_epoch: int) -> list[int]:
    """The steps (1-based, within an epoch) after which to validate; the epoch's last step is last.

    >>> steps_to_validate(35, 4)
    [9, 18, 27, 35]
    >>> steps_to_validate(3, 4)
    [1, 2, 3]
    """
    return sorted({math.ceil(steps_per_epoch * k / per_epoch) for k in range(1, per_epoch + 1)})


class ValidationPoints:
    """Calls ``validate()`` (every rank: it may be collective) at the chosen steps and records the score.

    Steps must be counted on every rank alike (they are, under a token-budget plan
    or a DistributedSampler); ``tokens`` are this rank's and only recorded.
    """

    def __init__(
        self, *, per_epoch: int, steps_per_epoch: int, validate: Callable[[], tuple[float, int]]
    ) -> None:
        self.points = set(steps_to_validate(steps_per_epoch, per_epoch))
        self.validate = validate
        self.records: list[dict[str, Any]] = []
        self.validation_seconds = 0.0  # validation time so far, kept off the training clock
        self._start = time.perf_counter()
        self._step_in_epoch = 0
        self._epoch = -1
        self._steps = 0
        self._tokens = 0
        self._validated = True  # nothing trained yet: nothing to validate at an epoch's end
        self.steps_per_epoch = steps_per_epoch

    def train_seconds(self) -> float:
        """Seconds since the start, less the time spent validating."""
        return time.perf_counter() - self._start - self.validation_seconds

    def after_step(self, epoch: int, *, tokens: int) -> None:
        """Count one optimizer step of ``epoch`` (0-based), ``tokens`` on this rank; validate at a point."""
        if epoch != self._epoch:
            self._epoch, self._step_in_epoch = epoch, 0
        self._step_in_epoch += 1
        self._steps += 1
        self._tokens += tokens
        self._validated = False
        if self._step_in_epoch in self.points:
            self._record()

    def end_epoch(self) -> tuple[float, int]:
        """The macro-F1 and texts scored at the end of the epoch: validates unless its last step did.

        (The last planned step always does; an epoch re-planned to more steps ends elsewhere.)
        """
        if not self._validated:
            self._record()
        record = self.records[-1]
        return float(record["macro_f1"]), int(record["eval_samples"])

    def _record(self) -> None:
        trained = self.train_seconds()
        start = time.perf_counter()
        macro_f1, scored = self.validate()
        self.validation_seconds += time.perf_counter() - start
        self._validated = True
        self.records.append(
            {
                "epoch": self._epoch + self._step_in_epoch / self.steps_per_epoch,
                "step": self._steps,
                "train_seconds": trained,
                "tokens_trained": self._tokens,
                "macro_f1": macro_f1,
                "eval_samples": scored,
            }
        )
