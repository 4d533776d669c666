"""Pure planning: sample lengths in, batches grouped into global steps out.

Nothing here knows about torch, processes or files: every function is a
deterministic function of its numpy inputs and the random generator it is
given, which is what makes a plan reproducible on every rank and after a
restart.

The algorithm, per epoch (or per re-plan of what is left of one):

1. Order the samples by padded length; ties are broken at random, so samples
   of equal length meet different batch-mates each epoch.
2. Pack greedily along that order: each batch takes as many samples as fit
   ``count * cost(longest) <= budget``. Runs of equal length are packed in one
   numpy step, so the Python loop is over distinct lengths, not samples.
   The first batch gets a random share of the budget, which shifts every
   batch boundary from one epoch to the next, when that costs no extra batch.
3. Make the batch count a multiple of the number of ranks, by splitting the
   largest batches (or, with ``drop_last``, dropping the cheapest ones).
4. Group batches of similar cost into global steps of ``num_replicas``
   batches, one per rank, so no rank waits long on another; shuffle the
   steps, and put the costliest step first so an out-of-memory error shows
   at step 0 rather than hours in.

An epoch re-planned mid-way (an out-of-memory error in halve mode, a resume
on another number of ranks) is a :class:`History`: how it started, then each
re-plan; :meth:`Planner.plan` makes the epoch's plan from it, the same on
every rank and after a restart::

    History(max_tokens=B0, num_replicas=W0, replans=(Replan(s1, B1, W0), Replan(s2, B1, W2)))

    steps   0 ......... s1-1 | s1 ......... s2-1 | s2 ......... end
    plan    every sample     | what was left     | what was left
            under B0, W0     | after s1: B1, W0  | after s2: B1, W2

A re-plan keeps the first ``s`` steps (they have been trained) and plans
every sample after them again; the ``k``-th re-plan draws its random choices
from ``(seed, epoch, k)``. :func:`batch_stats` describes any plan (padding,
budget use, balance between ranks): ``sampler.stats()``, ``tokenbatch plan``
and the comparisons of :mod:`tokenbatch.compare` all read it.
"""

from __future__ import annotations

import functools
import heapq
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenbatch.cost import CostModel

__all__ = ["OversizeSampleError", "Plan", "PlanStats", "batch_stats", "plan_batches"]

logger = logging.getLogger("tokenbatch.sampler")

# -- packing: how many samples fit a budget ----------------------------------------


