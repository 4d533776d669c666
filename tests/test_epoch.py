"""Where the epoch is belongs to the loop that trains: the guard's count, its pass, its restarts.

The sampler keeps no loop state: it yields its plan, counts only what it
yielded itself, and is moved through its public methods. These tests follow
the guard's pass over accelerate's one-process DataLoader (which reads a batch
ahead and registers with accelerate's GradientState).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.state import GradientState
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.oom._guard import _Batches

LENGTHS = np.random.default_rng(0).integers(4, 60, size=300)
INDICES = list(range(len(LENGTHS)))


def shard(sampler: TokenBudgetBatchSampler) -> DataLoaderShard:
    """accelerate's one-process DataLoader: reads a batch ahead, registers with GradientState."""
    return DataLoaderShard(INDICES, batch_sampler=sampler, collate_fn=list)


def test_restart_after_a_replan_yields_the_rest_of_the_new_plan_once() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    batches = _Batches(shard(sampler), sampler)
    seen = [next(batches) for _ in range(3)]
    assert [step for step, _ in seen] == [0, 1, 2]
    with pytest.raises(ValueError, match="steps_done should be given"):  # the DataLoader read ahead
        sampler.state_dict()
    sampler.replan(128, steps_done=2)  # the batch of step 2 failed: it is planned again
    batches.restart()
    rest = list(batches)
    assert [step for step, _ in rest] == list(range(2, sampler.plan.num_steps))
    trained = [i for _, batch in seen[:2] + rest for i in batch]
    assert sorted(trained) == INDICES
    assert not GradientState().in_dataloader  # the abandoned pass was ended, the last one ended itself
    assert batches.restarts == 1


def test_an_abandoned_pass_is_unregistered_from_accelerate() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    fallback = OOMFallback(sampler, _linear())
    for _ in fallback.iterate(shard(sampler)):
        assert GradientState().in_dataloader
        break
    assert not GradientState().in_dataloader


def test_the_guard_counts_the_steps_trained_and_checkpoints_them() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    fallback = OOMFallback(sampler, _linear())
    trained: list[int] = []
    for step, batch in enumerate(fallback.iterate(shard(sampler))):
        assert fallback.steps_done == step
        if step == 4:
            break
        trained += batch
    assert fallback.steps_done == 4  # the fifth batch was not trained
    state = fallback.state_dict()
    assert state["sampler"]["steps_done"] == 4
    with pytest.raises(ValueError, match="Register the OOMFallback for checkpointing instead"):
        sampler.state_dict()  # the sampler's own count ran ahead with the DataLoader: refused
    resumed = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    again = OOMFallback(resumed, _linear())
    again.load_state_dict(state)
    assert again.steps_done == resumed.start_step == 4
    rest = [i for batch in again.iterate(shard(resumed)) for i in batch]
    assert sorted(trained + rest) == INDICES  # every sample exactly once
    sampler.set_epoch(1)  # a new epoch starts the count at 0
    assert fallback.steps_done == 0


def test_a_second_pass_over_the_same_epoch_counts_from_its_start() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, shuffle=False)
    fallback = OOMFallback(sampler, _linear())
    first = list(fallback.iterate(DataLoader(INDICES, batch_sampler=sampler, collate_fn=list)))
    assert fallback.steps_done == len(first) == sampler.plan.num_steps
    for step, _ in enumerate(fallback.iterate(DataLoader(INDICES, batch_sampler=sampler, collate_fn=list))):
        assert fallback.steps_done == step  # the new pass restarted the count


def test_without_a_reader_that_reads_ahead_the_samplers_own_count_is_exact() -> None:
    """A loop over the sampler, or over a DataLoader without workers: what it yielded was trained."""
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    taken = []
    for step, batch in enumerate(DataLoader(INDICES, batch_sampler=sampler, collate_fn=list)):
        taken += batch
        assert sampler.state_dict()["steps_done"] == step + 1
        if step == 2:
            break
    resumed = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    resumed.load_state_dict(sampler.state_dict())
    assert sorted(taken + [i for batch in resumed for i in batch]) == INDICES


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)
