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
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tokenbatch._pack import fit_count, pack_sorted

if TYPE_CHECKING:
    from tokenbatch.cost import CostModel

__all__ = [
    "OVERSIZE_POLICIES",
    "OversizeSampleError",
    "Plan",
    "fit_count",
    "oversize_error",
    "pack_sorted",
    "plan_batches",
]

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
    says where each step begins. :func:`tokenbatch.stats.batch_stats`
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
        """Each batch's cost: its size times the cost of its longest sample alone."""
        costs: np.ndarray = self.batch_sizes() * cost.sample_cost(self.batch_longest(lengths))
        return costs

    def first_steps(self, steps: int) -> Plan:
        """The plan cut after ``steps`` global steps."""
        end = self.step_start(steps)
        starts = None if self.step_starts is None else self.step_starts[: steps + 1]
        return Plan(
            self.order[: self.offsets[end]], self.offsets[: end + 1], self.num_replicas,
            self.skipped, self.dropped, starts,
        )  # fmt: skip

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


def oversize_error(
    too_big: np.ndarray, keys: np.ndarray, unit: np.ndarray, budget: float
) -> OversizeSampleError:
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
    """``concatenate([source[s:s + n] for s, n in zip(starts, sizes)])`` without the loop."""
    ends = np.cumsum(sizes)
    shift = np.repeat(starts - (ends - sizes), sizes)
    gathered: np.ndarray = source[np.arange(int(ends[-1]) if len(ends) else 0) + shift]
    return gathered


def plan_batches(
    indices: np.ndarray,
    keys: np.ndarray,
    unit: np.ndarray,
    budget: float,
    *,
    rng: np.random.Generator | None,
    num_replicas: int = 1,
    max_batch_size: int | None = None,
    batch_size_multiple: int = 1,
    drop_last: bool = False,
    oversize: str = "error",
    admitted: float | None = None,
) -> Plan:
    """Plan batches for the samples ``indices`` under ``budget``.

    Args:
        indices: the sample indices to plan (all of them, or what is left).
        keys: padded length of every sample in the dataset (sort key).
        unit: cost of every sample alone, nondecreasing in ``keys``.
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
    indices = np.asarray(indices, dtype=np.int64)
    sub_unit = unit[indices]
    too_big = sub_unit > budget
    skipped = np.empty(0, np.int64)
    alone = np.empty(0, np.int64)
    if too_big.any():
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

    if rng is None:
        order = indices[np.argsort(_small_int(keys[indices]), kind="stable")]
    else:
        shuffled = rng.permutation(indices)
        order = shuffled[np.argsort(_small_int(keys[shuffled]), kind="stable")]

    unit_sorted = unit[order]
    pack = functools.partial(
        pack_sorted,
        unit_sorted,
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
        order = np.concatenate([order, alone])
        sizes = np.concatenate([sizes, np.ones(len(alone), np.int64)])
        unit_sorted = unit[order]
    starts = np.cumsum(sizes) - sizes

    dropped = np.empty(0, np.int64)
    if len(sizes) % num_replicas:
        costs = sizes * unit_sorted[starts + sizes - 1]
        split = None if drop_last else _split_to_multiple(starts, sizes, num_replicas, batch_size_multiple)
        if split is not None:
            starts, sizes = split
        elif drop_last:
            cheapest = np.argsort(costs, kind="stable")[: len(sizes) % num_replicas]
            keep = np.ones(len(sizes), bool)
            keep[cheapest] = False
            dropped = _gather_segments(order, starts[~keep], sizes[~keep])
            starts, sizes = starts[keep], sizes[keep]
        else:
            raise ValueError(
                f"cannot give each of num_replicas={num_replicas} ranks the same number of "
                f"batches: {int(sizes.sum())} samples need {len(sizes)} batches under "
                f"max_tokens={budget:g}, and splitting them would leave a batch empty; "
                f"use drop_last=True, a larger max_tokens, or fewer processes"
            )

    batch_order = _arrange_steps(sizes * unit_sorted[starts + sizes - 1], num_replicas, rng)
    starts, sizes = starts[batch_order], sizes[batch_order]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    return Plan(_gather_segments(order, starts, sizes), offsets, num_replicas, skipped, dropped)


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
        return keys.astype(np.int16)
    return keys
