"""Property tests of the batching invariants in DESIGN.md, over wide ranges of input."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel, OversizeSampleError, TokenBudgetBatchSampler

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Equal lengths are one of the corner cases drawn on purpose; the sampler warns about them.
pytestmark = pytest.mark.filterwarnings("ignore:TokenBudgetBatchSampler. all .* same length")


@st.composite
def length_lists(draw: st.DrawFn) -> list[int]:
    """Lengths shaped like real data and like its corner cases."""
    n = draw(st.integers(1, 250))
    shape = draw(st.sampled_from(["uniform", "equal", "outlier", "narrow", "longtail"]))
    if shape == "equal":
        return [draw(st.integers(1, 600))] * n
    if shape == "narrow":
        low = draw(st.integers(1, 100))
        return draw(st.lists(st.integers(low, low + 3), min_size=n, max_size=n))
    if shape == "longtail":
        seed = draw(st.integers(0, 2**32 - 1))
        values = np.random.default_rng(seed).lognormal(np.log(40), 1.0, n)
        return np.clip(np.round(values), 1, 3000).astype(int).tolist()
    lengths = draw(st.lists(st.integers(1, 512), min_size=n, max_size=n))
    if shape == "outlier":
        lengths[draw(st.integers(0, n - 1))] = draw(st.integers(2000, 20000))
    return lengths


@st.composite
def cost_models(draw: st.DrawFn) -> CostModel:
    return CostModel(
        linear=draw(st.sampled_from([1.0, 0.5, 3.0])),
        quadratic=draw(st.sampled_from([0.0, 0.0, 1 / 1024, 1 / 64])),
        per_sample=draw(st.sampled_from([0.0, 0.0, 16.0])),
        pad_to_multiple_of=draw(st.sampled_from([1, 1, 8, 64])),
    )


@dataclass
class Case:
    lengths: list[int]
    max_tokens: float
    kwargs: dict[str, Any]

    def sampler(self, **extra: Any) -> TokenBudgetBatchSampler:
        return TokenBudgetBatchSampler(self.lengths, self.max_tokens, **{**self.kwargs, **extra})


@st.composite
def cases(draw: st.DrawFn, oversize: str | None = None) -> Case:
    lengths = draw(length_lists())
    cost = draw(cost_models())
    units = cost.sample_cost(np.asarray(lengths))
    # Budgets from below the largest sample (oversize) to room for everything at once.
    scale = draw(st.sampled_from([0.5, 1.0, 1.0, 1.7, 5.0, 40.0, 1e6]))
    max_tokens = float(units.max()) * scale
    policy = oversize or draw(st.sampled_from(["alone", "skip"] if scale < 1 else ["error", "alone"]))
    kwargs = {
        "cost": cost,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "max_batch_size": draw(st.sampled_from([None, None, 1, 3, 64])),
        "batch_size_multiple": draw(st.sampled_from([1, 1, 2, 8])),
        "drop_last": draw(st.booleans()),
        "oversize": policy,
        "num_replicas": draw(st.integers(1, 8)),
    }
    return Case(lengths, max_tokens, kwargs)


def planned(case: Case, **extra: Any) -> TokenBudgetBatchSampler | None:
    """The global sampler, or None when the case cannot give every rank a batch."""
    sampler = case.sampler(**extra)
    try:
        sampler.plan  # noqa: B018 - make the plan now
    except OversizeSampleError:
        raise
    except ValueError as error:
        assert "cannot give each of" in str(error)
        assert not case.kwargs["drop_last"]
        event("too few samples for the ranks")
        return None
    return sampler


def batch_cost(sampler: TokenBudgetBatchSampler, batch: list[int]) -> float:
    longest = int(np.max(sampler.lengths[batch]))
    return sampler.cost.cost(len(batch), longest)


def check_plan(sampler: TokenBudgetBatchSampler, batches: list[list[int]], budgets: list[float]) -> None:
    """Invariants 1 and 2 for one epoch's global batches made under ``budgets``."""
    world = sampler.num_replicas
    plan = sampler.plan
    seen = np.concatenate([np.asarray(b, dtype=np.int64) for b in batches]) if batches else np.empty(0)
    left_out = np.concatenate([plan.skipped, plan.dropped])
    everything = np.sort(np.concatenate([seen, left_out]))
    # 1. every index exactly once, or documented as skipped/dropped
    np.testing.assert_array_equal(everything, np.arange(len(sampler.lengths)))
    if sampler.oversize != "skip":
        assert len(plan.skipped) == 0
    if not sampler.drop_last:
        assert len(plan.dropped) == 0
    # skipped samples really are too big for the budget
    if len(plan.skipped):
        smallest = min(budgets, default=sampler.max_tokens)
        assert np.all(sampler.cost.sample_cost(sampler.lengths[plan.skipped]) > smallest)
    # 2. within budget, unless a lone oversize sample
    for batch, budget in zip(batches, budgets, strict=True):
        assert len(batch) >= 1
        if batch_cost(sampler, batch) > budget:
            assert sampler.oversize == "alone" and len(batch) == 1
        if sampler.max_batch_size is not None:
            assert len(batch) <= sampler.max_batch_size
    # 3. every rank the same number of batches
    assert len(batches) % world == 0


