"""What Trainer iterates as its training DataLoader: one epoch of the sampler's plan per pass, in full groups.

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
- a pass is a :class:`Feed`: the epoch's batches drawn from
  :class:`~tokenbatch._epoch.EpochBatches` (the re-plan-aware iterator the
  OOM guard uses too), a group at a time, the last group filled with no-op
  :class:`Padding` slots so that the optimizer steps at the epoch's end; a
  batch prefetched from a plan that has since changed is swapped for the
  next batch of the new plan when Trainer hands it to ``training_step``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch._epoch import EpochBatches
from tokenbatch.sampler import TokenBudgetBatchSampler


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
    generation: int  # the sampler's plan generation when the batch was drawn
    group_size: int  # the real batches of its group


class Feed:
    """One pass: the epoch's batches in groups, each with its step in the plan, restarted by a re-plan."""

    def __init__(
        self, dataloader: Any, sampler: TokenBudgetBatchSampler, *, accumulation: int, main_input_name: str
    ) -> None:
        self.sampler = sampler
        self.accumulation = accumulation
        self.main_input_name = main_input_name
        self.batches: EpochBatches[Any] = EpochBatches(dataloader, sampler)
        self.pending: deque[_Entry] = deque()
        """Slots handed to Trainer and not yet back in ``training_step``, in order."""
        self.group_size = 1
        """The real batches of the group of the slot last resolved (Trainer's loss divisor)."""

    def slots(self) -> Iterator[Any]:
        """The epoch in groups of ``accumulation`` slots; the last group is filled with padding."""
        while True:
            batches: list[tuple[Any, int]] = []
            while len(batches) < self.accumulation and (item := self.next_batch()) is not None:
                batches.append(item)
            if not batches:
                return
            generation = self.sampler.position.generation
            group = [_Entry(batch, step, generation, len(batches)) for batch, step in batches]
            while len(group) < self.accumulation:
                group.append(_Entry(padding(self.main_input_name), None, generation, len(batches)))
            self.pending.extend(group)
            for entry in group:
                yield entry.batch

    def next_batch(self) -> tuple[Any, int] | None:
        """The next batch of the current plan and its step, or None at the epoch's end."""
        item = next(self.batches, None)
        return None if item is None else (item[1], item[0])

    def resolve(self, inputs: Any) -> tuple[Any, int | None] | None:
        """What to train for ``inputs``: ``(batch, step)``, or None for a padding slot or the epoch's end.

        A batch prefetched from a plan that has since changed is replaced by
        the next batch of the current plan. Inputs this feed did not hand out
        are trained as they are, with no step.
        """
        if not self.pending or self.pending[0].batch is not inputs:
            return None if isinstance(inputs, Padding) else (inputs, None)
        entry = self.pending.popleft()
        self.group_size = entry.group_size
        if entry.generation != self.sampler.position.generation:
            return self.next_batch()
        return None if entry.step is None else (entry.batch, entry.step)

    def mark_trained(self, step: int) -> int:
        """Count step ``step`` as trained; returns its samples over all ranks."""
        self.sampler.position.trained = step + 1
        plan = self.sampler.plan
        return int(plan.offsets[plan.step_start(step + 1)] - plan.offsets[plan.step_start(step)])

    def restart(self) -> None:
        """After a re-plan: continue at the step the sampler's next iteration starts at."""
        self.batches.restart()

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

    def set_epoch(self, epoch: int) -> None:
        """Trainer's ``epoch``-th epoch of this ``train()`` call: the sampler's ``first_epoch + epoch``."""
        self.sampler.set_epoch(self.first_epoch + epoch)
        self._armed = True

    def __iter__(self) -> Iterator[Any]:
        self.close()
        if not self._armed:
            return iter(())
        self._armed = False
        options: dict[str, Any] = {"accumulation": self.accumulation, "main_input_name": self.main_input_name}
        self.feed = Feed(self.dataloader, self.sampler, **options)
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


# -- predictions back in dataset order ---------------------------------------------


def reorder(value: Any, index: np.ndarray, count: int) -> Any:
    """``value[index]`` for every array of ``count`` rows in a (nested) prediction output."""
    if isinstance(value, np.ndarray | torch.Tensor) and value.ndim > 0 and len(value) == count:
        return value[index]
    if isinstance(value, tuple | list):
        return type(value)(reorder(v, index, count) for v in value)
    if isinstance(value, Mapping):
        return {k: reorder(v, index, count) for k, v in value.items()}
    return value


def inverse_order(order: Sequence[int] | np.ndarray) -> np.ndarray:
    """Where each sample sits in ``order``: ``output[inverse_order(order)]`` is in dataset order."""
    order = np.asarray(order)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse
