"""The pure planner: how many samples fit a budget, and plans under any finite budget."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.plan import fit_count

HUGE_BUDGETS = [1e30, sys.float_info.max, 2.0**53 + 2, 9.0e15]


@settings(max_examples=300, deadline=None)
@given(
    unit=st.floats(1e-6, 1e12) | st.sampled_from([1.0, 3.0, 0.1, 1 / 3]),
    budget=st.floats(1e-6, sys.float_info.max) | st.sampled_from(HUGE_BUDGETS),
    most=st.integers(1, 10**6) | st.sampled_from([10**18, 2**53 + 1]),
)
def test_fit_count_is_the_largest_count_that_fits(unit: float, budget: float, most: int) -> None:
    count = fit_count(unit, budget, most)
    assert 0 <= count <= most
    # The same float product the cost model computes decides, on both sides of the answer.
    assert count * unit <= budget
    assert count == most or (count + 1) * unit > budget


def test_fit_count_examples() -> None:
    assert fit_count(3.0, 10.0, 100) == 3
    assert fit_count(3.0, 10.0, 2) == 2
    assert fit_count(4.0, 3.0, 100) == 0
    assert fit_count(0.1, 0.3, 100) == 2  # 3 * 0.1 is 0.30000000000000004 in floats
    assert fit_count(1.0, sys.float_info.max, 7) == 7


@pytest.mark.timeout(20)
@pytest.mark.parametrize("max_tokens", [1e30, sys.float_info.max])
@pytest.mark.parametrize("world", [1, 3])
def test_a_huge_finite_budget_plans_at_once(max_tokens: float, world: int) -> None:
    """Issue 11 item 6: "no limit" spelled as a huge number (the count loop never settled above 2**53)."""
    lengths = np.random.default_rng(0).integers(1, 500, 1000)
    for cost in (CostModel(), CostModel.attention(64, pad_to_multiple_of=8)):
        sampler = TokenBudgetBatchSampler(lengths, max_tokens, cost=cost, seed=1, num_replicas=world)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(1000))
        assert len(batches) % world == 0
        assert sampler.stats().max_budget_use <= 1.0
        sampler.replan(max_tokens / 2, steps_done=0)
        assert sorted(i for b in sampler for i in b) == list(range(1000))
