"""Resuming a TokenBudgetBatchSampler on another number of processes (issue 11, item 11).

The steps trained stay as they were, global steps of the old number of
processes; what is left is planned again for the new one, whose steps follow.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import event, given
from hypothesis import strategies as st
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from sampler_cases import SETTINGS, Case, cases, flat

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom


def resume_on(case: Case, state: dict[str, Any], world: int) -> list[TokenBudgetBatchSampler] | None:
    """The global sampler and one per rank on ``world`` processes, each resumed from ``state``.

    None: what is left cannot give every rank a batch (and nothing was changed).
    """
    samplers = [
        case.sampler(num_replicas=world),
        *(case.sampler(num_replicas=world, rank=r) for r in range(world)),
    ]
    try:
        for sampler in samplers:
            sampler.load_state_dict(state)
    except ValueError as error:
        assert "cannot give each of" in str(error) and not case.kwargs["drop_last"], error
        event("too few samples left for the new number of processes")
        assert samplers[0].start_step == 0 and list(samplers[0]) == list(case.sampler(num_replicas=world))
        return None
    return samplers


def check_resumed(
    case: Case, samplers: list[TokenBudgetBatchSampler], trained: list[list[int]], done: int
) -> list[list[int]]:
    """Invariants after a resume at step ``done``: the rest once, shared out evenly, within budget."""
    world = len(samplers) - 1
    resumed, ranks = samplers[0], samplers[1:]
    plan = resumed.plan
    assert resumed.start_step == done and [len(s) for s in ranks] == [plan.num_steps - done] * world
    expected = len(resumed)
    rest = list(resumed)
    assert len(rest) == expected == (plan.num_steps - done) * world  # the new world's steps follow
    per_rank = [list(sampler) for sampler in ranks]
    for rank, mine in enumerate(per_rank):
        assert mine == rest[rank::world]
    assert len({len(mine) for mine in per_rank}) == 1
    left_out = [*plan.skipped.tolist(), *plan.dropped.tolist()]
    assert sorted(flat(trained) + flat(rest) + left_out) == list(range(len(case.lengths)))
    if not case.kwargs["drop_last"]:
        assert left_out == []
    for batch in rest:
        longest = max(case.lengths[i] for i in batch)
        assert len(batch) == 1 or resumed.cost.cost(len(batch), longest) <= resumed.max_tokens
    return rest


@SETTINGS
@given(cases(), st.integers(1, 8), st.integers(1, 8), st.integers(1, 8), st.data())
def test_resume_on_another_number_of_processes_trains_every_sample_once(
    case: Case, before: int, after: int, later: int, data: st.DataObject
) -> None:
    batches = list(case.sampler(num_replicas=before))
    done = data.draw(st.integers(0, len(batches) // before), label="steps trained before")
    state = case.sampler(num_replicas=before).state_dict(steps_done=done)
    trained = batches[: done * before]  # global steps of the old world
    event("same number of processes" if before == after else "another number of processes")
    samplers = resume_on(case, state, after)
    if samplers is None:
        return
    rest = check_resumed(case, samplers, trained, done)
    # A pure function of the state: loading it again gives the same batches.
    again = case.sampler(num_replicas=after)
    again.load_state_dict(state)
    assert list(again) == rest
    # Resumed once more, part-way through, on yet another number of processes.
    more = data.draw(st.integers(done, samplers[0].plan.num_steps), label="steps trained after")
    state = samplers[0].state_dict(steps_done=more)
    samplers = resume_on(case, state, later)
    if samplers is None:
        return
    check_resumed(case, samplers, trained + rest[: (more - done) * after], more)
    # The next epoch is a whole one for the new world.
    resumed = samplers[0]
    resumed.set_epoch(1)
    fresh = case.sampler(num_replicas=later)
    fresh.set_epoch(1)
    assert list(resumed) == list(fresh)


#: A state as tokenbatch wrote it before version 2 (one number of ranks, kept in the settings).
V1_LENGTHS = [(7 * i) % 23 + 2 for i in range(30)]
V1_STATE = {
    "version": 1,
    "num_samples": 30,
    "lengths_digest": "e8959c886c868c97f2dc205923cbbac0",
    "settings": {
        "cost": [1.0, 0.0, 0.0, 1],
        "shuffle": True,
        "seed": 3,
        "max_batch_size": None,
        "batch_size_multiple": 1,
        "drop_last": False,
        "oversize": "error",
        "num_replicas": 2,
        "rank": None,
    },
    "epoch": 0,
    "max_tokens": 30.0,
    "epoch_max_tokens": 40.0,
    "replans": [[2, 30.0]],
    "steps_done": 3,
}
#: What that sampler yielded after the 3 steps trained.


def test_a_version_1_state_is_refused_naming_the_version() -> None:
    """Nothing was released with version 1 states: there is no reader for them to keep."""
    sampler = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=2)
    with pytest.raises(ValueError, match=r"state\['version'\] should be 2, .* but got state\['version'\]=1"):
        sampler.load_state_dict(V1_STATE)
    assert sampler.start_step == 0 and sampler.max_tokens == 40.0  # left as it was
    state = sampler.state_dict(steps_done=3)
    assert state["version"] == 2 and state["epoch_num_replicas"] == 2
    assert "num_replicas" not in state["settings"] and "rank" not in state["settings"]


def test_an_epoch_resumed_on_another_number_of_processes_is_not_passed_over_again() -> None:
    state = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=2).state_dict(steps_done=2)
    sampler = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=1)
    sampler.load_state_dict(state)
    assert len(list(sampler)) == sampler.plan.num_steps - 2
    # The steps trained on 2 processes cannot be shared out on 1: a second pass is refused.
    with pytest.raises(ValueError, match=r"call set_epoch\(1\) to start the next epoch"):
        list(sampler)
    sampler.set_epoch(1)
    fresh = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=1)
    fresh.set_epoch(1)
    assert list(sampler) == list(fresh)


class Tiny(torch.nn.Module):
    """A one-parameter model over padded token ids: enough for the guard to train and fail."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (input_ids * attention_mask).float().mean(dim=1) * self.weight


