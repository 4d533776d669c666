"""One stats function for every batching: a plan's batch lengths, costs and statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.plan import Plan, PlanStats, batch_stats, lower_bound_steps


@st.composite
def batchings(draw: st.DrawFn) -> tuple[Plan, np.ndarray, CostModel, float | np.ndarray]:
    n = draw(st.integers(1, 60))
    lengths = np.array(draw(st.lists(st.integers(1, 300), min_size=n, max_size=n)))
    order = np.random.default_rng(draw(st.integers(0, 2**32 - 1))).permutation(n)
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)) if n > 1 else set())
    offsets = np.array([0, *cuts, n], dtype=np.int64)
    plan = Plan(order, offsets, num_replicas=draw(st.integers(1, 4)))
    cost = CostModel(
        linear=draw(st.sampled_from([1.0, 0.5])),
        quadratic=draw(st.sampled_from([0.0, 1 / 64])),
        per_sample=draw(st.sampled_from([0.0, 16.0])),
        pad_to_multiple_of=draw(st.sampled_from([1, 8])),
    )
    budget: float | np.ndarray = float(draw(st.integers(100, 10**6)))
    if draw(st.booleans()):  # a re-planned epoch: a budget per batch
        budget = np.array(
            draw(
                st.lists(
                    st.sampled_from([budget, budget / 2]), min_size=len(cuts) + 1, max_size=len(cuts) + 1
                )
            )
        )
    return plan, lengths, cost, budget


@settings(max_examples=200, deadline=None)
@given(batchings())
def test_batch_stats_match_a_batch_by_batch_count(case: tuple[Plan, np.ndarray, CostModel, float]) -> None:
    plan, lengths, cost, budget = case
    batches = [plan.batch(b) for b in range(plan.num_batches)]
    pad = cost.pad_to_multiple_of
    longest = [int(lengths[b].max()) for b in batches]
    padded = [-(-n // pad) * pad for n in longest]
    costs = [cost.cost(len(b), n) for b, n in zip(batches, longest, strict=True)]
    budgets = np.broadcast_to(budget, len(batches))
    assert plan.batch_longest(lengths).tolist() == longest
    assert plan.batch_costs(lengths, cost).tolist() == pytest.approx(costs)

    stats = batch_stats(plan, lengths, cost, budget)
    world = plan.num_replicas
    steps = math.ceil(len(batches) / world)
    per_step = [max(costs[s * world : (s + 1) * world]) for s in range(steps)]
    alone = sum(cost.cost(1, int(n)) for n in lengths)
    assert stats.num_samples == len(lengths) and stats.num_batches == len(batches)
    assert stats.num_steps == steps
    assert stats.padding_efficiency == pytest.approx(
        lengths.sum() / sum(len(b) * p for b, p in zip(batches, padded, strict=True))
    )
    assert stats.cost_efficiency == pytest.approx(alone / sum(costs))
    assert stats.mean_budget_use == pytest.approx(np.mean(np.array(costs) / budgets))
    assert stats.max_budget_use == pytest.approx(max(np.array(costs) / budgets))
    assert stats.mean_batch_size == pytest.approx(len(lengths) / len(batches))
    assert stats.max_batch_size == max(len(b) for b in batches)
    assert stats.steps_over_lower_bound == pytest.approx(steps / (alone / budgets.max() / world))
    assert stats.step_balance == pytest.approx(sum(costs) / (world * sum(per_step)))
    assert lower_bound_steps(lengths, cost, float(budgets.max()), world) == pytest.approx(
        alone / budgets.max() / world
    )


def test_an_empty_plan_has_zero_stats() -> None:
    plan = Plan(np.empty(0, np.int64), np.zeros(1, np.int64), 2, skipped=np.array([0, 1]))
    lengths = np.array([500, 600])
    assert plan.batch_longest(lengths).tolist() == plan.batch_costs(lengths, CostModel()).tolist() == []
    assert batch_stats(plan, lengths, CostModel(), 100.0) == PlanStats(
        2, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 2, 0, 0.0, 0.0
    )
    sampler = TokenBudgetBatchSampler([500, 600], 100, oversize="skip")
    assert sampler.stats() == PlanStats(2, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, 2, 0)


def test_sampler_stats_measure_the_plan_under_the_budget_of_each_batch() -> None:
    lengths = np.random.default_rng(0).integers(1, 200, 500)
    sampler = TokenBudgetBatchSampler(
        lengths, 2048, cost=CostModel(pad_to_multiple_of=8), seed=1, num_replicas=2
    )
    before = sampler.stats()
    assert before == batch_stats(sampler.plan, sampler.lengths, sampler.cost, 2048.0)
    assert before.steps_over_lower_bound >= 1.0 and 0 < before.step_balance <= 1.0
    sampler.replan(1024, steps_done=3)
    after = sampler.stats()
    budgets = np.where(np.arange(after.num_batches) < 3 * 2, 2048.0, 1024.0)
    assert after == batch_stats(sampler.plan, sampler.lengths, sampler.cost, budgets)
    # The costliest batch under 2048 is in the first steps: measured against 1024 it would be over budget.
    assert (
        after.max_budget_use
        <= 1.0
        < float((sampler.plan.batch_costs(sampler.lengths, sampler.cost) / 1024).max())
    )
    # The lower bound takes the largest budget in force (it stays a lower bound).
    assert after.steps_over_lower_bound == pytest.approx(
        after.num_steps / lower_bound_steps(lengths, sampler.cost, 2048.0, 2)
    )
