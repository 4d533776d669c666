"""One epoch's batches from a DataLoader the sampler feeds, numbered by step and restartable after a re-plan.

Where the epoch is lives in one place, the sampler's
:class:`~tokenbatch._state.EpochPosition`. This module only walks a
DataLoader over it: :class:`EpochBatches` is the one re-plan-aware iterator
(used by the OOM guard through :class:`EpochCursor` and by the Trainer's
feed), and it is the one place that aligns accelerate's epoch count and
shuts an abandoned DataLoader iterator down.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator
from typing import Any, Generic, TypeVar

from tokenbatch import distributed
from tokenbatch._reader import unsharded_error
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.oom")

T = TypeVar("T")


class EpochBatches(Generic[T]):
    """``(step, batch)`` for the rest of the sampler's epoch; :meth:`restart` after a re-plan.

    The DataLoader is iterated lazily, from the sampler's ``start_step``.
    After a re-plan, :meth:`restart` closes the DataLoader iterator (and the
    batches it read ahead from the old plan); the next batch is then the new
    plan's first step not yet trained.
    """

    def __init__(self, dataloader: Iterable[T], sampler: TokenBudgetBatchSampler) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.next_step = sampler.start_step
        """The step of the next batch this iterator gives."""
        self._iterator: Iterator[T] | None = None
        self._exhausted = False

    def __iter__(self) -> EpochBatches[T]:
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
            self.sampler.position.managed = True
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
        """After a re-plan: continue at the step the sampler's next iteration starts at."""
        self.close()
        self.next_step = self.sampler.start_step
        self._exhausted = False

    def close(self) -> None:
        """Stop an unfinished DataLoader iterator (and unregister it from accelerate's gradient state)."""
        self.sampler.position.managed = False
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


class EpochCursor:
    """The OOM guard's view of the epoch: the step being trained; the DataLoader restarted after a re-plan.

    The steps trained are the sampler's ``position.trained`` (the sampler's
    own count of steps handed out runs ahead of training: accelerate's
    DataLoader reads a batch ahead, worker processes read several). A step
    is trained once its backward pass succeeded, or once the loop asked
    ``iterate`` for the next batch without one.
    """

    def __init__(self, sampler: TokenBudgetBatchSampler) -> None:
        self.sampler = sampler
        self.restart_pending = False
        """After a re-plan: the running ``iterate`` must start the DataLoader afresh."""
        self._step = 0
        self._iterating = False
        self._replanned = (-1, 0, 0)  # the last re-plan: the plan's generation, its epoch and step

    @property
    def steps_done(self) -> int:
        """Steps trained in this epoch (the sampler's ``position.trained``)."""
        return self.sampler.position.trained

    @steps_done.setter
    def steps_done(self, steps: int) -> None:
        self.sampler.position.trained = steps

    def first_step(self) -> int:
        """The step the sampler's next iteration starts at (0, or where a resume or re-plan left it)."""
        return self.sampler.start_step

    def current_step(self) -> int:
        """The step being trained: the batch ``iterate`` last yielded, else the next one."""
        return self._step if self._iterating else self.steps_done

    def replanned(self) -> None:
        """After a halve-mode re-plan: the rest of the epoch is for a new pass over the DataLoader.

        ``iterate`` (and the Trainer) start one. A loop of your own gets the
        new plan from its running pass where that pass can give it (see
        ``TokenBudgetBatchSampler.replan``); :meth:`unfed` refuses a batch of
        the old plan, and a pass that had already finished is warned about.
        """
        position = self.sampler.position
        if position.start >= self.sampler.plan.num_steps:
            return  # re-planned after the epoch's last step: nothing left to start a pass for
        self.restart_pending = True
        self._replanned = (position.generation, self.sampler.epoch, position.start)
        finished = position.finished and position.served == position.generation - 1  # the plan replaced
        if finished and not position.managed and distributed.rank() == 0:
            logger.warning(
                "epoch %d was re-planned from step %d, but the DataLoader had already read the whole old "
                "plan (it reads ahead): only a new pass over it trains the re-planned steps. "
                "OOMFallback.iterate(train_dataloader) starts one; a loop over the DataLoader itself must "
                "start one now (for batch in train_dataloader: ...), or those samples are not trained",
                self.sampler.epoch,
                position.start,
            )

    def unfed(self) -> Exception | None:
        """Outside ``iterate``, after a re-plan: the error to raise for a batch that is not the new plan's."""
        position = self.sampler.position
        if not self.restart_pending or position.managed:
            return None
        generation, epoch, step = self._replanned
        if position.served == generation:  # a pass over the new plan gave it: a new one, or the old one
            self.restart_pending = False
            return None
        return RuntimeError(
            f"epoch {epoch} was re-planned from step {step} after running out of memory (halve mode), "
            f"but this batch is not from the new plan: the DataLoader read it ahead of the re-plan (or "
            f"this is another epoch), and training on would repeat some samples and never train others; "
            f"iterate with `for batch in fallback.iterate(train_dataloader)`, which starts the DataLoader "
            f"afresh after a re-plan (or, in a loop of your own, start a new pass over the DataLoader "
            f"when backward() returns None)"
        )

    def iterate(self, dataloader: Iterable[T]) -> Iterator[T]:
        """The batches of ``dataloader`` for this epoch; after a re-plan, a fresh iterator resumes."""
        self._check_feeds(dataloader)
        batches = EpochBatches(dataloader, self.sampler)
        self.steps_done = batches.next_step
        self.restart_pending = False
        self._iterating = True
        try:
            for self._step, batch in batches:
                yield batch
                if self.restart_pending:
                    self.restart_pending = False
                    batches.restart()
                else:  # the loop asked for the next batch: this one is done
                    self.steps_done = max(self.steps_done, self._step + 1)
        finally:
            self._iterating = False
            batches.close()

    def _check_feeds(self, dataloader: object) -> None:
        """Refuse a DataLoader that the sampler does not feed (re-plans would not reach it).

        Also one that reads the global plan as it is on several processes:
        every rank would train every sample.
        """
        source: Any = dataloader
        seen: list[str] = []
        while getattr(source, "batch_sampler", None) is not None and len(seen) < 4:
            source = source.batch_sampler  # DataLoader -> accelerate's BatchSamplerShard -> ...
            seen.append(type(source).__name__)
            skip = getattr(source, "skip_batches", 0)
            if isinstance(skip, int) and skip > 0:
                # accelerate's skip_first_batches: the steps would be numbered from the wrong one.
                raise ValueError(
                    f"dataloader should not skip batches under OOMFallback, but it comes from "
                    f"skip_first_batches(..., {skip}): the sampler resumes by itself at the first step "
                    f"not yet trained. Register the sampler for checkpointing (or use its state_dict) and "
                    f"iterate the prepared DataLoader itself after accelerator.load_state"
                )
            if source is self.sampler:
                world = distributed.world_size()
                if len(seen) == 1 and self.sampler.rank is None and world > 1:
                    raise unsharded_error(world)
                return
        if seen:
            raise ValueError(
                f"dataloader should draw its batches from this fallback's sampler, but its batch "
                f"samplers are {' -> '.join(seen)}; pass DataLoader(dataset, batch_sampler=sampler) "
                f"(prepared by accelerate or not) for the sampler given to OOMFallback"
            )
