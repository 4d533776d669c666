"""Step 2 of planning: pack samples sorted by cost into batches that fit a budget.

:func:`fit_count` is the one answer to "how many samples of this cost fit the
budget", wherever it is asked: packing here, the fixed batch size of
:mod:`tokenbatch.compare`, micro-batches of a batch that ran out of memory.
:func:`pack_sorted` cuts costs sorted in nondecreasing order into batches with
it. :mod:`tokenbatch.plan` re-exports both.
"""

from __future__ import annotations

import numpy as np


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
    n = len(unit_sorted)
    run_ends = np.append(np.flatnonzero(unit_sorted[1:] != unit_sorted[:-1]) + 1, n)
    pieces: list[np.ndarray] = []
    start = 0
    run = 0
    limit = budget if first_budget is None else min(first_budget, budget)
    # A batch never needs more than the n samples there are. Capping the count at
    # n + batch_size_multiple (not n) keeps a count rounded to the multiple above
    # n, so the batches are the ones an unbounded count makes.
    most = n + batch_size_multiple if max_batch_size is None else min(max_batch_size, n + batch_size_multiple)
    while start < n:
        while run_ends[run] <= start:
            run += 1
        unit = float(unit_sorted[start])
        room = fit_count(unit, limit, most)
        if room == 0:  # the first batch's share was too small for its first sample
            limit = budget
            continue
        full = _round_to_multiple(room, batch_size_multiple)
        if limit == budget:
            # Inside a run of equal costs every batch takes exactly `full`.
            repeats = (run_ends[run] - start) // full
            if repeats:
                pieces.append(np.full(repeats, full, dtype=np.int64))
                start += repeats * full
                if start == run_ends[run]:
                    continue
        # A batch that crosses into longer samples: the largest prefix whose
        # count times its (growing) last cost stays within the limit.
        window = unit_sorted[start : start + room]
        costs = window * np.arange(1, len(window) + 1)
        count = _round_to_multiple(int(np.searchsorted(costs, limit, side="right")), batch_size_multiple)
        pieces.append(np.array([count], dtype=np.int64))
        start += count
        limit = budget
    return np.concatenate(pieces) if pieces else np.empty(0, np.int64)
