"""The pure planner: how many samples fit a budget, and plans under any finite budget."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import sys
import tracemalloc
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch import plan as plan_module
from tokenbatch.plan import fit_count, pack_sorted

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


# -- memory at scale: the same plans, in far fewer bytes -------------------------------------------


def _plan_digest(sampler: TokenBudgetBatchSampler) -> str:
    digest = hashlib.sha1()
    for epoch in (0, 3):
        sampler.set_epoch(epoch)
        plan = sampler.plan
        for array in (plan.order, plan.offsets, plan.skipped, plan.dropped):
            digest.update(np.asarray(array, np.int64).tobytes())
    sampler.replan(sampler.max_tokens / 2, steps_done=2)
    digest.update(np.asarray(sampler.plan.order, np.int64).tobytes())
    return digest.hexdigest()[:16]


def _lognormal(n: int, seed: int = 0) -> np.ndarray:
    return np.clip(np.rint(np.random.default_rng(seed).lognormal(np.log(300), 1.0, n)), 8, 4096).astype(int)


# Digests of plans made by tokenbatch before planning was made lean (commit ce75d92): a checkpoint
# saved then holds a plan's history, not its batches, so it resumes to these very batches only if the
# planner still makes them.
EARLIER_PLANS = {
    "lognormal, quadratic, 2 ranks": (
        lambda: _lognormal(30_000),
        {"max_tokens": 131072, "cost": CostModel(quadratic=1 / 1024), "num_replicas": 2, "seed": 3},
        "472d7cebdea8a61e",
    ),
    "short, padded to 8, capped": (
        lambda: np.random.default_rng(1).integers(1, 90, 5_000),
        {
            "max_tokens": 2048,
            "cost": CostModel(pad_to_multiple_of=8),
            "max_batch_size": 64,
            "batch_size_multiple": 8,
            "num_replicas": 3,
        },
        "fce5a7ee49face86",
    ),
    "outliers alone, drop_last": (
        lambda: np.concatenate([np.random.default_rng(2).integers(5, 200, 3_000), [5000, 7000]]),
        {"max_tokens": 4096, "oversize": "alone", "drop_last": True, "num_replicas": 4},
        "77ccfe1bb3511b77",
    ),
    "long lengths, no shuffle": (
        lambda: np.random.default_rng(3).integers(1, 100_000, 2_000),
        {"max_tokens": 400_000, "shuffle": False},
        "0b0bcc1ab7b40864",
    ),
    "per-sample cost only": (
        lambda: np.random.default_rng(4).integers(1, 50, 1_000),
        {"max_tokens": 37, "cost": CostModel(linear=0, per_sample=1.0)},
        "ca8ac7ec49fd3776",
    ),
}


@pytest.mark.parametrize("name", list(EARLIER_PLANS))
def test_plans_are_the_ones_earlier_versions_made(name: str) -> None:
    lengths, options, digest = EARLIER_PLANS[name]
    sampler = TokenBudgetBatchSampler(lengths(), **options)
    assert _plan_digest(sampler) == digest
    # And a state saved then names the data as it did: its digest of the int64 lengths.
    earlier = hashlib.blake2b(np.asarray(lengths(), np.int64).tobytes(), digest_size=16).hexdigest()
    assert sampler.state_dict()["lengths_digest"] == earlier


def test_planning_two_million_lengths_holds_at_most_16_bytes_a_sample() -> None:
    # 57 bytes a sample before: int64 sort keys and float64 costs held per sample, an int64 argsort,
    # costs gathered in sorted order, and two int64 index arrays to lay the batches out.
    n = 2_000_000
    lengths = _lognormal(n)
    gc.collect()
    tracemalloc.start()
    sampler = TokenBudgetBatchSampler(lengths, 131072, cost=CostModel(quadratic=1 / 1024), seed=0)
    plan = sampler.plan
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak / n <= 16, f"{peak / n:.1f} bytes a sample"
    assert plan.order.dtype == np.int32 and len(plan.order) == n  # indices in 4 bytes where they fit


@contextlib.contextmanager
def _chunks_of(size: int) -> Iterator[None]:
    """Run the planner's loops over the samples in chunks of ``size``, so that small cases cross them."""
    default, plan_module._CHUNK = plan_module._CHUNK, size
    try:
        yield
    finally:
        plan_module._CHUNK = default


