"""Resuming a TokenBudgetBatchSampler: exact default position, atomic loads, any rank, any world size."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbatch import CostModel, TokenBudgetBatchSampler

SETTINGS = settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass
class Case:
    lengths: list[int]
    max_tokens: float
    kwargs: dict[str, Any]

    def sampler(self, **extra: Any) -> TokenBudgetBatchSampler:
        return TokenBudgetBatchSampler(self.lengths, self.max_tokens, **{**self.kwargs, **extra})


@st.composite
def cases(draw: st.DrawFn) -> Case:
    """Data and settings whose plan gives every rank a batch (oversize samples get one of their own)."""
    n = draw(st.integers(20, 200))  # enough for 8 ranks: every rank gets a batch
    seed = draw(st.integers(0, 2**32 - 1))
    lengths = np.clip(np.round(np.random.default_rng(seed).lognormal(np.log(40), 1.0, n)), 1, 2000)
    cost = draw(st.sampled_from([CostModel(), CostModel(quadratic=1 / 256), CostModel(pad_to_multiple_of=8)]))
    largest = float(cost.sample_cost(lengths).max())
    max_tokens = largest * draw(st.sampled_from([0.7, 1.0, 1.5, 4.0, 20.0]))
    kwargs = {
        "cost": cost,
        "shuffle": draw(st.booleans()),
        "seed": draw(st.integers(0, 2**31)),
        "max_batch_size": draw(st.sampled_from([None, None, 3, 16])),
        "drop_last": draw(st.booleans()),
        "oversize": "alone",
    }
    return Case(lengths.astype(int).tolist(), max_tokens, kwargs)


def loader(sampler: TokenBudgetBatchSampler) -> DataLoader[int]:
    """What a training loop without workers reads: one batch from the sampler per batch it yields."""
    return DataLoader(list(range(len(sampler.lengths))), batch_sampler=sampler, collate_fn=list)


# -- item 8: the default position is the batches taken --------------------------------------


@SETTINGS
@given(cases(), st.integers(1, 4), st.booleans(), st.data())
def test_default_state_after_k_batches_resumes_with_exactly_the_rest(
    case: Case, world: int, per_rank: bool, data: st.DataObject
) -> None:
    rank = data.draw(st.integers(0, world - 1)) if per_rank else None
    everything = list(loader(case.sampler(num_replicas=world, rank=rank)))
    sampler = case.sampler(num_replicas=world, rank=rank)
    per_step = 1 if per_rank else world  # the global plan yields every rank's batch of a step
    steps = data.draw(st.integers(0, len(everything) // per_step))
    taken = list(itertools.islice(iter(loader(sampler)), steps * per_step))
    state = sampler.state_dict()  # no steps_done: what the sampler counted itself
    assert state["steps_done"] == steps
    resumed = case.sampler(num_replicas=world, rank=rank)
    resumed.load_state_dict(state)
    rest = list(loader(resumed))
    assert taken + rest == everything
    assert len(rest) == len(everything) - steps * per_step


# -- item 10: any rank loads any rank's state ------------------------------------------------


@SETTINGS
@given(cases(), st.integers(2, 8), st.data())
def test_every_rank_resumes_from_the_state_one_rank_saved(
    case: Case, world: int, data: st.DataObject
) -> None:
    reference = case.sampler(num_replicas=world)
    batches = list(reference)
    steps = len(batches) // world
    done = data.draw(st.integers(0, steps))
    saver = data.draw(st.sampled_from([None, *range(world)]))  # "rank 0 saves", or the global sampler
    state = case.sampler(num_replicas=world, rank=saver).state_dict(steps_done=done)
    for rank in range(world):
        resumed = case.sampler(num_replicas=world, rank=rank)
        resumed.load_state_dict(state)
        assert list(resumed) == batches[done * world + rank :: world]
    resumed = case.sampler(num_replicas=world)
    resumed.load_state_dict(state)
    assert list(resumed) == batches[done * world :]
