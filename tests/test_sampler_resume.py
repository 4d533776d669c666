"""Resuming a TokenBudgetBatchSampler: exact default position, atomic loads, any rank, any world size."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom

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


# -- item 9: a load validates everything first and changes nothing on failure ----------------

NOT_COUNTS = [-1, 1.5, "3", None, True]
NOT_BUDGETS = [0, -5.0, float("nan"), float("inf"), "100", None, True]


def saved_state(case: Case, data: st.DataObject) -> tuple[TokenBudgetBatchSampler, dict[str, Any]]:
    """A sampler part-way through an epoch, maybe re-planned, and its state."""
    sampler = case.sampler()
    steps = sampler.plan.num_steps
    done = 0
    for factor in data.draw(st.lists(st.sampled_from([0.5, 0.9, 2.0]), max_size=2)):
        done = data.draw(st.integers(done, sampler.plan.num_steps))
        sampler.replan(sampler.max_tokens * factor, steps_done=done)
    steps = sampler.plan.num_steps
    return sampler, sampler.state_dict(steps_done=data.draw(st.integers(done, steps)))


def corruptions(state: dict[str, Any], steps: int) -> list[tuple[str, Any]]:
    """``(field, how)`` pairs: ``how(state)`` corrupts ``field`` of a copy of ``state``."""
    top: list[tuple[str, Any]] = [
        ("state['version']", ("version", [0, 99, "1", None, 1.5])),
        ("state['num_samples']", ("num_samples", [state["num_samples"] + 1, -1, "20", None])),
        ("state['lengths_digest']", ("lengths_digest", ["0" * 32, None, 5])),
        ("state['settings']", ("settings", ["seed", None, [1]])),
        ("state['epoch']", ("epoch", NOT_COUNTS)),
        ("state['max_tokens']", ("max_tokens", NOT_BUDGETS)),
        ("state['epoch_max_tokens']", ("epoch_max_tokens", NOT_BUDGETS)),
        ("state['epoch_num_replicas']", ("epoch_num_replicas", [0, *NOT_COUNTS])),
        ("state['steps_done']", ("steps_done", [*NOT_COUNTS, steps + 1, 10**9])),
        ("state['steps_done']", ("steps_done", [state["replans"][-1][0] - 1] if state["replans"] else [-1])),
        ("state['replans']", ("replans", ["x", None, 5, [[0]]])),
    ]
    settings = state["settings"]
    top.append(("state['settings']", ("settings", [{**settings, "seed": settings["seed"] + 1}])))
    top.append(("state['settings']", ("settings", [{**settings, "extra": 1}])))
    top.append(("state['settings']", ("settings", [{k: v for k, v in settings.items() if k != "shuffle"}])))
    for i, (done, budget, world) in enumerate(state["replans"]):
        field = f"state['replans'][{i}]"
        bad = [[x, budget, world] for x in [*NOT_COUNTS, steps + 10**6]]
        bad += [[done, x, world] for x in NOT_BUDGETS] + [[done, budget, x] for x in [0, *NOT_COUNTS]]
        bad += ["x", None, [done], [done, budget], [done, budget, world, 2]]
        top.append((field, ("replans", i, bad)))
        if i and state["replans"][i - 1][0] > 0:  # a re-plan before the one it follows
            top.append((field, ("replans", i, [[state["replans"][i - 1][0] - 1, budget, world]])))
    return top


@settings(SETTINGS, max_examples=300)
@given(cases(), st.data())
def test_a_corrupt_field_is_named_and_the_sampler_is_left_as_it_was(case: Case, data: st.DataObject) -> None:
    source, state = saved_state(case, data)
    field, (key, *where) = data.draw(st.sampled_from(corruptions(state, source.plan.num_steps)))
    values = where[-1]
    bad = data.draw(st.sampled_from(values))
    corrupt = {**state, "replans": [list(r) for r in state["replans"]]}
    if key == "replans" and len(where) == 2:
        corrupt["replans"][where[0]] = bad
    else:
        corrupt[key] = bad

    def prepared() -> TokenBudgetBatchSampler:
        sampler = case.sampler()
        sampler.set_epoch(1)
        iterator = iter(sampler)
        next(iterator)
        return sampler

    target, twin = prepared(), prepared()
    try:
        target.load_state_dict(corrupt)
    except (TypeError, ValueError) as error:
        assert field in str(error), (field, bad, str(error))
    else:
        raise AssertionError(f"{field}={bad!r} was accepted")
    assert target.position == twin.position and target.max_tokens == twin.max_tokens
    assert list(target) == list(twin)
    # ... and the valid state still loads.
    target.load_state_dict(state)
    plan = source.plan  # one rank: a step is one batch
    assert list(target) == [plan.batch(b).tolist() for b in range(state["steps_done"], plan.num_batches)]


def test_a_bad_replan_entry_leaves_the_sampler_usable() -> None:
    sampler = TokenBudgetBatchSampler(list(range(1, 41)), 100, seed=1)
    before = list(sampler)
    state = sampler.state_dict(steps_done=1)
    for entry, message in [
        ([10**6, 50.0, 1], r"state\['replans'\]\[0\]"),
        ([1, float("nan"), 1], r"state\['replans'\]\[0\]\[1\] should be a positive finite number"),
        ([1, -1.0, 1], r"state\['replans'\]\[0\]\[1\]=-1.0"),
    ]:
        with pytest.raises(ValueError, match=message):
            sampler.load_state_dict({**state, "replans": [entry]})
        assert list(sampler) == before
    with pytest.raises(ValueError, match=r"state\['max_tokens'\] should be a positive finite number"):
        sampler.load_state_dict({**state, "epoch": 3, "max_tokens": -1.0})
    assert sampler.epoch == 0 and list(sampler) == before


def test_state_dict_refuses_more_steps_than_the_epoch_has() -> None:
    sampler = TokenBudgetBatchSampler([5, 6, 7], 100)
    assert sampler.plan.num_steps == 1
    with pytest.raises(ValueError, match="steps_done should be at most the 1 steps of the epoch"):
        sampler.state_dict(steps_done=99)


def test_replan_refuses_to_go_back_before_the_last_replan() -> None:
    sampler = TokenBudgetBatchSampler(list(range(1, 41)), 100, seed=1)
    sampler.replan(50, steps_done=3)
    with pytest.raises(ValueError, match="steps_done should be at least 3"):
        sampler.replan(25, steps_done=2)
    assert sampler.max_tokens == 50 and sampler.start_step == 3
    with pytest.raises(ValueError, match="steps_done should be at least 3"):
        sampler.state_dict(steps_done=2)  # it would say the re-plan trained steps it did not


# -- item 11: resume on another number of processes -----------------------------------------


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


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
    "version": 1, "num_samples": 30, "lengths_digest": "e8959c886c868c97f2dc205923cbbac0",
    "settings": {
        "cost": [1.0, 0.0, 0.0, 1], "shuffle": True, "seed": 3, "max_batch_size": None,
        "batch_size_multiple": 1, "drop_last": False, "oversize": "error", "num_replicas": 2, "rank": None,
    },
    "epoch": 0, "max_tokens": 30.0, "epoch_max_tokens": 40.0, "replans": [[2, 30.0]], "steps_done": 3,
}  # fmt: skip
#: What that sampler yielded after the 3 steps trained.
V1_REST = [[12], [19], [2], [25], [26], [16], [10, 20], [0, 23], [6], [29], [14, 24, 1], [3]]


def test_a_version_1_state_still_resumes_on_any_number_of_processes() -> None:
    same = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=2)
    same.load_state_dict(V1_STATE)
    assert list(same) == V1_REST and same.max_tokens == 30.0
    trained = flat([same.plan.batch(b).tolist() for b in range(3 * 2)])
    for rank in range(2):  # the rank saved in version 1 is not compared either
        local = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=2, rank=rank)
        local.load_state_dict(V1_STATE)
        assert list(local) == V1_REST[rank::2]
    one = TokenBudgetBatchSampler(V1_LENGTHS, 40, seed=3, num_replicas=1)
    one.load_state_dict(V1_STATE)
    assert one.start_step == 3
    assert sorted(trained + flat(list(one))) == list(range(30))
    # Saved again, it is a version 2 state that says which ranks each part was planned for.
    state = one.state_dict(steps_done=3)
    assert state["version"] == 2 and state["epoch_num_replicas"] == 2
    assert state["replans"] == [[2, 30.0, 2], [3, 30.0, 1]]
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
    fallback = OOMFallback(sampler, model, mode="halve")
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
