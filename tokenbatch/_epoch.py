"""Where the OOM fallback is in the epoch, and a DataLoader iteration that survives re-plans."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, TypeVar

from tokenbatch.sampler import TokenBudgetBatchSampler

T = TypeVar("T")


class EpochCursor:
    """Counts the steps trained in the epoch and restarts the DataLoader after a re-plan.

    The sampler's own position runs ahead of training (accelerate's
    DataLoader reads a batch ahead, worker processes read several), so the
    steps trained are counted here: a step is done once its backward pass
    succeeded, or once the loop asked for the next batch without one.
    """

    def __init__(self, sampler: TokenBudgetBatchSampler) -> None:
        self.sampler = sampler
        self.epoch = sampler.epoch
        self.steps_done = self.first_step()
        self.restart_pending = False
        self._step = self.steps_done
        self._iterating = False

    def first_step(self) -> int:
        """The step the sampler's next iteration starts at (0, or where a resume or re-plan left it)."""
        return self.sampler.start_step

    def current_step(self) -> int:
        """The step being trained: the batch ``iterate`` last yielded, else the next one."""
        if self._iterating:
            return self._step
        if self.sampler.epoch != self.epoch:  # a new epoch, batches drawn without iterate()
            self.epoch = self.sampler.epoch
            self.steps_done = self.first_step()
        return self.steps_done

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch; after a re-plan, a fresh iterator resumes."""
        self._check_feeds(dataloader)
        self.epoch = self.sampler.epoch
        set_epoch = getattr(dataloader, "set_epoch", None)
        if callable(set_epoch):
            # accelerate's DataLoaderShard passes its own pass count to the sampler's set_epoch
            # when iterated on one process: align it with the sampler, or a run resumed into a
            # later epoch would be sent back to epoch 0.
            set_epoch(self.epoch)
        self.steps_done = step = self.first_step()
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
                        self.steps_done = max(self.steps_done, step)
                finally:
                    close = getattr(iterator, "close", None)
                    if callable(close):
                        close()  # a generator (accelerate's DataLoaderShard) stops reading ahead
                    del iterator  # a DataLoader iterator shuts its workers down when dropped
                    end = getattr(dataloader, "end", None)
                    if self.restart_pending and callable(end) and hasattr(dataloader, "gradient_state"):
                        # accelerate registers a DataLoader with its GradientState until the end of
                        # an iteration, and an abandoned one never gets there: end it here.
                        end()
                if not self.restart_pending:
                    return
                step = self.steps_done
        finally:
            self._iterating = False

    def _check_feeds(self, dataloader: object) -> None:
        """Refuse a DataLoader that the sampler does not feed (re-plans would not reach it)."""
        source: Any = dataloader
        seen: list[str] = []
        while getattr(source, "batch_sampler", None) is not None and len(seen) < 4:
            source = source.batch_sampler  # DataLoader -> accelerate's BatchSamplerShard -> ...
            seen.append(type(source).__name__)
            if source is self.sampler:
                return
        if seen:
            raise ValueError(
                f"dataloader should draw its batches from this fallback's sampler, but its batch "
                f"samplers are {' -> '.join(seen)}; pass DataLoader(dataset, batch_sampler=sampler) "
                f"(prepared by accelerate or not) for the sampler given to OOMFallback"
            )
