"""The OOM guard's view of a :class:`~tokenbatch.TokenBudgetStream`'s epoch: the step being trained.

The map-style counterpart is :class:`~tokenbatch._epoch.EpochCursor`. A
stream has no plan to restart from: a halve-mode re-budget changes the
batches the stream forms next, and the batches already formed (read ahead
by the DataLoader) are trained as they come, in micro-batches where they are
over the new budget. So the DataLoader pass is never restarted
(``restart_pending`` stays False) and no batch is refused (``unfed`` is
None): every batch the DataLoader gives is trained once, on every rank the
same number of them (the stream's own agreement).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TypeVar

from tokenbatch.stream import TokenBudgetStream

T = TypeVar("T")


class StreamCursor:
    """Steps trained in the stream's current epoch, counted by the guard's loop.

    Example:
        >>> stream = TokenBudgetStream([{"input_ids": [0] * 3}] * 4, max_tokens=6, buffer_size=4)
        >>> cursor = StreamCursor(stream)
        >>> [len(batch) for batch in cursor.iterate(stream)], cursor.steps_done
        ([2, 2], 2)
    """

    restart_pending = False
    """Always False: a re-budget never restarts the DataLoader."""

    def __init__(self, stream: TokenBudgetStream) -> None:
        self.stream = stream
        self._trained = 0
        self._epoch = stream.epoch
        self._step = 0
        self._iterating = False

    @property
    def steps_done(self) -> int:
        """Batches trained in the stream's current epoch (0 once ``set_epoch`` moved it on)."""
        return self._trained if self._epoch == self.stream.epoch else 0

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        self._trained, self._epoch = steps, self.stream.epoch

    def current_step(self) -> int:
        """The step being trained: the batch ``iterate`` last yielded, else the next one."""
        return self._step if self._iterating else self.steps_done

    def replanned(self) -> None:
        """Nothing to restart: the stream forms its next batches under the new budget itself."""

    def unfed(self) -> Exception | None:
        """None: every batch the DataLoader gives is trained (in micro-batches if over the budget)."""
        return None

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` (a DataLoader over the stream), numbered from the pass's start."""
        dataset = getattr(dataloader, "dataset", self.stream)
        if dataset is not self.stream:
            raise ValueError(
                f"dataloader should read this fallback's stream, DataLoader(stream, batch_size=None, "
                f"collate_fn=...), but its dataset is a {type(dataset).__name__}; pass the stream given "
                f"to OOMFallback"
            )
        self.steps_done = _resumed_steps(self.stream)
        self._iterating = True
        try:
            for step, batch in enumerate(dataloader, start=self.steps_done):
                self._step = step
                yield batch
                self.steps_done = max(self.steps_done, self._step + 1)
        finally:
            self._iterating = False


def _resumed_steps(stream: TokenBudgetStream) -> int:
    """The batches a pass resuming from ``load_state_dict`` had yielded already (0 for a fresh one)."""
    state = stream._resume  # what load_state_dict left for the next pass
    run = state["run"] if state is not None and state["epoch"] == stream.epoch else None
    return int(run["yielded"]) if run else 0
