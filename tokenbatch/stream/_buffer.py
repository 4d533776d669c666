"""The examples a :class:`~tokenbatch.TokenBudgetStream` reader holds, kept in length order.

The buffer is three numpy arrays sorted together (a key that is the padded
length with a tie-break in the low bits, each example's cost alone, its
position in the reader's part) and a dict from position to the example.
Along the sorted order the costs never decrease, so the examples of a
batch are a contiguous run, which is what keeps padding low::

    cost line:  |--short--|-----bucket 1-----|---bucket 2---|--long--|
                     [== one batch ==]       (the bucket is drawn with the same
                        ending in bucket 1    number on every rank)

A batch is drawn in two steps: a bucket, chosen by a random cost quantile
that all ranks share (so ranks train similar lengths at the same step); then
of the full runs that end in that bucket (as many examples as fit the budget
at the run's longest, :func:`tokenbatch.plan.fit_count`), the one with the
least padding for its size (:meth:`Buffer.draw`). Runs may reach below the
bucket, so the shortest examples are as likely to go as the rest.

With a packed cost the key is the example's own length (only a pack's row is
rounded up) and nothing is drawn: :meth:`Buffer.form_packs` packs the whole
buffer at once and takes out the packs that are full.
"""

from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from tokenbatch.cost import CostModel
from tokenbatch.plan import fit_count, plan_batches

FULL = 0.99
"""A pack costing at least this share of the budget is full: a packed stream yields it without waiting."""
_LOW = 32  # bits of the key below the padded length, holding the tie-break
_MIX = np.uint64(0x9E3779B97F4A7C15)


def tie_breaks(positions: np.ndarray, salt: int) -> np.ndarray:
    """A pseudo-random 32-bit number per position, the same whenever it is asked again.

    Deriving the tie-break from the position (rather than drawing it) lets a
    resume rebuild the buffer in the very order it had.
    """
    x = (positions.astype(np.uint64) ^ np.uint64(salt)) * _MIX  # Fibonacci hashing; uint64 arithmetic wraps
    result: np.ndarray = (x >> np.uint64(64 - _LOW)).astype(np.int64)
    return result


def estimate_boundaries(padded: np.ndarray, unit: np.ndarray, buckets: int) -> np.ndarray:
    """Padded lengths that cut ``padded`` into ``buckets`` groups of about equal total cost.

    Bucket ``i`` holds lengths in ``[boundaries[i - 1], boundaries[i])``; fewer
    boundaries come back when the lengths are too few to cut so finely.

    Example:
        >>> estimate_boundaries(np.array([1, 1, 2, 2, 8]), np.array([1.0, 1.0, 2.0, 2.0, 8.0]), 2).tolist()
        [8]
    """
    if len(padded) == 0 or buckets <= 1:
        return np.empty(0, np.int64)
    order = np.argsort(padded, kind="stable")
    lengths, costs = padded[order], np.cumsum(unit[order])
    targets = costs[-1] * np.arange(1, buckets) / buckets
    cuts = lengths[np.minimum(np.searchsorted(costs, targets, side="right"), len(lengths) - 1)]
    result: np.ndarray = np.unique(cuts[cuts > lengths[0]]).astype(np.int64)
    return result


