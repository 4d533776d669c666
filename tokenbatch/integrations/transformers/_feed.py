"""What Trainer iterates as its training DataLoader: one epoch of the plan per pass, in full groups.

Trainer's loop (every transformers version) calls ``set_epoch(epoch)`` on
its training DataLoader, iterates it, takes ``gradient_accumulation_steps``
batches at a time ahead of training them (one optimizer step per group), and
runs a count of groups it fixes from ``len(dataloader)`` (or ``max_steps``
when the loader has no length). A token-budget epoch has its own number of
batches, and a halve-mode re-plan changes it mid-epoch. :class:`BudgetLoader`
is what ``get_train_dataloader`` returns instead of the DataLoader:

- its length (:class:`SizedBudgetLoader`, epoch-based runs) is a bound no
  epoch reaches, and the run's callback ends each epoch when the plan is
  trained (``control.should_epoch_stop``); with ``max_steps`` it has no
  length, so Trainer runs epochs until ``max_steps``, as for an iterable dataset;
- ``set_epoch(e)`` starts sampler epoch ``first + e`` (``first``: where a
  resumed run starts; Trainer counts the epochs of this ``train()`` call from 0);
- a pass is a :class:`Feed`: the epoch's batches, a group at a time, the
  last group filled with no-op :class:`Padding` slots so that the optimizer
  steps at the epoch's end. The feed is this loop's count of the steps
  trained (what a checkpoint records). The OOM guard follows its batches and
  restarts them after a re-plan; a batch read ahead from the replaced plan is
  swapped for the next batch of the new plan when Trainer hands it back.

An iterable train set gets a :class:`StreamLoader`: a pass over the stream's
DataLoader in the same groups, never restarted (a stream forms its later
batches under a new budget itself).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tokenbatch import _distributed as distributed
from tokenbatch._packs import packed_examples
from tokenbatch.oom import OOMFallback
from tokenbatch.oom._guard import _Batches
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream


class Padding(dict[str, Any]):
    """A no-op slot that fills the last gradient-accumulation group of an epoch.

    Its empty tensors count zero tokens, zero FLOPs and zero labelled items in
    Trainer's bookkeeping; ``training_step`` trains nothing for it.
    """


def padding(main_input_name: str) -> Padding:
    """A padding slot; ``main_input_name`` is the model's (its empty tensor counts for FLOPs)."""
    empty = torch.zeros((0, 0), dtype=torch.long)
    return Padding({main_input_name: empty, "attention_mask": empty, "labels": empty})


@dataclass
class _Entry:
    batch: Any
    step: int | None  # None: a padding slot
    restarts: int  # the pass's restarts when the batch was drawn
    group_size: int  # the real batches of its group


class Feed:
    """One pass: the epoch's batches in groups, each with its step in the plan."""

    def __init__(
        self, dataloader: Any, loader: BudgetLoader, *, accumulation: int, main_input_name: str
    ) -> None:
        self.loader = loader
        self.sampler = loader.sampler
        self.accumulation = accumulation
        self.main_input_name = main_input_name
        self.batches: _Batches[Any] = _Batches(dataloader, self.sampler)
        self.pending: deque[_Entry] = deque()
        """Slots handed to Trainer and not yet back in ``training_step``, in order."""
        self.group_size = 1
        """The real batches of the group of the slot last resolved (Trainer's loss divisor)."""

    @property
    def restarts(self) -> int:
        """How many times a re-plan restarted this pass."""
        return self.batches.restarts

    def follow(self, fallback: OOMFallback) -> None:
        """Let ``fallback`` count this pass's steps and restart it after a re-plan."""
        fallback._follow(self.batches, steps_done=self.loader.trained)

    def slots(self) -> Iterator[Any]:
        """The epoch in groups of ``accumulation`` slots; the last group is filled with padding."""
        return _slots(self)

    def next_batch(self) -> tuple[Any, int] | None:
        """The next batch of the current plan and its step, or None at the epoch's end."""
        item = next(self.batches, None)
        return None if item is None else (item[1], item[0])

    def resolve(self, inputs: Any) -> tuple[Any, int | None] | None:
        """What to train for ``inputs``: ``(batch, step)``, or None for a padding slot or the epoch's end.

        A batch read ahead from a plan that has since changed is replaced by
        the next batch of the current plan. Inputs this feed did not hand out
        are trained as they are, with no step.
        """
        if not self.pending or self.pending[0].batch is not inputs:
            return None if isinstance(inputs, Padding) else (inputs, None)
        entry = self.pending.popleft()
        self.group_size = entry.group_size
        if entry.restarts != self.batches.restarts:
            return self.next_batch()
        return None if entry.step is None else (entry.batch, entry.step)

    def mark_trained(self, step: int) -> int:
        """Count step ``step`` as trained; returns its samples over all ranks."""
        self.loader.mark_trained(step)
        plan = self.sampler.plan
        return int(plan.offsets[plan.step_start(step + 1)] - plan.offsets[plan.step_start(step)])

    def remaining_after_pending(self) -> int:
        """Batches of the current plan left once the slots already handed out are filled."""
        return max(0, self.sampler.plan.num_steps - self.batches.next_step - len(self.pending))

    def close(self) -> None:
        """Stop the DataLoader iterator (and unregister it from accelerate's gradient state)."""
        self.batches.close()


