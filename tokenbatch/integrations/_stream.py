"""TokenBudgetTrainer over an iterable training set: a :class:`~tokenbatch.TokenBudgetStream` per rank.

An iterable ``train_dataset`` (a ``datasets.IterableDataset``, a torch
``IterableDataset``) has no lengths up front, so it is batched by a stream
rather than planned: each rank reads its own part, and all ranks yield the
same number of batches (the stream's agreement). As for any iterable,
Trainer needs ``max_steps``: epochs have no known length, and it runs epochs
until ``max_steps``. The stream's DataLoader stays out of
``accelerator.prepare`` (see ``docs/streaming.md``); Trainer moves each batch
to the device itself. Out of memory, the guard micro-batches in split mode,
and in halve mode re-budgets the stream (its step is kept, see
:mod:`tokenbatch.oom._stream`), so a pass is never restarted.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset

from tokenbatch import distributed
from tokenbatch.cost import CostModel
from tokenbatch.integrations._feed import Padding, _Entry, padding
from tokenbatch.stream import TokenBudgetStream


def is_iterable(dataset: Any) -> bool:
    """True for a dataset with no ``len`` and no indexing (a torch or ``datasets`` IterableDataset)."""
    return isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    )


def check_max_steps(args: Any) -> None:
    """Raise unless ``TrainingArguments`` ``args`` set ``max_steps``, as Trainer needs for an iterable."""
    if args.max_steps <= 0:
        raise ValueError(
            f"max_steps should be a positive number of optimizer steps with an iterable train_dataset "
            f"(its epochs have no length, so num_train_epochs cannot size the run), but got "
            f"max_steps={args.max_steps}; pass TrainingArguments(max_steps=...)"
        )


def stream_dataloader(
    dataset: Any, max_tokens: float, *, cost: CostModel, length: str, seed: int, oversize: str, options: Any
) -> tuple[DataLoader[Any], TokenBudgetStream]:
    """``DataLoader(stream, batch_size=None, **options)`` over a stream of ``dataset``."""
    stream = TokenBudgetStream(dataset, max_tokens, cost=cost, length=length, seed=seed, oversize=oversize)
    return DataLoader(stream, batch_size=None, **options), stream


class StreamFeed:
    """One pass over the stream's DataLoader, a group of ``accumulation`` slots at a time.

    The interface of :class:`~tokenbatch.integrations._feed.Feed`: the last
    group of an epoch is filled with no-op padding slots so that the optimizer
    steps at the epoch's end on every rank.
    """

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
        while True:
            batches: list[tuple[Any, int]] = []
            while len(batches) < self.accumulation and (item := self.next_batch()) is not None:
                batches.append(item)
            if not batches:
                return
            group = [_Entry(batch, step, 0, len(batches)) for batch, step in batches]
            while len(group) < self.accumulation:
                group.append(_Entry(padding(self.main_input_name), None, 0, len(batches)))
            self.pending.extend(group)
            for entry in group:
                yield entry.batch

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
        values = entry.batch.values() if isinstance(entry.batch, Mapping) else [entry.batch]
        first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
        self._rows = 0 if first is None else int(first.shape[0])
        return entry.batch, entry.step

    def mark_trained(self, step: int) -> int:
        """The samples of the batch just trained, over all ranks (one small all-reduce on several)."""
        return int(distributed.all_reduce_sum(torch.tensor([float(self._rows)]))[0])

    def restart(self) -> None:
        """Never needed: a stream's step is not dropped (see :mod:`tokenbatch.oom._stream`)."""

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
