"""Resuming a TokenBudgetBatchSampler: the exact default position, any rank, atomic loads (issue 11)."""

from __future__ import annotations

import itertools
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from sampler_cases import SETTINGS, Case, cases, loader

from tokenbatch import TokenBudgetBatchSampler

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
    try:
        batches = list(reference)
    except ValueError as error:  # too few samples for `world` equal shares: refused, not a resume
        assume("the same number of batches" not in str(error))
        raise
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
    assert target.state_dict() == twin.state_dict() and target.max_tokens == twin.max_tokens
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