class Buffer:
    """Examples in length order, each with its position in the reader's part and its cost alone.

    The examples sit in slots of an object array, so moving them in and out
    is a numpy gather rather than a Python loop; ``key``, ``unit`` and
    ``slot`` are sorted together, ``position[slot]`` is where each was read.
    """

    def __init__(self, budget: float, boundaries: np.ndarray) -> None:
        self.budget = budget
        self.key = np.empty(0, np.int64)
        self.unit = np.empty(0, np.float64)
        self.slot = np.empty(0, np.int64)
        self.items = np.empty(0, object)
        self.position = np.empty(0, np.int64)
        self._free = np.empty(0, np.int64)
        self.set_boundaries(boundaries)

    def __len__(self) -> int:
        return len(self.key)

    def set_boundaries(self, boundaries: np.ndarray) -> None:
        """Use bucket ``boundaries`` (padded lengths) from now on; the costs per bucket are recounted."""
        self.boundaries = boundaries
        self._bucket_keys = boundaries.astype(np.int64) << _LOW
        self._bucket_cost = self._by_bucket(self.key, self.unit)

    def set_budget(self, budget: float) -> None:
        """Draw under ``budget`` from now on (an OOM re-budget); the examples held stay, recounted."""
        self.budget = budget
        self._bucket_cost = self._by_bucket(self.key, self.unit)

    def _by_bucket(self, keys: np.ndarray, unit: np.ndarray) -> np.ndarray:
        """The cost in each bucket, in whole ticks of 2**-29 budgets (1 to 2**30 ticks an example).

        Integers, so the running totals are exact: after a resume they are the
        very numbers the uninterrupted pass has, and so are its bucket choices.
        """
        buckets = self._bucket_keys.searchsorted(keys, side="right")
        ticks = np.clip(np.rint(unit * (2.0**29 / self.budget)), 1.0, 2.0**30)
        result: np.ndarray = np.bincount(buckets, ticks, len(self._bucket_keys) + 1).astype(np.int64)
        return result

    def positions(self) -> np.ndarray:
        """The positions of the examples buffered, in length order."""
        result: np.ndarray = self.position[self.slot]
        return result

    def padded(self) -> np.ndarray:
        result: np.ndarray = self.key >> _LOW
        return result

    def add(
        self,
        positions: np.ndarray,
        padded: np.ndarray,
        unit: np.ndarray,
        ties: np.ndarray,
        examples: list[Any],
    ) -> None:
        """Insert ``examples``, read at ``positions``, at their places in the length order."""
        count = len(examples)
        slots = self.hold(positions, examples)
        keys = (padded << _LOW) | ties
        order = np.argsort(keys, kind="stable")
        keys, unit, slots = keys[order], unit[order], slots[order]
        self._bucket_cost += self._by_bucket(keys, unit)
        # One merge for the three arrays: where each new key lands, and a mask of the places kept for
        # the old ones. Each array is written once into its new place: no copy of the old beside it.
        # Equal keys keep the order they were read in (after those already here), as a resume rebuilds them.
        landing = self.key.searchsorted(keys, side="right") + np.arange(count)
        old = np.ones(len(self.key) + count, bool)
        old[landing] = False
        self.key = _merged(self.key, keys, landing, old)
        self.unit = _merged(self.unit, unit, landing, old)
        self.slot = _merged(self.slot, slots, landing, old)

    def hold(self, positions: np.ndarray, examples: list[Any]) -> np.ndarray:
        """Put ``examples`` in free slots (outside the length order); returns the slots."""
        count = len(examples)
        if count > len(self._free):
            self._grow(count - len(self._free))
        slots, self._free = self._free[len(self._free) - count :], self._free[: len(self._free) - count]
        self.items[slots] = np.fromiter(examples, object, count)
        self.position[slots] = positions
        return slots

    def _grow(self, extra: int) -> None:
        size = len(self.items)
        self.items = np.concatenate([self.items, np.empty(extra, object)])
        self.position = np.concatenate([self.position, np.zeros(extra, np.int64)])
        self._free = np.concatenate([np.arange(size + extra - 1, size - 1, -1), self._free])

    def draw(self, shared: float, local: float) -> tuple[int, int]:
        """The ``[start, stop)`` run of the next batch, for random numbers in [0, 1).

        ``shared`` (the same on every rank) picks the bucket. Every full run
        that ends in it (as many examples as fit the budget at the run's
        longest) is scored by its padding tokens over ``count**1.5`` and the
        lowest wins. That is the padding share weighed by length over
        ``sqrt(count)``: a run of many short examples spans more of the
        length order than a run of few long ones, so it cannot be as tight
        (scored by padding share alone, the lognormal set of
        ``benchmarks/streaming.py`` padded more). ``local`` (this reader's
        own) breaks ties, so equal lengths leave in a random order. A bucket
        where no full run ends (too few examples below it) gives the run
        from its first example on.
        """
        budget = self.budget
        line = np.cumsum(self._bucket_cost)
        bucket = min(int(line.searchsorted(shared * line[-1], side="right")), len(line) - 1)
        first, last = self._bucket_range(bucket)
        # Only the last of equal lengths can end the best run: moving a run's end up over an equal
        # length trades its shortest example for one as long as its longest, never more padding.
        held = self.key[first:last] >> _LOW
        ends = np.empty(len(held), bool)
        np.not_equal(held[1:], held[:-1], out=ends[:-1])
        ends[-1] = True  # a bucket's last example ends a length (buckets cut between lengths)
        stops = ends.nonzero()[0]
        stops += first + 1
        unit = self.unit[stops - 1]
        count = np.maximum(np.floor(budget / unit), 1.0)
        over = count * unit > budget  # the quotient may be one over; the product settles it
        if over.any():
            count[over & (count > 1)] -= 1
        full = count <= stops  # a full run needs that many examples at or below its end
        if not full.all():
            if not full.any():
                return self._run_from(first)
            count, stops = count[full], stops[full]
        sizes = count.astype(np.int64)
        low = int((stops - sizes).min())
        padded = self.key[low:last] >> _LOW
        below = np.zeros(len(padded) + 1, np.int64)
        padded.cumsum(out=below[1:])
        stops -= low
        waste = sizes * padded[stops - 1] - (below[stops] - below[stops - sizes])
        score = waste / (count * np.sqrt(count))
        ties = (score == score.min()).nonzero()[0]
        best = ties[int(local * len(ties))]
        return low + int(stops[best] - sizes[best]), low + int(stops[best])

    def _bucket_range(self, bucket: int) -> tuple[int, int]:
        keys, bounds = self.key, self._bucket_keys
        first = int(keys.searchsorted(bounds[bucket - 1])) if bucket else 0
        last = int(keys.searchsorted(bounds[bucket])) if bucket < len(bounds) else len(keys)
        return first, last

    def _run_from(self, start: int) -> tuple[int, int]:
        """As many examples from ``start`` on as fit the budget; the last full run if that reaches the end."""
        unit, n, budget = self.unit, len(self.unit), self.budget
        room = fit_count(float(unit[start]), budget, n - start)
        count = max(
            1, int((unit[start : start + room] * np.arange(1, room + 1)).searchsorted(budget, "right"))
        )
        if start + count < n:
            return start, start + count
        return n - max(1, fit_count(float(unit[-1]), budget, n)), n

    def take(self, start: int, stop: int) -> list[Any]:
        """Remove the run ``[start, stop)`` and return its examples."""
        slots = self.slot[start:stop]
        examples: list[Any] = self.items[slots].tolist()
        self.release(slots)
        keys, unit = self.key[start:stop], self.unit[start:stop]
        self._bucket_cost -= self._by_bucket(keys, unit)
        # Closed up in place (only what lies above the run moves, and nothing is allocated).
        rest = len(self.key) - (stop - start)
        self.key[start:rest] = self.key[stop:]
        self.unit[start:rest] = self.unit[stop:]
        self.slot[start:rest] = self.slot[stop:]
        self.key, self.unit, self.slot = self.key[:rest], self.unit[:rest], self.slot[:rest]
        return examples

    def release(self, slots: np.ndarray) -> None:
        """Free ``slots`` (dropping the references to their examples)."""
        self.items[slots] = None
        self._free = np.concatenate([self._free, slots])

    def plan_rest(self, rng: np.random.Generator, cost: CostModel | None = None) -> list[np.ndarray]:
        """Everything buffered, in as few batches (or packs) as the budget allows (``plan_batches``).

        Returns each batch's slots; the buffer's order is emptied, the
        examples stay in their slots until :meth:`take_slots`.
        """
        if not len(self):
            return []
        # The order is emptied first, so that the keys are freed before the planner's temporaries
        # come (this is the peak of a pass's memory).
        padded, unit, slot = self.padded(), self.unit, self.slot
        self.key, self.unit, self.slot = self.key[:0], self.unit[:0], self.slot[:0]
        self._bucket_cost[:] = 0
        plan = plan_batches(
            np.arange(len(slot)), padded, unit, self.budget, rng=rng, oversize="alone", cost=cost
        )
        del padded, unit
        return [slot[np.sort(plan.batch(b))] for b in range(plan.num_batches)]

    def form_packs(self, rng: np.random.Generator, cost: CostModel, keep: int) -> list[np.ndarray]:
        """Packs of everything buffered (``plan_batches`` with a packed ``cost``), the full ones taken out.

        The least full packs (below :data:`FULL` of the budget, never the
        fullest one, and at most ``keep`` examples in all) stay in the order,
        to be packed again with the examples read next: first fit decreasing
        leaves its last packs part full, and a larger choice fills them. The
        others are removed from the order and returned as slots, in the
        planner's order of steps.
        """
        if not len(self):
            return []
        lengths = self.padded()  # a packed cost's keys are the examples' own lengths
        plan = plan_batches(
            np.arange(len(lengths)), lengths, self.unit, self.budget, rng=rng, oversize="alone", cost=cost
        )
        fill, sizes = plan.batch_costs(lengths, cost) / self.budget, plan.batch_sizes()
        least_full = np.argsort(fill, kind="stable")[:-1]  # never the fullest: a round yields a pack
        waiting = least_full[(fill[least_full] < FULL) & (np.cumsum(sizes[least_full]) <= keep)]
        kept = np.zeros(plan.num_batches, bool)
        kept[waiting] = True
        stay = np.empty(len(lengths), bool)
        stay[plan.order] = np.repeat(kept, sizes)
        packs = [self.slot[np.sort(plan.batch(b))] for b in np.flatnonzero(~kept).tolist()]
        gone = ~stay
        self._bucket_cost -= self._by_bucket(self.key[gone], self.unit[gone])
        self.key, self.unit, self.slot = self.key[stay], self.unit[stay], self.slot[stay]
        return packs

    def take_slots(self, slots: np.ndarray) -> list[Any]:
        examples: list[Any] = self.items[slots].tolist()
        self.release(slots)
        return examples


