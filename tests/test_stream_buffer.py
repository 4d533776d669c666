"""The stream's buffer: the same length order and the same draws however its examples arrive.

A reader inserts its first buffer in chunks (to keep the memory of the
first fill low) where a resume inserts what was pending in one go: both must
hold the very same order, bucket costs and batches.
"""

from __future__ import annotations

import itertools

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel
from tokenbatch.stream._buffer import Buffer, estimate_boundaries, tie_breaks


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 200), min_size=1, max_size=300),
    cuts=st.lists(st.integers(0, 300), max_size=6),
    salt=st.integers(0, 2**62),
    draws=st.lists(st.tuples(st.floats(0, 0.999), st.floats(0, 0.999), st.floats(0, 0.999)), max_size=8),
)
def test_adding_in_chunks_holds_and_draws_what_one_add_does(
    lengths: list[int], cuts: list[int], salt: int, draws: list[tuple[float, float, float]]
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
    for shared, first, second in draws:
        if not len(whole):
            break
        run = whole.draw(shared, [first, second])
        assert parts.draw(shared, [first, second]) == run
        taken.append(whole.take(*run))
        assert parts.take(*run) == taken[-1]
    rest = [
        [buffer.take_slots(slots) for slots in buffer.plan_rest(np.random.default_rng(7))]
        for buffer in (whole, parts)
    ]
    assert rest[0] == rest[1]
    assert sorted(e for batch in taken + rest[0] for e in batch) == sorted(examples)