def _greedy(
    unit_sorted: np.ndarray, budget: float, most: int | None, multiple: int, first: float | None
) -> list[int]:
    """Greedy packing one sample at a time: each batch takes the most samples that fit with its last cost."""
    sizes, start, limit = [], 0, budget if first is None else min(first, budget)
    while start < len(unit_sorted):
        count = 0
        while (
            start + count < len(unit_sorted)
            and (most is None or count < most)
            and (count + 1) * unit_sorted[start + count] <= limit
        ):
            count += 1
        if count == 0:  # the first batch's share was too small for its first sample
            limit = budget
            continue
        sizes.append(count - count % multiple if count >= multiple else count)
        start += sizes[-1]
        limit = budget
    return sizes


@settings(max_examples=150, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=0, max_size=120),
    budget=st.floats(40, 400),
    most=st.none() | st.integers(1, 30),
    multiple=st.sampled_from([1, 2, 3, 8]),
    first=st.none() | st.floats(1, 400),
)
def test_packing_by_runs_is_greedy_packing(
    lengths: list[int], budget: float, most: int | None, multiple: int, first: float | None
) -> None:
    unit_sorted = CostModel(quadratic=1 / 16).sample_cost(np.sort(np.array(lengths, dtype=np.int64)))
    unit_sorted = unit_sorted[unit_sorted <= budget]  # what pack_sorted is given: each sample fits alone
    sizes = pack_sorted(
        unit_sorted, budget, max_batch_size=most, batch_size_multiple=multiple, first_budget=first
    )
    assert sizes.tolist() == _greedy(unit_sorted, budget, most, multiple, first)


@settings(max_examples=200, deadline=None)
@given(
    keys=st.lists(st.integers(0, 300), min_size=0, max_size=200)
    | st.lists(st.integers(0, 10**6), max_size=60),
    chunk=st.integers(1, 9),
    seed=st.integers(0, 3),
)
def test_sorting_and_gathering_in_chunks_is_argsort_and_concatenate(
    keys: list[int], chunk: int, seed: int
) -> None:
    key_array = np.array(keys, dtype=np.int64)
    source = np.random.default_rng(seed).permutation(len(keys)).astype(np.int32)
    low, high, counts, _ = plan_module._survey(source, key_array, key_array.astype(float))
    with _chunks_of(chunk):
        order, run_ends = plan_module._sort_by_key(source, key_array, low, high, counts, room=2)
    expected = source[np.argsort(key_array[source], kind="stable")]
    assert order[: len(keys)].tolist() == expected.tolist() and len(order) == len(keys) + 2
    sorted_keys = key_array[expected]
    assert run_ends.tolist() == [
        i + 1 for i in range(len(keys)) if i + 1 == len(keys) or sorted_keys[i] != sorted_keys[i + 1]
    ]
    sizes = np.random.default_rng(seed).integers(1, 6, len(keys) // 3 + 1)
    starts = np.random.default_rng(seed).integers(0, max(len(keys) - 5, 1), len(sizes))
    if len(keys) >= 6:
        with _chunks_of(chunk):
            gathered = plan_module._gather_segments(expected, starts, sizes)
        assert (
            gathered.tolist()
            == np.concatenate([expected[s : s + n] for s, n in zip(starts, sizes, strict=True)]).tolist()
        )


@pytest.mark.filterwarnings("ignore:TokenBudgetBatchSampler. all")
@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=150),
    world=st.integers(1, 3),
    seed=st.integers(0, 5),
    oversize=st.sampled_from(["alone", "skip"]),
)
def test_plans_in_chunks_are_the_plans_in_one_go(
    lengths: list[int], world: int, seed: int, oversize: str
) -> None:
    def plans() -> list[tuple[list[int], ...]]:
        sampler = TokenBudgetBatchSampler(
            lengths,
            600,
            cost=CostModel(quadratic=1 / 8),
            seed=seed,
            oversize=oversize,
            num_replicas=world,
            drop_last=True,
        )
        plan = sampler.plan
        return [(plan.order.tolist(), plan.offsets.tolist(), plan.skipped.tolist(), plan.dropped.tolist())]

    whole = plans()
    with _chunks_of(4):
        assert plans() == whole