def _merged(held: np.ndarray, new: np.ndarray, landing: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``held`` at the places ``old`` marks and ``new`` at ``landing``, in one new array."""
    result = np.empty(len(old), np.result_type(held, new))
    result[landing] = new
    result[old] = held
    return result


def split_to(batches: list[np.ndarray], count: int) -> list[np.ndarray]:
    """``batches`` with the largest halved until there are ``count`` of them (needs that many items).

    Halves of a run of the length order are runs too, and each costs no more
    than the batch it came from.

    Example:
        >>> [b.tolist() for b in split_to([np.array([0, 1, 2, 3]), np.array([4])], 3)]
        [[0, 1], [2, 3], [4]]
    """
    # Each piece: (-size, the batch it came from, where in that batch it starts, the piece):
    # the order never depends on the slots' numbers, which differ after a resume.
    heap = [(-len(b), i, 0, b) for i, b in enumerate(batches)]
    heapq.heapify(heap)
    while len(heap) < count:
        size, origin, offset, batch = heapq.heappop(heap)
        half = -size // 2
        heapq.heappush(heap, (-half, origin, offset, batch[:half]))
        heapq.heappush(heap, (-(len(batch) - half), origin, offset + half, batch[half:]))
    return [piece[3] for piece in sorted(heap, key=lambda piece: (piece[1], piece[2]))]