class BudgetLoader:
    """The training "DataLoader" Trainer sees: a :class:`Feed` per pass, started by ``set_epoch``.

    ``dataloader`` is the prepared DataLoader over the sampler. A pass that
    no ``set_epoch`` started (Trainer always calls it first) yields nothing,
    so that a stray pass cannot move the sampler past a resumed position.
    """

    def __init__(
        self, dataloader: Any, sampler: TokenBudgetBatchSampler, *, accumulation: int, main_input_name: str
    ) -> None:
        self.dataloader = dataloader
        self.dataset = dataloader.dataset  # Trainer counts the examples from it
        self.sampler = sampler
        self.first_epoch = sampler.epoch
        self.accumulation = accumulation
        self.main_input_name = main_input_name
        self.feed: Feed | None = None
        """The running pass (None between epochs)."""
        self._armed = False
        self._trained = (sampler.epoch, sampler.start_step)

    @property
    def trained(self) -> int:
        """Steps of the sampler's current epoch trained: what a checkpoint records."""
        epoch, steps = self._trained
        return steps if epoch == self.sampler.epoch else self.sampler.start_step

    def mark_trained(self, step: int) -> None:
        self._trained = (self.sampler.epoch, max(self.trained, step + 1))

    def set_epoch(self, epoch: int) -> None:
        """Trainer's ``epoch``-th epoch of this ``train()`` call: the sampler's ``first_epoch + epoch``."""
        self.sampler.set_epoch(self.first_epoch + epoch)
        self._armed = True

    def __iter__(self) -> Iterator[Any]:
        self.close()
        if not self._armed:
            return iter(())
        self._armed = False
        self._trained = (self.sampler.epoch, self.sampler.start_step)
        options: dict[str, Any] = {"accumulation": self.accumulation, "main_input_name": self.main_input_name}
        self.feed = Feed(self.dataloader, self, **options)
        return self.feed.slots()

    def close(self) -> None:
        """End the running pass, if any."""
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.close()


class SizedBudgetLoader(BudgetLoader):
    """A :class:`BudgetLoader` of length ``bound``: Trainer's count of batches per epoch, never reached."""

    def __init__(
        self, dataloader: Any, sampler: TokenBudgetBatchSampler, *, bound: int, **options: Any
    ) -> None:
        super().__init__(dataloader, sampler, **options)
        self.bound = bound

    def __len__(self) -> int:
        return self.bound


class StreamFeed:
    """One pass over a stream's DataLoader, a group of ``accumulation`` slots at a time.

    The interface of :class:`Feed`; a stream's pass is never restarted.
    """

    restarts = 0

    def __init__(
        self, dataloader: Any, stream: TokenBudgetStream, *, accumulation: int, main_input_name: str
    ) -> None:
        self.sampler = stream
        self.accumulation, self.main_input_name = accumulation, main_input_name
        self._iterator: Iterator[Any] | None = iter(dataloader)
        self._step = 0
        self.pending: deque[_Entry] = deque()
        self.group_size = 1
        self._rows = 0  # rows of the batch resolved last

    def slots(self) -> Iterator[Any]:
        return _slots(self)

    def next_batch(self) -> tuple[Any, int] | None:
        batch = None if self._iterator is None else next(self._iterator, None)
        if batch is None:
            self._iterator = None
            return None
        self._step += 1
        return batch, self._step - 1

    def resolve(self, inputs: Any) -> tuple[Any, int | None] | None:
        """``(batch, step)`` for ``inputs``; None for a padding slot."""
        if not self.pending or self.pending[0].batch is not inputs:
            return None if isinstance(inputs, Padding) else (inputs, None)
        entry = self.pending.popleft()
        self.group_size = entry.group_size
        if entry.step is None:
            return None
        pack = packed_examples(entry.batch)  # a pack's samples are its examples, not its one row
        values = entry.batch.values() if isinstance(entry.batch, Mapping) else [entry.batch]
        first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        self._rows = len(pack.lengths) if pack is not None else 0 if first is None else int(first.shape[0])
        return entry.batch, entry.step

    def mark_trained(self, step: int) -> int:
        """The samples of the batch just trained, over all ranks (one small all-reduce on several)."""
        return int(distributed.all_reduce_sum(torch.tensor([float(self._rows)]))[0])

    def remaining_after_pending(self) -> int:
        return 0

    def close(self) -> None:
        self._iterator = None  # a DataLoader iterator shuts its workers down when dropped


class StreamLoader:
    """The training "DataLoader" Trainer sees over a stream: a :class:`StreamFeed` per epoch, no length."""

    def __init__(
        self, dataloader: Any, stream: TokenBudgetStream, *, accumulation: int, main_input_name: str
    ) -> None:
        self.dataloader = dataloader
        self.dataset = stream
        self.sampler = stream
        self.first_epoch = stream.epoch
        self.options = {"accumulation": accumulation, "main_input_name": main_input_name}
        self.feed: StreamFeed | None = None

    def set_epoch(self, epoch: int) -> None:
        """Trainer's ``epoch``-th pass: the stream's epoch ``first_epoch + epoch`` (a new order)."""
        self.sampler.set_epoch(self.first_epoch + epoch)

    def __iter__(self) -> Iterator[Any]:
        self.close()
        self.feed = StreamFeed(self.dataloader, self.sampler, **self.options)  # type: ignore[arg-type]
        return self.feed.slots()

    def close(self) -> None:
        feed, self.feed = self.feed, None
        if feed is not None:
            feed.close()


def _slots(feed: Feed | StreamFeed) -> Iterator[Any]:
    """``feed``'s batches in groups of ``accumulation`` slots, the last group filled with padding."""
    while True:
        batches: list[tuple[Any, int]] = []
        while len(batches) < feed.accumulation and (item := feed.next_batch()) is not None:
            batches.append(item)
        if not batches:
            return
        restarts = feed.restarts
        group = [_Entry(batch, step, restarts, len(batches)) for batch, step in batches]
        while len(group) < feed.accumulation:
            group.append(_Entry(padding(feed.main_input_name), None, restarts, len(batches)))
        feed.pending.extend(group)
        for entry in group:
            yield entry.batch