def test_the_guard_resumes_a_two_process_checkpoint_on_one_and_recovers_from_oom() -> None:
    lengths = np.random.default_rng(0).integers(4, 60, size=200).tolist()

    def collate(indices: list[int]) -> dict[str, torch.Tensor]:
        width = max(lengths[i] for i in indices)
        mask = torch.tensor([[1] * lengths[i] + [0] * (width - lengths[i]) for i in indices])
        return {"input_ids": mask * 3, "attention_mask": mask, "idx": torch.tensor(indices)}

    before = TokenBudgetBatchSampler(lengths, 256, seed=0, num_replicas=2)
    trained = flat(list(before)[: 3 * 2])  # 3 global steps of 2 processes
    checkpoint = {"sampler": before.state_dict(steps_done=3)}
    sampler = TokenBudgetBatchSampler(lengths, 256, seed=0, num_replicas=1)
    model = Tiny()
    fallback = OOMFallback(sampler, model, mode="halve", grow=False)  # the re-plans of plain halving
    sampler.load_state_dict(checkpoint["sampler"])
    assert fallback.steps_done == 3  # the old world's steps; this one's follow
    loader = DataLoader(list(range(len(lengths))), batch_sampler=sampler, collate_fn=collate)
    with inject_oom(model, 150, times=1, after=2):  # the third batch after the resume fails
        for batch in fallback.iterate(loader):
            loss = fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"]).mean())
            if loss is not None:
                trained += batch["idx"].tolist()
    assert sorted(trained) == list(range(len(lengths)))  # every sample once, across both worlds
    [event] = fallback.events
    assert event.step == 3 + 2 and fallback.steps_done == sampler.plan.num_steps
    state = sampler.state_dict(steps_done=fallback.steps_done)
    assert state["epoch_num_replicas"] == 2  # started on 2, re-planned for 1, then under a smaller budget
    assert [r[0] for r in state["replans"]] == [3, 5] and [r[2] for r in state["replans"]] == [1, 1]