@SETTINGS
@given(cases())
def test_every_index_once_within_budget_equal_ranks(case: Case) -> None:
    sampler = planned(case)
    if sampler is None:
        return
    batches = list(sampler)
    assert len(batches) == len(sampler)  # 5.
    check_plan(sampler, batches, [sampler.max_tokens] * len(batches))


@SETTINGS
@given(cases())
def test_rank_mode_yields_the_global_plan_sharded(case: Case) -> None:
    sampler = planned(case)
    if sampler is None:
        return
    world = sampler.num_replicas
    global_batches = list(sampler)
    per_rank = []
    for rank in range(world):
        local = case.sampler(rank=rank)
        batches = list(local)
        assert len(batches) == len(local)
        assert batches == global_batches[rank::world]
        per_rank.append(len(batches))
    assert len(set(per_rank)) == 1


@SETTINGS
@given(cases(), st.integers(0, 3))
def test_plan_is_pure_and_costliest_step_first(case: Case, epoch: int) -> None:
    first = planned(case)
    if first is None:
        return
    first.set_epoch(epoch)
    second = case.sampler()
    second.set_epoch(epoch)
    batches = list(first)
    assert batches == list(second)  # 4. a pure function of the inputs
    if not batches:
        return
    world = first.num_replicas
    costs = np.array([batch_cost(first, b) for b in batches]).reshape(-1, world)
    assert costs[0].max() == costs.max()
    # Steps hold batches of similar cost: their cost ranges do not interleave.
    ranges = sorted((row.min(), row.max()) for row in costs)
    for (_, high), (next_low, _) in itertools.pairwise(ranges):
        assert high <= next_low


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 4))
def test_shuffled_plans_differ_between_epochs(seed: int, world: int) -> None:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(5, 15, size=400)
    sampler = TokenBudgetBatchSampler(lengths, 300, seed=seed, num_replicas=world)
    epoch0 = list(sampler)
    sampler.set_epoch(1)
    assert list(sampler) != epoch0
    unshuffled = TokenBudgetBatchSampler(lengths, 300, shuffle=False, num_replicas=world)
    epoch0 = list(unshuffled)
    unshuffled.set_epoch(1)
    assert list(unshuffled) == epoch0


@SETTINGS
@given(cases(), st.data())
def test_resume_at_any_position_yields_exactly_the_rest(case: Case, data: st.DataObject) -> None:
    sampler = planned(case)
    if sampler is None:
        return
    world = sampler.num_replicas
    batches = list(sampler)
    steps = len(batches) // world
    done = data.draw(st.integers(0, steps))
    state = sampler.state_dict(steps_done=done)
    resumed = case.sampler()
    resumed.load_state_dict(state)
    assert len(resumed) == len(batches) - done * world
    assert list(resumed) == batches[done * world :]
    # ... and per rank, for plain DDP loops
    rank = data.draw(st.integers(0, world - 1))
    local = case.sampler(rank=rank)
    local.load_state_dict(state)  # the global sampler's state: the rank is not compared
    assert list(local) == batches[done * world + rank :: world]
    # After the resumed epoch the next pass is a whole epoch again.
    assert list(resumed) == batches


