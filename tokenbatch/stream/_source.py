"""Where a :class:`~tokenbatch.TokenBudgetStream` reads: one reader's part of the examples.

A *reader* is one (rank, DataLoader worker) pair. Its part is read once, in
order; a position counts the examples of the part read so far, and is all a
checkpoint needs to name an example::

    examples:  e0 e1 e2 e3 e4 e5 e6 e7 e8 e9 ...     (2 ranks x 2 workers)
    rank 0, worker 0 reads e0 e4 e8 ...  (positions 0 1 2 ...)
    rank 1, worker 0 reads e1 e5 e9 ...
    rank 0, worker 1 reads e2 e6 ...
    rank 1, worker 1 reads e3 e7 ...

How a part is cut, and how a resume gets back to a position, depends on what
the examples are:

- a sequence (``len`` and ``[i]``: a list, a map-style ``datasets.Dataset``):
  every ``num_replicas * num_workers``-th index; any position is one index away.
- a ``datasets.IterableDataset``: ``datasets.distributed.split_dataset_by_node``
  for the rank, and ``datasets``' own split by DataLoader worker (by shards;
  workers beyond ``num_shards`` read nothing). A resume loads the dataset's
  own ``state_dict``, saved at a position at or before the oldest example
  still buffered, and re-reads from there.
- any other re-iterable (a torch ``IterableDataset``, a function returning an
  iterator): every ``num_replicas * num_workers``-th example; a resume reads
  the part again from its start and skips what was already batched.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from numbers import Integral
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset


@dataclass(frozen=True)
class Reader:
    """Who reads: rank ``rank`` of ``num_replicas``, DataLoader worker ``worker`` of ``num_workers``."""

    rank: int
    num_replicas: int
    worker: int
    num_workers: int


def _is_datasets_iterable(examples: Any) -> bool:
    """True for a ``datasets.IterableDataset`` (without importing datasets when it is not loaded)."""
    cls = type(examples)
    return any(c.__module__.startswith("datasets.") and c.__name__ == "IterableDataset" for c in cls.__mro__)


def kind_of(examples: Any) -> str:
    """``"sequence"``, ``"datasets"`` or ``"iterable"``; raises for what cannot be read more than once."""
    if _is_datasets_iterable(examples):
        return "datasets"
    if isinstance(examples, (str, bytes, Mapping)):
        raise TypeError(
            f"examples should be an iterable of examples (a list, a datasets.IterableDataset, a function "
            f"returning an iterator), but got examples of type {type(examples).__name__}"
        )
    if (
        not isinstance(examples, IterableDataset)
        and hasattr(examples, "__len__")
        and hasattr(examples, "__getitem__")
    ):
        return "sequence"
    if hasattr(examples, "__iter__"):
        if iter(examples) is examples:
            raise TypeError(
                f"examples should be re-iterable (every epoch, DataLoader worker and resume reads it "
                f"again), but got a one-shot iterator of type {type(examples).__name__}; pass a list, "
                f"a datasets.IterableDataset, or a function that returns a new iterator, e.g. "
                f"lambda: read_examples(path)"
            )
        return "iterable"
    if callable(examples):
        return "iterable"
    raise TypeError(
        f"examples should be an iterable of examples or a function returning one, but got examples "
        f"of type {type(examples).__name__}"
    )


class Part:
    """One reader's share of ``examples``: rank ``rank`` of ``num_replicas``, worker ``worker`` of them.

    ``open(start, state)`` returns an iterator over the part from position
    ``start``; ``state`` is what :meth:`snapshot` returned at ``start`` (a
    ``datasets.IterableDataset``), else None.
    """

    def __init__(
        self,
        examples: Any,
        kind: str,
        *,
        rank: int,
        num_replicas: int,
        worker: int,
        num_workers: int,
        epoch: int,
    ) -> None:
        self.examples, self.kind, self.epoch = examples, kind, epoch
        self.offset = rank + num_replicas * worker
        self.stride = num_replicas * num_workers
        self._dataset: Any = None
        if kind == "datasets":
            dataset = examples
            if num_replicas > 1:
                from datasets.distributed import split_dataset_by_node

                dataset = split_dataset_by_node(examples, rank=rank, world_size=num_replicas)
            dataset.set_epoch(epoch)  # a split copy does not keep the epoch of the original
            self._dataset = dataset

    def open(self, start: int, state: Any = None) -> Iterator[Any]:
        if self.kind == "sequence":
            first = self.offset + self.stride * start
            if start == 0:  # iterating is much faster than indexing, for a list and for a datasets.Dataset
                return itertools.islice(iter(self.examples), first, None, self.stride)
            return (self.examples[i] for i in range(first, len(self.examples), self.stride))
        if self.kind == "datasets":
            if state is not None:
                self._dataset.load_state_dict(state)
            elif start:
                raise ValueError(
                    f"a datasets.IterableDataset part needs its saved state to resume at {start}"
                )
            return iter(self._dataset)
        source = self.examples
        if callable(source) and not hasattr(source, "__iter__"):
            source = source()
            if isinstance(source, (str, bytes, Mapping)) or not hasattr(source, "__iter__"):
                raise TypeError(
                    f"examples should be a function that returns a new iterator of examples each call, "
                    f"but examples() returned {_shown(source)} of type {type(source).__name__}; return "
                    f"an iterator, e.g. lambda: iter(rows) or lambda: read_examples(path)"
                )
        return itertools.islice(iter(source), self.offset + self.stride * start, None, self.stride)

    def size(self) -> int:
        """How many examples a sequence part holds."""
        return len(range(self.offset, len(self.examples), self.stride))

    def snapshot(self) -> Any:
        """The source's own state at the position just read (``datasets.IterableDataset``), else None."""
        return self._dataset.state_dict() if self.kind == "datasets" else None

    def fetch(self, positions: list[int]) -> dict[int, Any]:
        """The examples at ``positions`` of a sequence part, by index."""
        return {p: self.examples[self.offset + self.stride * p] for p in positions}


