"""The stream's buffer: the same length order and the same draws however its examples arrive.

A reader inserts its first buffer in chunks (to keep the memory of the
first fill low) where a resume inserts what was pending in one go: both must
hold the very same order, bucket costs and batches.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel
from tokenbatch.stream._buffer import Buffer, estimate_boundaries, tie_breaks


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    salt=st.integers(0, 2**62),
    draws=st.lists(st.tuples(st.floats(0, 0.999), st.floats(0, 0.999)), max_size=8),
)
def test_adding_in_chunks_holds_and_draws_what_one_add_does(
    lengths: list[int], cuts: list[int], salt: int, draws: list[tuple[float, float]]
) -> None:
    cost = CostModel(quadratic=1 / 64)
    padded = np.array(lengths, np.int64)
    unit = cost.sample_cost(padded)
    positions = np.arange(len(lengths))
    ties = tie_breaks(positions, salt)
    examples = [f"example {i}" for i in range(len(lengths))]
    budget = float(unit.max()) * 3
    boundaries = estimate_boundaries(padded, unit, 4)

    whole = Buffer(budget, boundaries)
    whole.add(positions, padded, unit, ties, examples)
    parts = Buffer(budget, boundaries)
    bounds = [0, *sorted(min(c, len(lengths)) for c in cuts), len(lengths)]
    for a, b in itertools.pairwise(bounds):
        if b > a:
            parts.add(positions[a:b], padded[a:b], unit[a:b], ties[a:b], examples[a:b])

    # The order is the stable sort of (padded length, tie-break) in read order.
    expected = np.argsort((padded << 32) | ties, kind="stable")
    for buffer in (whole, parts):
        assert buffer.positions().tolist() == expected.tolist()
        assert buffer.unit.tolist() == unit[expected].tolist()
        assert buffer.items[buffer.slot].tolist() == [examples[i] for i in expected]
    assert whole._bucket_cost.tolist() == parts._bucket_cost.tolist()
    taken = []
    for shared, local in draws:
        if not len(whole):
            break
        run = whole.draw(shared, local)
        assert parts.draw(shared, local) == run
        taken.append(whole.take(*run))
        assert parts.take(*run) == taken[-1]
    rest = [
        [buffer.take_slots(slots) for slots in buffer.plan_rest(np.random.default_rng(7))]
        for buffer in (whole, parts)
    ]
    assert rest[0] == rest[1]
    assert sorted(e for batch in taken + rest[0] for e in batch) == sorted(examples)


@settings(max_examples=300, deadline=None)
@example(  # a bucket where padding per count (not count**1.5) would choose another run
    lengths=[1, 1, 47, 47, 47, 129, 150, 150, 150, 184], budget_in_longest=7.0, shared=0.5, local=0.0
)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=200),
    budget_in_longest=st.floats(0.5, 12),
    shared=st.floats(0, 0.999),
    local=st.floats(0, 0.999),
)
def test_a_draw_is_the_least_padded_full_run_ending_in_the_bucket(
    lengths: list[int], budget_in_longest: float, shared: float, local: float
) -> None:
    """Against a brute force over every run: within the budget, and no full run of the bucket scores lower."""
    cost = CostModel(quadratic=1 / 64)
    padded = np.array(lengths, np.int64)
    unit = cost.sample_cost(padded)
    budget = float(unit.max()) * budget_in_longest  # below 1: the longest are oversize, drawn alone
    buffer = Buffer(budget, estimate_boundaries(padded, unit, 4))
    buffer.add(np.arange(len(lengths)), padded, unit, tie_breaks(np.arange(len(lengths)), 5), list(lengths))
    start, stop = buffer.draw(shared, local)
    held, costs = buffer.padded(), buffer.unit
    assert 0 <= start < stop <= len(held)
    assert stop - start == 1 or (stop - start) * costs[stop - 1] <= budget

    line = np.cumsum(buffer._bucket_cost)
    bucket = min(int(line.searchsorted(shared * line[-1], side="right")), len(line) - 1)
    first, last = buffer._bucket_range(bucket)

    def score(begin: int, end: int) -> float:
        run = held[begin:end]
        return float((len(run) * run[-1] - run.sum()) / len(run) ** 1.5)

    full = []  # (score, start, stop) of every full run ending in the bucket
    for end in range(first, last):
        count = max(1, int(budget // costs[end]))
        while count > 1 and count * costs[end] > budget:
            count -= 1
        if count <= end + 1:
            full.append((score(end + 1 - count, end + 1), end + 1 - count, end + 1))
    if not full:  # no full run ends in the bucket: the run from its first example on, or the last run
        assert start == first or stop == len(held)
        return
    assert first < stop <= last
    assert (start, stop) in [(b, e) for _, b, e in full]
    assert score(start, stop) <= min(s for s, _, _ in full) + 1e-9
