"""Hypothesis cases for the sampler's resume tests (tests/test_sampler_resume.py, test_sampler_world.py).

The tests import this file by path (the tests directory is not a package).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings
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


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]