class Snapshots:
    """Source states at past positions, so a resume can re-read from the oldest example still buffered.

    Only a ``datasets.IterableDataset`` has them; one is taken after every
    read. Each :meth:`add` drops those older than the newest one at or before
    the oldest position still buffered (no resume needs them), and where more
    than ``limit`` are left (an example that lingers in the buffer while the
    reads go on), every other one between the first and the newest: a resume
    then re-reads a little more, never less, and memory stays bounded through
    an epoch that is never checkpointed.
    """

    def __init__(self, limit: int = 32) -> None:
        self._states: deque[tuple[int, Any]] = deque()
        self.limit = limit

    def __len__(self) -> int:
        return len(self._states)

    def add(self, position: int, state: Any, *, oldest: int | None = None) -> None:
        """Keep ``state``, the source's state at ``position``; ``oldest``: the oldest position still held."""
        self._states.append((position, state))
        if oldest is not None:
            self.prune(oldest)
        if len(self._states) > self.limit:
            # The first is the one a resume needs now, the newest the one it will need soonest.
            states = list(self._states)
            self._states = deque(states[:1] + states[1:-1][1::2] + states[-1:])

    def prune(self, oldest: int) -> None:
        while len(self._states) > 1 and self._states[1][0] <= oldest:
            self._states.popleft()

    def before(self, oldest: int) -> tuple[int, Any]:
        """The newest (position, state) at or before ``oldest``; (0, None) is the start of the part."""
        self.prune(oldest)
        if self._states and self._states[0][0] <= oldest:
            return self._states[0]
        return 0, None


def length_reader(length: str | Callable[[Any], int]) -> Callable[[list[Any], int], np.ndarray]:
    """A function ``(chunk, first_position) -> lengths`` for the ``length`` option.

    A column name reads ``example[length]``: its ``len()`` (token ids), or
    the value itself when it is an integer (a length column).
    """

    def check(values: list[Any], chunk: list[Any], first: int) -> np.ndarray:
        try:
            array = np.asarray(values)
        except ValueError:  # ragged: some values are sequences; named below
            array = np.empty(0, dtype=object)
        if array.dtype == bool or not np.issubdtype(array.dtype, np.integer) or array.ndim != 1:
            bad = next(
                (i for i, v in enumerate(values) if isinstance(v, bool) or not isinstance(v, Integral)), 0
            )
            raise TypeError(
                f"length should give each example's padded length as an integer, but the example at "
                f"position {first + bad} of this reader's part has length {_shown(values[bad])}; make "
                f"length= give an int, e.g. lambda example: len(example['input_ids'])"
            )
        if array.size and (array.min() < 1 or array.max() >= 2**31):
            i = int(np.flatnonzero((array < 1) | (array >= 2**31))[0])
            raise ValueError(
                f"length should give each example a padded length >= 1 (and below 2**31), but the "
                f"example at position {first + i} of this reader's part has length {values[i]!r}"
            )
        return array.astype(np.int64, copy=False)

    if callable(length):
        function = length

        def by_function(chunk: list[Any], first: int) -> np.ndarray:
            return check([function(example) for example in chunk], chunk, first)

        return by_function

    column = length

    def by_column(chunk: list[Any], first: int) -> np.ndarray:
        try:
            values = [example[column] for example in chunk]
        except (KeyError, TypeError, IndexError):
            bad = next(i for i, ex in enumerate(chunk) if not _has(ex, column))
            example = chunk[bad]
            keys = list(example) if isinstance(example, Mapping) else type(example).__name__
            raise KeyError(
                f"length={column!r} should name a column of every example, but the example at position "
                f"{first + bad} of this reader's part has {keys}; pass length= the column holding the "
                f"token ids, or a function of the example"
            ) from None
        if isinstance(values[0], Integral):
            try:
                return check(values, chunk, first)
            except TypeError:
                both = mixed(values, first)
                if both is None:
                    raise
                raise both from None
        try:
            return check([len(value) for value in values], chunk, first)
        except TypeError:
            both = mixed(values, first)
            if both is not None:
                raise both from None
            bad = next(i for i, v in enumerate(values) if not hasattr(v, "__len__"))
            raise TypeError(
                f"length={column!r} should name a column of token ids (anything with a len()) or of "
                f"lengths, but the example at position {first + bad} of this reader's part has "
                f"{column}={values[bad]!r}"
            ) from None

    def mixed(values: list[Any], first: int) -> TypeError | None:
        """The error for a column of lengths in some examples and token ids in others, if it is one."""
        integer = [isinstance(v, Integral) and not isinstance(v, bool) for v in values]
        sized = [hasattr(v, "__len__") for v in values]
        if any(integer) and any(sized):
            a, b = sorted((integer.index(True), sized.index(True)))
            return TypeError(
                f"length={column!r} should name a column of token ids or of integer lengths, not both, "
                f"but the example at position {first + a} of this reader's part has "
                f"{column}={_shown(values[a])} and the example at position {first + b} has "
                f"{column}={_shown(values[b])}; pass length= a column of one kind, or a function of "
                f"the example"
            )
        return None

    return by_column


def _shown(value: Any) -> str:
    """``repr(value)``, cut short for a long one (a row of token ids)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _has(example: Any, column: str) -> bool:
    try:
        example[column]
    except (KeyError, TypeError, IndexError):
        return False
    return True