@SETTINGS
@given(cases(oversize="alone"), st.data())
def test_replan_mid_epoch_keeps_every_sample_once(case: Case, data: st.DataObject) -> None:
    sampler = planned(case)
    if sampler is None:
        return
    world = sampler.num_replicas
    old_budget = sampler.max_tokens
    before = list(sampler)
    done = data.draw(st.integers(0, len(before) // world))
    factor = data.draw(st.sampled_from([0.5, 0.25, 0.9, 2.0]))
    try:
        sampler.replan(old_budget * factor, steps_done=done)
    except ValueError as error:
        assert "cannot give each of" in str(error)
        event("re-plan: too few samples for the ranks")
        return
    event("re-plan after some steps" if done else "re-plan before the first step")
    expected = len(sampler)
    rest = list(sampler)
    assert len(rest) == expected
    batches = before[: done * world] + rest
    budgets = [old_budget] * (done * world) + [old_budget * factor] * len(rest)
    check_plan(sampler, batches, budgets)
    assert sampler.max_tokens == old_budget * factor
    # A second re-plan on top of the first, then resume from a state_dict.
    if rest:
        more = data.draw(st.integers(done, len(batches) // world))
        try:
            sampler.replan(old_budget * factor / 2, steps_done=more)
        except ValueError as error:  # e.g. 25 single-sample batches cannot make 2 equal shares
            assert "cannot give each of" in str(error)
            assert sampler.max_tokens == old_budget * factor  # unchanged by the failed re-plan
            return
        state = sampler.state_dict()
        assert state["steps_done"] == more
        tail = list(sampler)
        resumed = case.sampler()
        resumed.load_state_dict(state)
        assert list(resumed) == tail
        assert resumed.max_tokens == old_budget * factor / 2
        final = batches[: more * world] + tail
        check_plan(sampler, final, budgets[: more * world] + [old_budget * factor / 2] * len(tail))


@settings(max_examples=100, deadline=None)
@given(length_lists(), st.integers(1, 8))
def test_oversize_error_names_sample_and_fix(lengths: list[int], world: int) -> None:
    largest = max(lengths)
    with pytest.raises(OversizeSampleError) as raised:
        TokenBudgetBatchSampler(lengths, largest - 0.5, num_replicas=world)
    message = str(raised.value)
    index = lengths.index(largest)
    assert f"sample {index} " in message
    assert f"padded length {largest}" in message
    assert f"at least {largest}" in message
    assert "oversize='alone'" in message


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_fewer_samples_than_ranks(world: int) -> None:
    lengths = [5, 7, 9]
    if world <= 3:
        sampler = TokenBudgetBatchSampler(lengths, 100, num_replicas=world)
        batches = list(sampler)
        assert len(batches) % world == 0 and len(batches) == len(sampler)
        assert sorted(i for b in batches for i in b) == [0, 1, 2]
        return
    with pytest.raises(ValueError, match="use drop_last=True, a larger max_tokens, or fewer processes"):
        len(TokenBudgetBatchSampler(lengths, 100, num_replicas=world))
    dropping = TokenBudgetBatchSampler(lengths, 100, num_replicas=world, drop_last=True)
    assert list(dropping) == [] and len(dropping) == 0
    assert sorted(dropping.plan.dropped.tolist()) == [0, 1, 2]


@SETTINGS
@given(cases(), st.integers(0, 5))
def test_shuffling_costs_no_extra_batch(case: Case, epoch: int) -> None:
    """Random tie-breaks and boundary shifts keep the greedy (fewest) batch count."""
    sampler = planned(case, shuffle=True)
    if sampler is None:
        return
    sampler.set_epoch(epoch)
    assert len(sampler) == len(case.sampler(shuffle=False))
