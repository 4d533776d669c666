"""The batches of one epoch for the Trainer's loop, across halve-mode re-plans.

Trainer's loop runs a fixed number of iterations over one DataLoader
iterator and prefetches a gradient-accumulation group of batches ahead.
Neither survives a re-plan: the iterator stops when the sampler's plan
changes, and the prefetched batches came from the old plan. :class:`Feed`
owns the DataLoader iterator instead, numbers every batch with its step in
the epoch's plan, restarts the DataLoader at the first step not yet trained,
and swaps a prefetched batch from an outdated plan for the next batch of the
new one when the Trainer hands it back for training.
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch.sampler import TokenBudgetBatchSampler


class Padding(dict[str, Any]):
    """A no-op slot that fills the last gradient-accumulation group of an epoch.

    Its empty tensors count zero tokens and zero FLOPs in the Trainer's bookkeeping.
    """


def padding(main_input_name: str) -> Padding:
    """A padding slot; ``main_input_name`` is the model's (its empty tensor counts for FLOPs)."""
    empty = torch.zeros((0, 0), dtype=torch.long)
    return Padding({main_input_name: empty, "attention_mask": empty})


@dataclass
class _Entry:
    batch: Any
    step: int | None  # None: a padding slot
    generation: int


class Feed:
    """This epoch's batches, each with its step in the plan, restartable after a re-plan."""

    def __init__(self, dataloader: Any, sampler: TokenBudgetBatchSampler) -> None:
        self.dataloader = dataloader
        self.sampler = sampler
        self.generation = 0
        self.next_step = sampler.start_step
        """The step of the next batch the DataLoader will give."""
        self.pending: deque[_Entry] = deque()
        """Batches handed to the Trainer and not yet back in ``training_step``, in order."""
        self._iterator: Iterator[Any] | None = None
        self._exhausted = False

    def _pull(self) -> tuple[Any, int] | None:
        if self._exhausted:
            return None
        if self._iterator is None:
            # accelerate's DataLoaderShard sets the sampler's epoch from its own count of full passes
            # when iterated; after a restart that count may be one ahead of the epoch.
            set_epoch = getattr(self.dataloader, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(self.sampler.epoch)
            self._iterator = iter(self.dataloader)
        try:
            batch = next(self._iterator)
        except StopIteration:
            self._iterator = None
            self._exhausted = True
            return None
        step = self.next_step
        self.next_step += 1
        return batch, step

    def take(self, count: int) -> list[Any]:
        """Up to ``count`` batches (fewer at the end of the epoch)."""
        batches: list[Any] = []
        while len(batches) < count:
            item = self._pull()
            if item is None:
                break
            self.pending.append(_Entry(item[0], item[1], self.generation))
            batches.append(item[0])
        return batches

    def pad(self, batches: list[Any], count: int, main_input_name: str) -> list[Any]:
        """``batches`` filled up to ``count`` with padding slots."""
        while len(batches) < count:
            slot = padding(main_input_name)
            self.pending.append(_Entry(slot, None, self.generation))
            batches.append(slot)
        return batches

    def resolve(self, inputs: Any) -> tuple[Any, int | None] | None:
        """What to train for ``inputs``: ``(batch, step)``, or None for a padding slot or the epoch's end.

        A batch prefetched from a plan that has since changed is replaced by
        the next batch of the current plan. Inputs this feed did not hand out
        are trained as they are, with no step.
        """
        if not self.pending or self.pending[0].batch is not inputs:
            return None if isinstance(inputs, Padding) else (inputs, None)
        entry = self.pending.popleft()
        if entry.generation != self.generation:
            return self._pull()
        return None if entry.step is None else (entry.batch, entry.step)

    def restart(self) -> None:
        """After a re-plan: continue at the step the sampler's next iteration starts at."""
        self.close()
        self.generation += 1
        self.next_step = self.sampler.start_step
        self._exhausted = False

    def next_batch(self) -> tuple[Any, int] | None:
        return self._pull()

    def remaining_after_pending(self) -> int:
        """Batches of the current plan left once the slots already handed out are filled."""
        return max(0, self.sampler.plan.num_steps - self.next_step - len(self.pending))

    def global_samples(self, step: int) -> int:
        """Samples in global step ``step`` of the current plan, over all ranks."""
        plan = self.sampler.plan
        world = plan.num_replicas
        return int(plan.offsets[(step + 1) * world] - plan.offsets[step * world])

    def close(self) -> None:
        """Stop the DataLoader iterator (and unregister it from accelerate's gradient state)."""
        iterator, self._iterator = self._iterator, None
        if iterator is None:
            return
        close = getattr(iterator, "close", None)
        if callable(close):
            close()
        end = getattr(self.dataloader, "end", None)  # what DataLoaderShard does when it finishes
        if callable(end):
            with contextlib.suppress(ValueError):  # it had already ended
                end()


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
