"""``TokenBudgetStream``: batches that fit a token budget, from a stream of examples.

The object users hold and checkpoint; a pass over the examples is a
:class:`~tokenbatch.stream._run.Run` of this process's reader.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from numbers import Integral
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.plan import OVERSIZE_POLICIES
from tokenbatch.stream._run import Agree, Run, Settings, default_agreement
from tokenbatch.stream._source import Part, Reader, kind_of, length_reader

_STATE_VERSION = 2  # 2: the budget in force (an OOM re-budget) is saved as "max_tokens"
_STATE_KEYS = {"version", "settings", "max_tokens", "epoch", "reader", "run"}


class TokenBudgetStream(IterableDataset[list[Any]]):
    """Batches of similar-length examples from any iterable, each within a memory budget.

    Use it as ``DataLoader(stream, batch_size=None, collate_fn=collator)``:
    it yields lists of examples whose padded cost ``cost(len(batch), longest)``
    stays within ``max_tokens``. Each reader (a rank, or a DataLoader worker
    of it) keeps ``buffer_size`` examples in length order; once full, it
    draws a batch of neighbouring lengths from a random bucket and reads as
    many examples as it took. When the examples run out, what is left is
    packed in as few batches as fit. Buckets' boundaries are estimated from
    the first ``buffer_size`` examples to hold equal cost, or given.

    With a packed ``cost`` (``CostModel(packing="varlen")`` or ``"full"``) each
    batch is a pack of whole examples for one row (``DataCollatorWithFlattening``)
    whose ``cost.batch_cost`` stays within ``max_tokens``: a full buffer is
    packed at once, as the map-style sampler packs an epoch, its full packs
    yielded before it is read again, its least full packs packed again with
    the examples read next.

    On several ranks each rank reads its own part (every ``num_replicas``-th
    example, or ``split_dataset_by_node`` of a ``datasets.IterableDataset``),
    draws from the same bucket as the others at each step, and every rank
    yields the same number of batches: one small all-reduce per batch tells
    the ranks when to finish with a final round of equal size. On several
    ranks read the stream in the main process (``num_workers=0``) and keep
    its DataLoader out of ``accelerator.prepare``; ``docs/streaming.md``
    has the recipes, the guarantees of a resume and their limits.

    Args:
        examples: a list or other sequence, a ``datasets.IterableDataset``, a
            torch ``IterableDataset``, or a function returning a new iterator
            each call. It is read again every epoch and on a resume, in the
            same order.
        max_tokens: the budget for one batch, in ``cost`` units.
        cost: the memory estimate; ``CostModel()`` counts padded tokens; with
            ``packing``, batches are packs.
        length: an example's padded length: a column whose ``len()`` it is
            (token ids), an integer column, or a function of the example.
        buffer_size: examples each reader holds; more means less padding and
            more shuffling, and more memory.
        seed: the seed; every rank must use the same one.
        num_replicas: the world size; defaults to ``torch.distributed``'s or
            ``$WORLD_SIZE``, read when iteration starts.
        rank: this process's rank, read likewise when None.
        oversize: an example that alone exceeds the budget raises
            (``"error"``), is left out, counted and logged (``"skip"``), or
            gets a batch of its own (``"alone"``).
        buckets: how many length buckets to estimate, or their boundaries
            (increasing padded lengths; bucket ``i`` holds ``[b[i-1], b[i])``).
        agree: the element-wise maximum of a list of floats over the ranks;
            defaults to an all-reduce over ``torch.distributed``. For tests
            and launchers of their own.

    Example:
        >>> examples = [{"input_ids": [0] * n} for n in (5, 3, 8, 2, 7, 4)]
        >>> stream = TokenBudgetStream(examples, max_tokens=16, buffer_size=4)
        >>> batches = list(stream)
        >>> sorted(len(e["input_ids"]) for batch in batches for e in batch)
        [2, 3, 4, 5, 7, 8]
        >>> all(len(b) * max(len(e["input_ids"]) for e in b) <= 16 for b in batches)
        True
    """

    def __init__(
        self,
        examples: Any,
        max_tokens: float,
        *,
        cost: CostModel | None = None,
        length: str | Callable[[Any], int] = "input_ids",
        buffer_size: int = 10_000,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        oversize: str = "error",
        buckets: int | Sequence[int] = 16,
        agree: Agree | None = None,
    ) -> None:
        self._kind = kind_of(examples)
        self.examples = examples
        self._made_with = _checks.positive_number("max_tokens", max_tokens)
        # The budget in force, shared with DataLoader workers like the epoch: replan() reaches them.
        self._budget = torch.tensor(self._made_with, dtype=torch.float64).share_memory_()  # type: ignore[no-untyped-call]
        self._ceiling = self._made_with  # the largest budget in force since made or loaded
        self.cost = CostModel() if cost is None else cost
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        if not (isinstance(length, str) or callable(length)):
            raise TypeError(
                f"length should be a column name or a function of the example, but got length={length!r}"
            )
        self.length = length
        self.buffer_size = _checks.positive_int("buffer_size", buffer_size)
        self.seed = _checks.non_negative_int("seed", seed)
        self._num_replicas = (
            None if num_replicas is None else _checks.positive_int("num_replicas", num_replicas)
        )
        self._rank = None if rank is None else _checks.non_negative_int("rank", rank)
        if self._rank is not None and self._num_replicas is not None and self._rank >= self._num_replicas:
            raise ValueError(
                f"rank should be below num_replicas={self._num_replicas}, but got rank={self._rank}; "
                f"ranks count from 0"
            )
        self.oversize = _checks.one_of("oversize", oversize, OVERSIZE_POLICIES)
        self.buckets = _buckets(buckets)
        if agree is not None and not callable(agree):
            raise TypeError(f"agree should be a function of a list of floats, but got agree={agree!r}")
        self.agree = agree
        # Shared memory, like datasets' epoch: persistent DataLoader workers see set_epoch too.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()  # type: ignore[no-untyped-call]
        self._run: Run | None = None
        self._resume: dict[str, Any] | None = None

    @property
    def num_replicas(self) -> int:
        return self._num_replicas if self._num_replicas is not None else distributed.world_size()

    @property
    def rank(self) -> int:
        return self._rank if self._rank is not None else distributed.rank()

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    @property
    def max_tokens(self) -> float:
        """The budget batches are formed under now: ``max_tokens``, or what :meth:`replan` set."""
        return float(self._budget)

    @property
    def ceiling(self) -> float:
        """The largest budget in force since made or loaded: what a batch read ahead may cost."""
        return self._ceiling

    def replan(self, max_tokens: float, *, steps_done: int | None = None) -> None:
        """Form every batch not yet formed under ``max_tokens``, the examples buffered included.

        The OOM fallback calls it in halve mode, on every rank with the same
        value. Each reader (DataLoader workers too: the budget is in shared
        memory) uses it from the next batch it forms; batches already formed
        (read ahead, or the final round's) stay, and the fallback trains them in
        micro-batches. The ranks still yield equal counts: their agreement does
        not depend on the budget. ``steps_done`` is the sampler's signature's.
        """
        self._budget.fill_(_checks.positive_number("max_tokens", max_tokens))
        self._ceiling = max(self._ceiling, self.max_tokens)

    def set_epoch(self, epoch: int) -> None:
        """Read epoch ``epoch`` next: a new order, from ``(seed, epoch)``. Call it before each epoch."""
        self._epoch.fill_(_checks.non_negative_int("epoch", epoch))
        if hasattr(self.examples, "set_epoch"):
            self.examples.set_epoch(self.epoch)

    def __iter__(self) -> Iterator[list[Any]]:
        reader = self._reader()
        agree = self.agree
        if reader.num_replicas == 1:
            agree = None  # one rank has no one to agree with
        elif agree is None:
            in_worker = reader.num_workers > 1 or get_worker_info() is not None
            agree = default_agreement(reader, stream=self, in_worker=in_worker)
        resume = self._take_resume(reader)
        settings = Settings(
            self.cost,
            self._made_with,
            self.buffer_size,
            self.oversize,
            self.buckets,
            self.seed,
            length_reader(self.length),
        )
        part = Part(
            self.examples,
            self._kind,
            rank=reader.rank,
            num_replicas=reader.num_replicas,
            worker=reader.worker,
            num_workers=reader.num_workers,
            epoch=self.epoch,
        )
        budget = self._budget
        run = self._run = Run(
            settings, part, reader, epoch=self.epoch, agree=agree, resume=resume, budget=lambda: float(budget)
        )
        yield from run.batches()

    def _reader(self) -> Reader:
        world, rank = self.num_replicas, self.rank
        if rank >= world:
            raise ValueError(
                f"rank should be below num_replicas={world}, but got rank={rank}; ranks count from 0"
            )
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return Reader(rank, world, worker, workers)

    def _take_resume(self, reader: Reader) -> dict[str, Any] | None:
        state, self._resume = self._resume, None
        if state is None or state["epoch"] != self.epoch or state["run"] is None:
            return None
        saved = Reader(**state["reader"])
        if saved != reader:
            raise ValueError(
                f"state was saved by rank {saved.rank} of {saved.num_replicas}, DataLoader worker "
                f"{saved.worker} of {saved.num_workers}, but this reader is rank {reader.rank} of "
                f"{reader.num_replicas}, worker {reader.worker} of {reader.num_workers}; resume an "
                f"epoch with the same number of ranks and DataLoader workers"
            )
        run: dict[str, Any] = state["run"]
        return run

    # -- checkpointing -----------------------------------------------------------

    def _settings(self) -> dict[str, Any]:
        cost = self.cost
        terms: list[Any] = [cost.linear, cost.quadratic, cost.per_sample, cost.pad_to_multiple_of]
        return {
            "max_tokens": self._made_with,
            # A padded stream's settings are what they were before packs: its checkpoints resume.
            "cost": terms if cost.packing is None else [*terms, cost.packing],
            "buffer_size": self.buffer_size,
            "seed": self.seed,
            "oversize": self.oversize,
            "buckets": self.buckets if isinstance(self.buckets, int) else self.buckets.tolist(),
            "examples": self._kind,
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this reader is in its epoch: the examples read, those buffered, the random state.

        Called in the process that iterates the stream (the main process
        with ``num_workers=0``; each worker under torchdata's
        ``StatefulDataLoader``, which gathers them). The state holds
        positions, not examples: a resume reads them again (see
        ``docs/streaming.md``). Before a pass has started it describes the
        start of the epoch (or the state loaded last).
        """
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "settings": self._settings(),
            "max_tokens": self.max_tokens,
            "epoch": self.epoch,
            "reader": None,
            "run": None,
        }
        run = self._run
        if run is not None and run.epoch == self.epoch:
            reader = run.reader
            state["reader"] = {
                "rank": reader.rank,
                "num_replicas": reader.num_replicas,
                "worker": reader.worker,
                "num_workers": reader.num_workers,
            }
            state["run"] = run.state()
        elif self._resume is not None:
            return dict(self._resume)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next pass yields exactly the batches this one had left.

        Raises:
            ValueError: the state is from another version or other settings.
        """
        if not isinstance(state, dict):
            raise TypeError(f"state should be a dict from state_dict(), but got {type(state).__name__}")
        if set(state) != _STATE_KEYS:
            raise ValueError(
                f"state is not a TokenBudgetStream state_dict: unknown keys "
                f"{sorted(set(state) - _STATE_KEYS)}, "
                f"missing keys {sorted(_STATE_KEYS - set(state))}"
            )
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"state has version={state['version']!r}, but this tokenbatch reads version {_STATE_VERSION}"
            )
        settings = self._settings()
        if dict(state["settings"]) != settings:
            changes = ", ".join(
                f"{k}: saved {state['settings'].get(k)!r}, now {settings.get(k)!r}"
                for k in sorted(set(settings) | set(state["settings"]))
                if state["settings"].get(k) != settings.get(k)
            )
            raise ValueError(
                f"state was saved with other stream settings ({changes}); build it alike to resume"
            )
        reader = state["reader"]
        if reader is not None and (reader["rank"], reader["num_replicas"]) != (self.rank, self.num_replicas):
            raise ValueError(
                f"state was saved by rank {reader['rank']} of {reader['num_replicas']}, but this stream is "
                f"rank {self.rank} of {self.num_replicas}: each rank resumes from its own state. Save "
                f"stream.state_dict() on every rank, to a file per rank (accelerate's save_state keeps a "
                f"registered object's state from the main process only)"
            )
        budget = _checks.positive_number("state['max_tokens']", state["max_tokens"])
        self.set_epoch(_checks.non_negative_int("epoch", state["epoch"]))
        self._budget.fill_(budget)
        self._ceiling = budget
        self._resume = dict(state)
        self._run = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_run"] = None  # a live pass holds iterators; a worker starts its own
        return state


def _buckets(buckets: Any) -> int | np.ndarray:
    if isinstance(buckets, bool):
        raise TypeError(f"buckets should be a count or a list of boundaries, but got buckets={buckets!r}")
    if isinstance(buckets, Integral):
        return _checks.positive_int("buckets", buckets)
    try:
        boundaries = np.asarray(list(buckets))
    except TypeError:
        raise TypeError(
            f"buckets should be a count or a list of boundaries, but got buckets={buckets!r}"
        ) from None
    if boundaries.size and (
        not np.issubdtype(boundaries.dtype, np.integer)
        or boundaries.min() < 1
        or np.any(np.diff(boundaries) <= 0)
    ):
        raise ValueError(
            f"buckets should be increasing padded lengths >= 1 (the boundaries between buckets), but got "
            f"buckets={list(buckets)!r}"
        )
    return boundaries.astype(np.int64)