def fit_count(unit: float, budget: float, most: int) -> int:
    """How many samples that each cost ``unit`` fit ``budget`` together, at most ``most``.

    The largest ``count <= most`` with ``count * unit <= budget``, the product
    taken in floats as the cost model takes it. ``most`` (a batch-size cap, or
    the samples there are) keeps the answer and the work finite for any finite
    budget: above 2**53 one more sample no longer changes the float product,
    so counting up one at a time would never stop.

    Example:
        >>> fit_count(3.0, 10.0, 100), fit_count(3.0, 10.0, 2), fit_count(2.0, 1e300, 50)
        (3, 2, 50)
    """

    def fits(count: int) -> bool:
        return count * unit <= budget

    # The quotient is right or one off; the product settles it. `not <` also catches an overflow to inf.
    guess = most if not budget / unit < most else min(int(budget // unit), most)
    if fits(guess):  # gallop up from a count that fits to one that does not (or past `most`)
        low, step = guess, 1
        while low + step <= most and fits(low + step):
            low, step = low + step, 2 * step
        high = min(low + step, most + 1)
    else:  # gallop down from a count that does not fit to one that does (0 always does)
        high, step = guess, 1
        while high - step > 0 and not fits(high - step):
            high, step = high - step, 2 * step
        low = max(high - step, 0)
    while high - low > 1:  # `low` fits, `high` does not or is past `most`
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    return low


def _round_to_multiple(count: int, multiple: int) -> int:
    return count - count % multiple if count >= multiple else count


def pack_sorted(
    unit_sorted: np.ndarray,
    budget: float,
    *,
    max_batch_size: int | None = None,
    batch_size_multiple: int = 1,
    first_budget: float | None = None,
) -> np.ndarray:
    """Greedy batch sizes along samples sorted by per-sample cost.

    Args:
        unit_sorted: per-sample costs in nondecreasing order, each <= budget.
        budget: the most a batch may cost (``count * its largest unit cost``).
        max_batch_size: optional cap on samples per batch.
        batch_size_multiple: batch sizes are rounded down to a multiple of
            this where at least that many samples fit.
        first_budget: a smaller budget for the first batch only.

    Returns:
        The batch sizes, in order; they sum to ``len(unit_sorted)``.

    Example:
        >>> pack_sorted(np.array([1.0, 1.0, 2.0, 2.0, 4.0]), 4.0).tolist()
        [2, 2, 1]
    """
    run_ends = np.append(np.flatnonzero(unit_sorted[1:] != unit_sorted[:-1]) + 1, len(unit_sorted))
    return _pack_runs(
        unit_sorted[run_ends - 1] if len(unit_sorted) else unit_sorted,
        run_ends if len(unit_sorted) else run_ends[:0],
        budget,
        max_batch_size=max_batch_size,
        batch_size_multiple=batch_size_multiple,
        first_budget=first_budget,
    )


def _pack_runs(
    run_unit: np.ndarray,
    run_ends: np.ndarray,
    budget: float,
    *,
    max_batch_size: int | None,
    batch_size_multiple: int,
    first_budget: float | None = None,
) -> np.ndarray:
    """:func:`pack_sorted` of samples given as runs of equal cost: ``run_unit[r]`` up to ``run_ends[r]``.

    The runs are what the sorted samples are made of, so no array of the
    sample count is needed (one per distinct length is enough).
    """
    ends: list[int] = run_ends.tolist()  # Python numbers: the loop below is over runs, one scalar at a time
    units: list[float] = run_unit.tolist()
    n = ends[-1] if ends else 0
    sizes: list[int] = []  # batch sizes, each repeated `times`
    times: list[int] = []
    start = 0
    run = 0
    limit = budget if first_budget is None else min(first_budget, budget)
    # A batch never needs more than the n samples there are. Capping the count at
    # n + batch_size_multiple (not n) keeps a count rounded to the multiple above
    # n, so the batches are the ones an unbounded count makes.
    most = n + batch_size_multiple if max_batch_size is None else min(max_batch_size, n + batch_size_multiple)
    while start < n:
        while ends[run] <= start:
            run += 1
        room = fit_count(units[run], limit, most)
        if room == 0:  # the first batch's share was too small for its first sample
            limit = budget
            continue
        full = _round_to_multiple(room, batch_size_multiple)
        if limit == budget:
            # Inside a run of equal costs every batch takes exactly `full`.
            repeats = (ends[run] - start) // full
            if repeats:
                sizes.append(full)
                times.append(repeats)
                start += repeats * full
                if start == ends[run]:
                    continue
        # A batch that crosses into longer samples: the largest count whose product with the cost of
        # its last sample stays within the limit, within the `room` the first sample's cost leaves.
        # The product grows with the count, so the first run whose first count is past the limit
        # ends the search, and the count is found in the run before it.
        window = min(room, n - start)
        later = run
        while ends[later] - start < window and (ends[later] - start + 1) * units[later + 1] <= limit:
            later += 1
        count = fit_count(units[later], limit, min(ends[later] - start, window))
        count = _round_to_multiple(count, batch_size_multiple)
        sizes.append(count)
        times.append(1)
        start += count
        limit = budget
    return np.repeat(np.array(sizes, np.int64), times)


# -- the plan ----------------------------------------------------------------------

OVERSIZE_POLICIES = ("error", "skip", "alone")
_SHIFT_TRIES = 4


class OversizeSampleError(ValueError):
    """A single sample costs more than the whole budget (``oversize="error"``)."""


@dataclass(frozen=True)
class Plan:
    """Batches of sample indices, laid out step after step.

    Batch ``b`` is ``order[offsets[b]:offsets[b + 1]]`` (never empty); global
    step ``s`` holds batches ``s * num_replicas`` to ``(s + 1) * num_replicas - 1``,
    one for each rank in rank order. Where an epoch was resumed on another
    number of ranks, the steps before keep their width and ``step_starts``
    says where each step begins. :func:`tokenbatch.plan.batch_stats`
    describes a plan; any batching ``(order, offsets)`` can be wrapped in one.

    Example:
        >>> from tokenbatch.cost import CostModel
        >>> plan = Plan(np.array([2, 0, 1]), np.array([0, 2, 3]), num_replicas=1)
        >>> lengths = np.array([5, 9, 7])
        >>> plan.batch_longest(lengths).tolist(), plan.batch_costs(lengths, CostModel()).tolist()
        ([7, 9], [14.0, 9.0])
    """

    order: np.ndarray
    offsets: np.ndarray
    num_replicas: int
    skipped: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    dropped: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    step_starts: np.ndarray | None = None
    """Each step's first batch, then the end, where steps differ in width; None: ``num_replicas`` each."""

    def __post_init__(self) -> None:
        if self.step_starts is not None and np.all(np.diff(self.step_starts) == self.num_replicas):
            object.__setattr__(self, "step_starts", None)  # one width after all: the plain layout

    @property
    def num_batches(self) -> int:
        return len(self.offsets) - 1

    @property
    def num_steps(self) -> int:
        starts = self.step_starts
        return self.num_batches // self.num_replicas if starts is None else len(starts) - 1

    def step_start(self, step: int) -> int:
        """The index of step ``step``'s first batch (for ``num_steps``: the end of the last step)."""
        return step * self.num_replicas if self.step_starts is None else int(self.step_starts[step])

    def batch(self, index: int) -> np.ndarray:
        return self.order[self.offsets[index] : self.offsets[index + 1]]

    def batch_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def batch_longest(self, lengths: np.ndarray) -> np.ndarray:
        """The largest of ``lengths`` (one per sample of the dataset) in each batch."""
        if self.num_batches == 0:  # reduceat needs at least one segment
            return np.empty(0, lengths.dtype)
        longest: np.ndarray = np.maximum.reduceat(lengths[self.order], self.offsets[:-1])
        return longest

    def batch_costs(self, lengths: np.ndarray, cost: CostModel) -> np.ndarray:
        """Each batch's cost: its size times the cost of its longest sample alone, or its pack's cost."""
        if cost.packing is not None:
            return cost.batch_costs(lengths[self.order], self.offsets)
        costs: np.ndarray = self.batch_sizes() * cost.sample_cost(self.batch_longest(lengths))
        return costs

    def first_steps(self, steps: int) -> Plan:
        """The plan cut after ``steps`` global steps."""
        end = self.step_start(steps)
        starts = None if self.step_starts is None else self.step_starts[: steps + 1]
        return Plan(
            self.order[: self.offsets[end]],
            self.offsets[: end + 1],
            self.num_replicas,
            self.skipped,
            self.dropped,
            starts,
        )

    def then(self, rest: Plan) -> Plan:
        """This plan followed by ``rest``: each step keeps its width, and ``rest``'s ranks are the plan's."""
        head, tail = (
            np.arange(p.num_steps + 1) * p.num_replicas if p.step_starts is None else p.step_starts
            for p in (self, rest)
        )
        return Plan(
            np.concatenate([self.order, rest.order]),
            np.concatenate([self.offsets, rest.offsets[1:] + self.offsets[-1]]),
            rest.num_replicas,
            np.concatenate([self.skipped, rest.skipped]),
            np.concatenate([self.dropped, rest.dropped]),
            np.concatenate([head, tail[1:] + self.num_batches]),
        )

    def remaining_after(self, steps: int) -> np.ndarray:
        """Indices of the samples in steps ``steps`` onwards."""
        return self.order[self.offsets[self.step_start(steps)] :]


def oversize_error(too_big: np.ndarray, keys: np.ndarray, unit: Costs, budget: float) -> OversizeSampleError:
    """The error for samples ``too_big`` that each cost more than ``budget`` alone."""
    first = int(too_big[0])
    return OversizeSampleError(
        f"sample {first} (padded length {int(keys[first])}) costs {float(unit[first]):g} "
        f"on its own, more than the budget max_tokens={budget:g} "
        f"({len(too_big)} sample(s) do); raise max_tokens to at least "
        f"{float(unit[too_big].max()):g}, truncate the sequences, or pass "
        f"oversize='alone' (a batch of one) or oversize='skip'"
    )


def _split_to_multiple(
    starts: np.ndarray, sizes: np.ndarray, num_replicas: int, batch_size_multiple: int
) -> tuple[np.ndarray, np.ndarray] | None:
    """Split the largest batches until their count divides by ``num_replicas``.

    Returns None when there are too few samples to do so.
    """
    missing = -len(sizes) % num_replicas
    if missing == 0:
        return starts, sizes
    if int(sizes.sum()) < len(sizes) + missing:
        return None
    heap = [(-int(size), int(start)) for start, size in zip(starts, sizes, strict=True)]
    heapq.heapify(heap)
    for _ in range(missing):
        size, start = heapq.heappop(heap)
        size = -size
        half = size // 2
        if half >= batch_size_multiple:  # keep the multiple where the batch allows it
            half -= half % batch_size_multiple
        heapq.heappush(heap, (-half, start))
        heapq.heappush(heap, (-(size - half), start + half))
    pairs = sorted((start, -size) for size, start in heap)
    return np.array([p[0] for p in pairs], np.int64), np.array([p[1] for p in pairs], np.int64)


def _gather_segments(source: np.ndarray, starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """``concatenate([source[s:s + n] for s, n in zip(starts, sizes)])`` without the loop.

    In groups of consecutive segments of about ``_CHUNK`` elements (a longer
    one is copied as a slice), so that the index arrays it needs stay that
    small rather than two int64 arrays of the result's size.
    """
    ends = np.cumsum(sizes)
    total = int(ends[-1]) if len(ends) else 0
    gathered = np.empty(total, source.dtype)
    first = 0
    while first < len(sizes):
        done = int(ends[first - 1]) if first else 0
        last = max(int(ends.searchsorted(done + _CHUNK, side="right")), first + 1)
        if last == first + 1:
            gathered[done : ends[first]] = source[starts[first] : starts[first] + sizes[first]]
        else:
            group = sizes[first:last]
            shift = np.repeat(starts[first:last] - (ends[first:last] - group - done), group)
            gathered[done : ends[last - 1]] = source[np.arange(len(shift)) + shift]
        first = last
    return gathered


def plan_batches(
    indices: np.ndarray,
    keys: np.ndarray,
    unit: Costs,
    budget: float,
    *,
    rng: np.random.Generator | None,
    num_replicas: int = 1,
    max_batch_size: int | None = None,
    batch_size_multiple: int = 1,
    drop_last: bool = False,
    oversize: str = "error",
    admitted: float | None = None,
    cost: CostModel | None = None,
) -> Plan:
    """Plan batches for the samples ``indices`` under ``budget``.

    Args:
        indices: the sample indices to plan (all of them, or what is left).
        keys: padded length of every sample in the dataset (sort key).
        unit: cost of every sample alone, a function of its key nondecreasing
            in it: an array, or a :class:`UnitTable` of one cost per key.
        budget: the most one batch may cost.
        rng: randomness for tie-breaking, boundaries and step order; None
            plans in length order with no randomness.
        num_replicas: batches per global step (ranks).
        max_batch_size, batch_size_multiple: see :func:`pack_sorted`.
        drop_last: drop the cheapest batches rather than split batches when
            the batch count is not a multiple of ``num_replicas``.
        oversize: ``"error"``, ``"skip"`` or ``"alone"`` for a sample that
            alone costs more than ``budget``.
        admitted: a sample that costs more than ``budget`` but at most
            ``admitted`` gets a batch of its own, whatever ``oversize`` says:
            the budget it was admitted under, since lowered (a re-plan after
            out-of-memory), has not shown that it does not fit alone.
        cost: the cost model ``unit`` comes from; with ``cost.packing`` the
            batches are packs (whole examples in one row) and ``keys`` are the
            examples' lengths.

    Raises:
        OversizeSampleError: a sample alone exceeds the budget (and ``admitted``)
            with ``oversize="error"``.
        ValueError: too few samples to give every rank the same number of
            batches and ``drop_last`` is False.

    Example:
        >>> keys = np.array([5, 1, 5, 1])
        >>> plan = plan_batches(np.arange(4), keys, keys.astype(float), 10.0, rng=None)
        >>> [plan.batch(b).tolist() for b in range(plan.num_batches)]
        [[0, 2], [1, 3]]
    """
    indices = _as_indices(indices, len(keys))
    low, high, counts, dearest = _survey(indices, keys, unit)
    skipped = np.empty(0, np.int64)
    alone = np.empty(0, np.int64)
    if dearest > budget:
        too_big = np.concatenate(
            [unit[indices[c : c + _CHUNK]] > budget for c in range(0, len(indices), _CHUNK)]
        )
        worst = indices[too_big]
        if admitted is not None:
            fits = unit[worst] <= admitted
            alone, worst = worst[fits], worst[~fits]
        if len(worst) and oversize == "error":
            raise oversize_error(worst, keys, unit, budget)
        if oversize == "skip":
            skipped = worst
        else:
            alone = np.concatenate([alone, worst])
        indices = indices[~too_big]
        del too_big
        low, high, counts, _ = _survey(indices, keys, unit)

    if cost is not None and cost.packing is not None:
        return _plan_packs(
            indices,
            alone,
            skipped,
            keys,
            budget,
            cost,
            rng=rng,
            num_replicas=num_replicas,
            max_batch_size=max_batch_size,
            drop_last=drop_last,
        )

    # Ordered by padded length, equal lengths in a random order (each temporary of the sample count is
    # freed as soon as it is done with: this is the planner's peak memory).
    shuffled = indices if rng is None else rng.permutation(indices)
    order, run_ends = _sort_by_key(shuffled, keys, low, high, counts, room=len(alone))
    del shuffled, counts
    run_unit = unit[order[run_ends - 1]]
    # Runs of equal cost, as pack_sorted sees them (keys of equal cost: a cost with per_sample alone).
    distinct = np.append(run_unit[1:] != run_unit[:-1], True)[: len(run_unit)]
    run_unit, run_ends = run_unit[distinct], run_ends[distinct]

    pack = functools.partial(
        _pack_runs,
        run_unit,
        run_ends,
        budget,
        max_batch_size=max_batch_size,
        batch_size_multiple=batch_size_multiple,
    )
    sizes = pack()
    if rng is not None:
        # Shift every boundary by giving the first batch a random share of the
        # budget, so batch-mates change between epochs; but only where the
        # shift costs no extra batch (greedy packing from the start is minimal).
        for _ in range(_SHIFT_TRIES):
            share = 0.5 + 0.5 * rng.random()
            shifted = pack(first_budget=budget * share)
            if len(shifted) <= len(sizes):
                sizes = shifted
                break
    if len(alone):
        order[len(order) - len(alone) :] = alone
        sizes = np.concatenate([sizes, np.ones(len(alone), np.int64)])
    starts = np.cumsum(sizes) - sizes

    def batch_costs() -> np.ndarray:
        last: np.ndarray = sizes * unit[order[starts + sizes - 1]]  # a batch's cost: its last sample's
        return last

    starts, sizes, dropped = _equal_per_rank(
        order, starts, sizes, batch_costs, num_replicas, batch_size_multiple, drop_last, budget, "batches"
    )

    batch_order = _arrange_steps(batch_costs(), num_replicas, rng)
    del pack
    starts, sizes = starts[batch_order], sizes[batch_order]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan(_gather_segments(order, starts, sizes), offsets, num_replicas, skipped, dropped)


def _equal_per_rank(
    order: np.ndarray,
    starts: np.ndarray,
    sizes: np.ndarray,
    costs: Callable[[], np.ndarray],
    num_replicas: int,
    multiple: int,
    drop_last: bool,
    budget: float,
    noun: str,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The batches (``starts``, ``sizes`` into ``order``) made a multiple of ``num_replicas`` in number.

    The largest are split (:func:`_split_to_multiple`), or with ``drop_last``
    the cheapest by ``costs()`` are dropped (returned as the third array, the
    samples left out); where neither can be done the error says why.
    """
    dropped = np.empty(0, np.int64)
    if len(sizes) % num_replicas == 0:
        return starts, sizes, dropped
    split = None if drop_last else _split_to_multiple(starts, sizes, num_replicas, multiple)
    if split is not None:
        return split[0], split[1], dropped
    if not drop_last:
        raise ValueError(
            f"cannot give each of num_replicas={num_replicas} ranks the same number of "
            f"{noun}: {int(sizes.sum())} samples need {len(sizes)} {noun} under "
            f"max_tokens={budget:g}, and splitting them would leave one empty; "
            f"use drop_last=True, a larger max_tokens, or fewer processes"
        )
    cheapest = np.argsort(costs(), kind="stable")[: len(sizes) % num_replicas]
    keep = np.ones(len(sizes), bool)
    keep[cheapest] = False
    return starts[keep], sizes[keep], _gather_segments(order, starts[~keep], sizes[~keep])


def _plan_packs(
    indices: np.ndarray,
    alone: np.ndarray,
    skipped: np.ndarray,
    lengths: np.ndarray,
    budget: float,
    cost: CostModel,
    *,
    rng: np.random.Generator | None,
    num_replicas: int,
    max_batch_size: int | None,
    drop_last: bool,
) -> Plan:
    """Packs of whole examples, each within ``budget``: :func:`plan_batches` with ``cost.packing``.

    The examples, longest first (lengths within about 4% of each other in a
    random order, drawn again every epoch), each go to the first pack they fit
    in (first fit decreasing, :func:`_fill_packs`): a pack is left with room
    only for examples shorter than any left. Each step of ``num_replicas``
    packs is then made of packs of similar attention work, for ranks that take
    the same time.
    """
    if rng is None:
        order = indices[np.argsort(-lengths[indices], kind="stable")]
    else:
        shuffled = rng.permutation(indices)
        bands = np.floor(np.log2(np.maximum(lengths[shuffled], 1)) * 16).astype(np.int64)
        order = shuffled[np.argsort(-bands, kind="stable")]
        del shuffled, bands
    position, sizes = _fill_packs(
        lengths[order], budget, cost, len(order) if max_batch_size is None else max_batch_size
    )
    order = order[position]
    order = np.concatenate([order, alone]).astype(np.int64)
    size_array = np.concatenate([np.asarray(sizes, np.int64), np.ones(len(alone), np.int64)])
    starts = np.cumsum(size_array) - size_array
    starts, size_array, dropped = _equal_per_rank(
        order,
        starts,
        size_array,
        lambda: cost.batch_costs(lengths[order], np.append(starts, len(order))),
        num_replicas,
        1,
        drop_last,
        budget,
        "packs",
    )
    gathered = _gather_segments(order, starts, size_array)
    offsets = np.concatenate([[0], np.cumsum(size_array)]).astype(np.int64)
    # Steps of packs alike in attention work (sum of squares under a varlen kernel), and so in tokens
    # too, the packs being full: ranks that take the same time.
    packed = lengths[gathered].astype(np.float64)
    varlen = cost.packing == "varlen" and len(packed) > 0
    work = np.add.reduceat(packed * packed, offsets[:-1]) if varlen else None
    batch_order = _arrange_steps(
        cost.batch_costs(lengths[gathered], offsets) if work is None else work, num_replicas, rng
    )
    starts, size_array = (offsets[:-1])[batch_order], size_array[batch_order]
    offsets = np.concatenate([[0], np.cumsum(size_array)]).astype(np.int64)
    return Plan(_gather_segments(gathered, starts, size_array), offsets, num_replicas, skipped, dropped)


def _fill_packs(
    lengths: np.ndarray, budget: float, cost: CostModel, most: int
) -> tuple[np.ndarray, np.ndarray]:
    """Packs of ``lengths`` (longest first, each one within ``budget`` alone), first fit decreasing.

    Each example goes to the first pack it fits in, found in O(log packs) on a
    tree of the room each pack has left: in cost units under a varlen kernel
    (a pack's cost is a sum over its examples), in tokens under one that
    scores the whole row. A pack's room is read so that an example given it
    surely fits (``pad_to_multiple_of`` rounds the row up: at most that many
    tokens are left unused per pack), and the exact cost is checked on top.
    Returns the positions in pack order and the packs' sizes.
    """
    count = len(lengths)
    linear, quadratic, per_sample = cost.linear, cost.quadratic, cost.per_sample
    varlen = cost.packing == "varlen"
    slack = cost.pad_to_multiple_of - 1

    def fits(total: int, area: int, n: int) -> bool:
        row = float(cost.padded_length(total))
        return linear * row + quadratic * (float(area) if varlen else row * row) + per_sample * n <= budget

    def widest_row(n: int) -> int:
        """The longest row (a multiple of ``pad_to_multiple_of``) of ``n`` examples within the budget."""
        left = budget - per_sample * n
        if quadratic > 0:
            x = (-linear + math.sqrt(linear * linear + 4 * quadratic * max(left, 0.0))) / (2 * quadratic)
        else:
            x = left / linear if linear > 0 else float(count * int(lengths.max(initial=1)) + 1)
        row = int(cost.padded_length(max(int(x), 0)))
        while row > 0 and not fits(row, 0, n):
            row -= cost.pad_to_multiple_of
        return row

    size = 1 << max(count - 1, 0).bit_length()
    room = [-math.inf] * (2 * size)  # a max-tree over the packs' room, leaves from ``size`` on
    totals: list[int] = []
    areas: list[int] = []
    counts: list[int] = []
    pack_of = np.empty(count, np.int64)

    def set_room(pack: int) -> None:
        total, area, n = totals[pack], areas[pack], counts[pack]
        if n >= most:
            value = -math.inf
        elif varlen:
            row = float(cost.padded_length(total))
            value = budget - (linear * row + quadratic * area + per_sample * n)
        else:
            value = float(widest_row(n + 1) - total)
        i = size + pack
        room[i] = value
        i >>= 1
        while i:
            room[i] = max(room[2 * i], room[2 * i + 1])
            i >>= 1

    for position, length in enumerate(lengths.tolist()):
        need = linear * (length + slack) + quadratic * length * length + per_sample if varlen else length
        pack = -1
        if room[1] >= need:
            i = 1
            while i < size:
                i = 2 * i if room[2 * i] >= need else 2 * i + 1
            pack = i - size
            if not fits(totals[pack] + length, areas[pack] + length * length, counts[pack] + 1):
                pack = -1  # float rounding at the edge: a pack of its own, never over the budget
        if pack < 0:
            pack = len(totals)
            totals.append(0)
            areas.append(0)
            counts.append(0)
        totals[pack] += length
        areas[pack] += length * length
        counts[pack] += 1
        pack_of[position] = pack
        set_room(pack)
    return np.argsort(pack_of, kind="stable"), np.bincount(pack_of, minlength=len(totals))


def _arrange_steps(costs: np.ndarray, num_replicas: int, rng: np.random.Generator | None) -> np.ndarray:
    """Order batches into steps of similar cost, costliest step first."""
    if len(costs) == 0:
        return np.empty(0, np.int64)
    by_cost = np.argsort(-costs, kind="stable")
    steps = by_cost.reshape(-1, num_replicas)  # step 0 holds the costliest batches
    if rng is not None:
        rest = 1 + rng.permutation(len(steps) - 1)
        steps = steps[np.concatenate([[0], rest])]
        steps = rng.permuted(steps, axis=1)  # which rank gets which batch
    return steps.reshape(-1)


def _small_int(keys: np.ndarray) -> np.ndarray:
    """Keys in the narrowest integer type, so numpy's stable sort can use radix sort."""
    if len(keys) and int(keys.max()) <= np.iinfo(np.int16).max:
        return keys.astype(np.int16, copy=False)
    return keys


# -- memory: what planning holds per sample ---------------------------------------------
#
# Planning 10^8 samples or more is bounded by memory before time, so nothing here holds an
# array of the sample count wider than it must: indices in int32 where they fit (index_dtype),
# lengths in the narrowest integer type (int_dtype), the cost of each sample looked up per
# padded length (UnitTable), the sort by length counted in chunks rather than argsorted
# whole (argsort returns int64), and index arrays passed on as views, never copied wider.

_CHUNK = 1 << 16
"""Samples per step of the loops over the samples: their temporaries stay a few MiB."""
_MAX_SPAN = 1 << 16
"""Keys that span at most this many values are sorted by counting, in chunks."""


def index_dtype(count: int) -> type[np.signedinteger[Any]]:
    """The integer type of indices into ``count`` samples: int32 below 2**31, else int64.

    Example:
        >>> index_dtype(10**6).__name__, index_dtype(2**31).__name__
        ('int32', 'int64')
    """
    return np.int32 if count < 2**31 else np.int64


def int_dtype(low: int, high: int) -> type[np.signedinteger[Any]]:
    """The narrowest signed integer type holding ``low`` to ``high`` (lengths, padded lengths).

    Signed, so that differences of lengths never wrap around.

    Example:
        >>> int_dtype(1, 512).__name__, int_dtype(1, 100_000).__name__
        ('int16', 'int32')
    """
    for dtype in (np.int8, np.int16, np.int32):
        if np.iinfo(dtype).min <= low and high <= np.iinfo(dtype).max:
            return dtype
    return np.int64


def _as_indices(indices: Any, count: int) -> np.ndarray:
    """``indices`` as an array of :func:`index_dtype`; one that is already is passed on as it is."""
    array = np.asarray(indices)
    dtype = index_dtype(count)
    return array if array.dtype == dtype else array.astype(dtype)


class UnitTable:
    """Each sample's cost alone, ``table[keys[i]]``: one cost per padded length, not one per sample.

    What the planner asks of per-sample costs (``unit[indices]``, ``len(unit)``)
    without an array of 8 bytes a sample. ``table`` must be nondecreasing (a
    cost model's costs of the lengths 0, 1, ... are).

    Example:
        >>> costs = UnitTable(np.array([3, 1, 3]), np.array([0.0, 10.0, 20.0, 30.0]))
        >>> costs[np.array([0, 1])].tolist(), len(costs), np.asarray(costs).tolist()
        ([30.0, 10.0], 3, [30.0, 10.0, 30.0])
    """

    __slots__ = ("keys", "table")

    def __init__(self, keys: np.ndarray, table: np.ndarray) -> None:
        self.keys, self.table = keys, table

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: Any) -> Any:
        return self.table[self.keys[index]]

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        costs: np.ndarray = self.table[self.keys]  # a new array: 8 bytes a sample
        return costs if dtype is None else costs.astype(dtype)

    def above(self, budget: float) -> np.ndarray:
        """The samples that alone cost more than ``budget``, in index order."""
        over = self.table > budget
        return np.flatnonzero(over[self.keys]) if over.any() else np.empty(0, np.int64)


Costs = np.ndarray | UnitTable
"""Per-sample costs: an array, or a :class:`UnitTable`."""


def samples_above(unit: Costs, budget: float) -> np.ndarray:
    """The indices of the samples that alone cost more than ``budget``."""
    return unit.above(budget) if isinstance(unit, UnitTable) else np.flatnonzero(unit > budget)


def _survey(indices: np.ndarray, keys: np.ndarray, unit: Costs) -> tuple[int, int, np.ndarray | None, float]:
    """The smallest and largest key of ``indices``, the count of each key in between (None where the
    keys span too many values to count them), and the dearest sample's cost alone; in chunks."""
    if len(indices) == 0:
        return 0, 0, None, -math.inf
    table = unit.table if isinstance(unit, UnitTable) and unit.keys is keys else None
    one = len(indices) <= _CHUNK  # then the chunk's keys are kept for the count
    low, high, dearest = math.inf, -math.inf, -math.inf
    for c in range(0, len(indices), _CHUNK):
        part = keys[indices[c : c + _CHUNK]]
        low, high = min(low, int(part.min())), max(high, int(part.max()))
        costs = table[part] if table is not None else unit[indices[c : c + _CHUNK]]
        dearest = max(dearest, float(costs.max()))
    low, high = int(low), int(high)
    if high - low >= _MAX_SPAN:
        return low, high, None, dearest
    counts = np.zeros(high - low + 1, np.int64)
    for c in range(0, len(indices), _CHUNK):
        part = part if one else keys[indices[c : c + _CHUNK]]
        counts += np.bincount(part - low if low else part, minlength=len(counts))
    return low, high, counts, dearest


def _sort_by_key(
    source: np.ndarray, keys: np.ndarray, low: int, high: int, counts: np.ndarray | None, *, room: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """``source`` stably sorted by ``keys[source]``, with ``room`` free places at the end, and where
    each run of equal keys ends.

    ``source[np.argsort(keys[source], kind="stable")]``, but by counting: ``counts``
    (of each key from ``low`` to ``high``) say where each key's run starts, and
    each chunk of ``source`` is sorted on its own and put in place. So no int64
    array of the sample count is made (argsort's result is one). Without
    ``counts``, argsort it is.
    """
    n = len(source)
    order = np.empty(n + room, source.dtype)
    if counts is None:
        sorted_keys = keys[source]
        by_key = np.argsort(_small_int(sorted_keys), kind="stable")
        order[:n] = source[by_key]
        sorted_keys = sorted_keys[by_key]
        del by_key
        run_ends = np.append(np.flatnonzero(sorted_keys[1:] != sorted_keys[:-1]) + 1, n)
        return order, run_ends if n else run_ends[:0]
    # Radix sort (numpy's stable sort of 16-bit integers) within each chunk, of the keys less `low`.
    narrow = np.uint8 if high - low < 2**8 else np.uint16
    place = np.cumsum(counts) - counts  # where the next sample of each key goes
    for c in range(0, n, _CHUNK):
        part = source[c : c + _CHUNK]
        chunk_keys = (keys[part] - low).astype(narrow)
        by_key = np.argsort(chunk_keys, kind="stable")
        chunk_counts = np.bincount(chunk_keys, minlength=len(counts))
        # The j-th sample of the sorted chunk goes to place[key] + (j - the chunk's first of that key).
        shift = place - (np.cumsum(chunk_counts) - chunk_counts)
        destination = shift[chunk_keys[by_key]]
        destination += np.arange(len(part))
        order[destination] = part[by_key]
        place += chunk_counts
    return order, np.cumsum(counts[counts > 0])


# -- an epoch's plan after its re-plans --------------------------------------------


@dataclass(frozen=True)
class Replan:
    """From step ``steps_done`` on, the samples left are planned under ``max_tokens`` for ``num_replicas``."""

    steps_done: int
    max_tokens: float
    num_replicas: int
    """The ranks the part is planned for."""


@dataclass(frozen=True)
class History:
    """How an epoch's plan came about: the budget and ranks it started with, then every re-plan in order."""

    max_tokens: float
    num_replicas: int | None = None
    """None: the sampler's number of ranks, read when the plan is made (a fresh epoch)."""
    replans: tuple[Replan, ...] = ()

    def then(self, replan: Replan) -> History:
        return History(self.max_tokens, self.num_replicas, (*self.replans, replan))

    def on(self, world: int) -> History:
        """This history, planned from the start for ``world`` ranks where it does not say."""
        return self if self.num_replicas is not None else History(self.max_tokens, world, self.replans)

    def check_steps_done(self, steps_done: int, plan: Plan, name: str = "steps_done") -> None:
        """Refuse a count of steps trained beyond ``plan`` (this history's) or before its last re-plan."""
        last = self.replans[-1].steps_done if self.replans else 0
        if steps_done < last:
            raise ValueError(
                f"{name} should be at least {last}, the step the epoch was last re-planned at (the steps "
                f"before it have been trained), but got {name}={steps_done}"
            )
        if steps_done > plan.num_steps:
            raise ValueError(
                f"{name} should be at most the {plan.num_steps} steps of the epoch's plan, but got "
                f"{name}={steps_done}"
            )

    def budget_per_batch(self, plan: Plan) -> np.ndarray:
        """The budget each batch of ``plan`` (this history's) was planned under."""
        budgets = np.full(plan.num_batches, self.max_tokens)
        for replan in self.replans:
            budgets[plan.step_start(replan.steps_done) :] = replan.max_tokens
        return budgets

    def world(self, default: int) -> int:
        """The ranks the last part is planned for (``default``: the sampler's)."""
        if self.replans:
            return self.replans[-1].num_replicas
        return default if self.num_replicas is None else self.num_replicas


@dataclass(frozen=True)
class Planner:
    """The sampler's planning inputs: sort keys and costs of every sample, and its settings."""

    keys: np.ndarray
    unit: Costs
    shuffle: bool
    seed: int
    max_batch_size: int | None
    batch_size_multiple: int
    drop_last: bool
    oversize: str
    admitted: float | None = None
    """The budget ``oversize`` is judged against: under a lower one, a sample within it goes alone."""
    cost: CostModel | None = None
    """The cost model; with ``packing``, the batches are packs and ``keys`` the examples' lengths."""

    def plan(self, epoch: int, history: History, world: int, *, names: Sequence[str] | None = None) -> Plan:
        """The plan of ``epoch`` after ``history``, on ``world`` ranks where the history does not say.

        Args:
            names: what to call the start and each re-plan in an error (the
                fields of a loaded state), in order.

        Raises:
            ValueError: a re-plan starts beyond the steps planned before it, or
                a part cannot be planned (:class:`OversizeSampleError`, too few
                samples for the ranks); with ``names``, the message names the part.
        """
        plan: Plan | None = None
        start = Replan(0, history.max_tokens, world if history.num_replicas is None else history.num_replicas)
        for number, replan in enumerate([start, *history.replans]):
            name = names[number] if names is not None else f"re-plan {number}"
            if plan is None:
                rest = np.arange(len(self.keys), dtype=index_dtype(len(self.keys)))
            elif replan.steps_done > plan.num_steps:
                raise ValueError(
                    f"{name} should re-plan within the {plan.num_steps} steps planned before it, "
                    f"but got steps_done={replan.steps_done}"
                )
            else:
                rest = plan.remaining_after(replan.steps_done)
            try:
                part = self.part(rest, replan.max_tokens, replan.num_replicas, epoch, number)
            except ValueError as error:  # OversizeSampleError, or too few samples for the ranks
                if names is None:
                    raise
                raise type(error)(f"{name} cannot be planned: {error}") from error
            plan = part if plan is None else plan.first_steps(replan.steps_done).then(part)
        assert plan is not None  # the loop ran at least once
        return plan

    def part(self, indices: np.ndarray, max_tokens: float, world: int, epoch: int, replan: int) -> Plan:
        """The plan of the samples ``indices`` under ``max_tokens``: the ``replan``-th part of the epoch."""
        rng = np.random.default_rng([self.seed, epoch, replan]) if self.shuffle else None
        plan = plan_batches(
            indices,
            self.keys,
            self.unit,
            max_tokens,
            rng=rng,
            num_replicas=world,
            max_batch_size=self.max_batch_size,
            batch_size_multiple=self.batch_size_multiple,
            drop_last=self.drop_last,
            oversize=self.oversize,
            admitted=self.admitted,
            cost=self.cost,
        )
        if len(plan.skipped):
            logger.warning(
                "epoch %d: left out %d sample(s) that alone exceed max_tokens=%g (oversize='skip'), "
                "for example sample %d",
                epoch,
                len(plan.skipped),
                max_tokens,
                plan.skipped[0],
            )
        if len(plan.dropped):
            logger.warning(
                "epoch %d: dropped %d sample(s) so that %d ranks get the same number of batches "
                "(drop_last=True)",
                epoch,
                len(plan.dropped),
                world,
            )
        return plan


# -- what a plan looks like -------------------------------------------------------


@dataclass(frozen=True)
class PlanStats:
    """What an epoch's plan looks like; ``print(sampler.stats())`` to see it."""

    num_samples: int
    num_batches: int
    num_steps: int
    """Global steps: ``num_batches / num_replicas``, a partial last step counted as a whole one."""
    padding_efficiency: float
    """Real tokens / padded tokens over all batches (padded as the cost model pads)."""
    cost_efficiency: float
    """Sum of each sample's cost alone / sum of batch costs (1.0 = no padding cost)."""
    mean_budget_use: float
    """Mean batch cost / budget."""
    max_budget_use: float
    """Costliest batch / budget (above 1 only for a batch of one: ``oversize="alone"``, a lowered budget)."""
    mean_batch_size: float
    max_batch_size: int
    num_skipped: int
    num_dropped: int
    steps_over_lower_bound: float = 0.0
    """Steps / :func:`lower_bound_steps`: 1.0 would be no padding and every batch full."""
    step_balance: float = 0.0
    """Sum of batch costs / (ranks * sum over steps of the costliest batch): 1.0 = no rank waits."""


def lower_bound_steps(
    lengths: np.ndarray,
    cost: CostModel,
    budget: float,
    num_replicas: int = 1,
    *,
    unit: Costs | None = None,
) -> float:
    """Steps if nothing were padded and every batch filled the budget: sum cost(1, L_i) / budget / W.

    ``unit`` is ``cost.sample_cost(lengths)``, where the caller has it already.

    Example:
        >>> lower_bound_steps(np.array([10, 30]), CostModel(), 20.0)
        2.0
    """
    total = float((cost.sample_cost(lengths) if unit is None else np.asarray(unit)).sum())
    return total / budget / num_replicas


def batch_stats(
    plan: Plan,
    lengths: np.ndarray,
    cost: CostModel,
    budget: float | np.ndarray,
    *,
    unit: Costs | None = None,
) -> PlanStats:
    """Padding, budget use, batch sizes and step balance of ``plan``.

    Args:
        plan: the batches, ``plan.num_replicas`` to a global step.
        lengths: every sample's real length (the plan holds indices into it).
        cost: the cost model the budget is in.
        budget: the budget, or the one each batch was planned under (an epoch
            re-planned mid-way); the lower bound takes the largest.
        unit: ``cost.sample_cost(lengths)``, where the caller has it already.

    Example:
        >>> plan = Plan(np.array([0, 1, 2]), np.array([0, 2, 3]), num_replicas=1)
        >>> stats = batch_stats(plan, np.array([3, 4, 8]), CostModel(), 8.0)
        >>> stats.num_batches, stats.padding_efficiency, stats.mean_budget_use
        (2, 0.9375, 1.0)
    """
    unit = cost.sample_cost(lengths) if unit is None else np.asarray(unit)
    sizes = plan.batch_sizes()
    world = plan.num_replicas
    skipped, dropped = len(plan.skipped), len(plan.dropped)
    if len(sizes) == 0:
        return PlanStats(len(lengths), 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, skipped, dropped)
    longest = plan.batch_longest(lengths).astype(np.int64)  # padded below: no wrap in a narrow type
    if cost.packing is None:
        costs = sizes * cost.sample_cost(longest)
        tokens = sizes * cost.padded_length(longest)
    else:  # one row per pack, its length rounded up
        costs = plan.batch_costs(lengths, cost)
        tokens = cost.padded_length(np.add.reduceat(lengths[plan.order].astype(np.int64), plan.offsets[:-1]))
    steps = -(-len(costs) // world)
    padded = np.zeros(steps * world)  # a partial last step, filled with batches that cost nothing
    padded[: len(costs)] = costs
    per_step = padded.reshape(steps, world)
    use = costs / budget
    bound = lower_bound_steps(lengths, cost, float(np.max(budget)), world, unit=unit)
    return PlanStats(
        num_samples=len(lengths),
        num_batches=len(sizes),
        num_steps=steps,
        padding_efficiency=float(lengths[plan.order].sum() / tokens.sum()),
        cost_efficiency=float(unit[plan.order].sum() / costs.sum()),
        # One budget: divide the mean once (the benchmarks' figures were computed so).
        mean_budget_use=float(costs.mean() / budget if np.ndim(budget) == 0 else use.mean()),
        max_budget_use=float(use.max()),
        mean_batch_size=float(sizes.mean()),
        max_batch_size=int(sizes.max()),
        num_skipped=skipped,
        num_dropped=dropped,
        steps_over_lower_bound=steps / bound if bound > 0 else math.inf,  # 0: underflow at a huge budget
        step_balance=float(per_step.sum() / (world * per_step.max(axis=1).sum())),
    )
