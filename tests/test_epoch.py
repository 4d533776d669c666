"""The one epoch cursor (the sampler's ``position``) and the one re-plan-aware iterator over it."""

from __future__ import annotations

import numpy as np
import torch
from accelerate.data_loader import DataLoaderShard
from accelerate.state import GradientState
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch._epoch import EpochBatches, EpochCursor

LENGTHS = np.random.default_rng(0).integers(4, 60, size=300)
INDICES = list(range(len(LENGTHS)))


def shard(sampler: TokenBudgetBatchSampler) -> DataLoaderShard:
    """accelerate's one-process DataLoader: reads a batch ahead, registers with GradientState."""
    return DataLoaderShard(INDICES, batch_sampler=sampler, collate_fn=list)


def test_restart_after_a_replan_yields_the_rest_of_the_new_plan_once() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    batches = EpochBatches(shard(sampler), sampler)
    seen = [next(batches) for _ in range(3)]
    assert [step for step, _ in seen] == [0, 1, 2]
    assert sampler.position.handed_out > 2  # the DataLoader read ahead of the loop
    sampler.replan(128, steps_done=2)  # the batch of step 2 failed: it is planned again
    batches.restart()
    rest = list(batches)
    assert [step for step, _ in rest] == list(range(2, sampler.plan.num_steps))
    trained = [i for _, batch in seen[:2] + rest for i in batch]
    assert sorted(trained) == INDICES
    assert not GradientState().in_dataloader  # the abandoned pass was ended, the last one ended itself


def test_an_abandoned_pass_is_unregistered_from_accelerate() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    fallback = OOMFallback(sampler, _linear())
    for _ in fallback.iterate(shard(sampler)):
        assert GradientState().in_dataloader
        break
    assert not GradientState().in_dataloader


def test_the_guard_counts_trained_steps_in_the_sampler_position() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    cursor = EpochCursor(sampler)
    for step, _ in enumerate(cursor.iterate(shard(sampler))):
        assert cursor.current_step() == step == sampler.position.trained
        if step == 4:
            break
    assert cursor.steps_done == sampler.position.trained == 4  # the fifth batch was not trained
    state = sampler.state_dict(steps_done=sampler.position.trained)
    assert sampler.position.handed_out > 4  # the DataLoader read ahead of the loop ...
    assert state["steps_done"] == 4 == sampler.state_dict()["steps_done"]  # ... the default does not
    # A second guard (a model wrapped again) reads the same cursor; a new epoch starts it at 0.
    assert EpochCursor(sampler).steps_done == 4
    sampler.set_epoch(1)
    assert cursor.current_step() == cursor.steps_done == 0


def test_a_second_pass_over_the_same_epoch_counts_from_its_start() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, shuffle=False)
    cursor = EpochCursor(sampler)
    first = list(cursor.iterate(DataLoader(INDICES, batch_sampler=sampler, collate_fn=list)))
    assert cursor.steps_done == len(first) == sampler.plan.num_steps
    for step, _ in enumerate(DataLoader(INDICES, batch_sampler=sampler, collate_fn=list)):
        assert cursor.current_step() == step  # without iterate(): the pass restarted the count
        cursor.steps_done = step + 1  # as OOMFallback.backward does after a trained step


def _linear() -> torch.nn.Module:
    return torch.nn.Linear(2, 1)