# -- packs (CostModel(packing=...)) ---------------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=120),
    budget=st.integers(300, 3000),
    packing=st.sampled_from(["varlen", "full"]),
    quadratic=st.sampled_from([0.0, 1 / 256]),
    pad=st.sampled_from([1, 8]),
    most=st.integers(1, 50),
)
def test_no_example_of_a_later_pack_fits_in_an_earlier_one(
    lengths: list[int], budget: int, packing: str, quadratic: float, pad: int, most: int
) -> None:
    cost = CostModel(quadratic=quadratic, pad_to_multiple_of=pad, packing=packing)
    array = np.array(sorted(lengths, reverse=True))
    budget = max(budget, cost.batch_cost([array[0]]))
    position, sizes = plan_module._fill_packs(array, float(budget), cost, most)
    assert sorted(position.tolist()) == list(range(len(array)))  # every example once, whole
    packs = np.split(array[position], np.cumsum(sizes)[:-1])
    for i, pack in enumerate(packs):
        assert 0 < len(pack) <= most and cost.batch_cost(pack) <= budget
        if len(pack) == most:
            continue
        # Every example of a later pack came when pack i was there, and did not fit it (with the room
        # read on the safe side of pad_to_multiple_of's rounding): the packs are full.
        for later in np.concatenate([[0], *packs[i + 1 :]])[1:]:
            assert cost.batch_cost([*pack, later + 2 * (pad - 1)]) > budget


@pytest.mark.parametrize(
    ("name", "lengths", "budget"),
    [
        (
            "emotion-like",
            np.clip(np.rint(np.random.default_rng(0).lognormal(np.log(20), 0.5, 16000)), 3, 87),
            2048,
        ),
        (
            "imdb-like",
            np.clip(np.rint(np.random.default_rng(1).lognormal(np.log(230), 0.75, 25000)), 10, 3127),
            4096,
        ),
        (
            "lognormal",
            np.clip(np.rint(np.random.default_rng(2).lognormal(np.log(300), 0.9, 20000)), 10, 8000),
            8192,
        ),
    ],
)
def test_packs_fill_the_budget_and_two_ranks_get_the_same_work(
    name: str, lengths: np.ndarray, budget: int
) -> None:
    lengths = lengths.astype(np.int64)
    sampler = TokenBudgetBatchSampler(
        lengths, max_tokens=budget, cost=CostModel(packing="varlen"), num_replicas=2, rank=0, seed=3
    )
    plan = sampler.plan
    seen = np.bincount(plan.order, minlength=len(lengths))
    assert (seen == 1).all()
    tokens = np.add.reduceat(lengths[plan.order], plan.offsets[:-1]).astype(np.float64)
    squares = np.add.reduceat(lengths[plan.order].astype(np.float64) ** 2, plan.offsets[:-1])
    assert tokens.max() <= budget and tokens.mean() / budget >= 0.99, name
    for work in (tokens, squares):  # per step, the busiest rank over the mean rank
        steps = work[: len(work) // 2 * 2].reshape(-1, 2)
        assert (steps.max(axis=1) / steps.mean(axis=1)).mean() <= 1.02, name
    sampler.set_epoch(1)
    again = sampler.plan
    mates = {frozenset(plan.batch(b).tolist()) for b in range(plan.num_batches)}
    assert sum(frozenset(again.batch(b).tolist()) in mates for b in range(again.num_batches)) < 0.1 * len(
        mates
    )
