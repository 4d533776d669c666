"""The batches of one epoch for the Trainer's loop, across halve-mode re-plans.

Trainer's loop runs a fixed number of iterations over one DataLoader
iterator and prefetches a gradient-accumulation group of batches ahead.
Neither survives a re-plan: the iterator stops when the sampler's plan
changes, and the prefetched batches came from the old plan. :class:`Feed`
draws the epoch from :class:`~tokenbatch._epoch.EpochBatches` instead (the
re-plan-aware iterator the OOM guard uses too), which numbers every batch
with its step in the epoch's plan and restarts the DataLoader at the first
step not yet trained; the feed swaps a prefetched batch from an outdated plan
for the next batch of the new one when the Trainer hands it back for
training, and counts the steps trained in the sampler's ``position``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch._epoch import EpochBatches
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
    generation: int  # the sampler's plan generation when the batch was drawn


class Feed:
    """This epoch's batches, each with its step in the plan, restartable after a re-plan."""

    def __init__(self, dataloader: Any, sampler: TokenBudgetBatchSampler) -> None:
        self.sampler = sampler
        self.batches: EpochBatches[Any] = EpochBatches(dataloader, sampler)
        self.pending: deque[_Entry] = deque()
        """Batches handed to the Trainer and not yet back in ``training_step``, in order."""

    def next_batch(self) -> tuple[Any, int] | None:
        """The next batch of the current plan and its step, or None at the epoch's end."""
        item = next(self.batches, None)
        return None if item is None else (item[1], item[0])

    def take(self, count: int) -> list[Any]:
        """Up to ``count`` batches (fewer at the end of the epoch)."""
        batches: list[Any] = []
        while len(batches) < count:
            item = self.next_batch()
            if item is None:
                break
            self.pending.append(_Entry(item[0], item[1], self.sampler.position.generation))
            batches.append(item[0])
        return batches

    def pad(self, batches: list[Any], count: int, main_input_name: str) -> list[Any]:
        """``batches`` filled up to ``count`` with padding slots."""
        while len(batches) < count:
            slot = padding(main_input_name)
            self.pending.append(_Entry(slot, None, self.sampler.position.generation))
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
