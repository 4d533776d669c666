"""The OOM fallback's pure parts: recognising OOM errors, the budget rule, and splitting batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenbatch import CostModel, SampleTooLargeError, TokenBudgetBatchSampler, is_oom
from tokenbatch.oom import OOMFallback
from tokenbatch.oom._split import inspect_batch, plan_micro_batches, split_batch, take_rows
from tokenbatch.oom._step import Outcome, Phase, next_event, pack, unpack

CPU_OOM = (
    "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate 8"
)


# -- is_oom ----------------------------------------------------------------------------


def test_is_oom_recognises_torch_and_allocator_errors() -> None:
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"))
    assert is_oom(RuntimeError(CPU_OOM))
    assert is_oom(RuntimeError("MPS backend out of memory (MPS allocated: 1 GB)"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if ..."))
    assert not is_oom(RuntimeError("Expected all tensors to be on the same device"))
    assert not is_oom(ValueError("out of patience"))
    assert not is_oom(None)


def test_is_oom_follows_cause_and_context() -> None:
    def wrapped(explicit: bool) -> BaseException:
        try:
            try:
                raise torch.OutOfMemoryError("CUDA out of memory.")
            except RuntimeError as oom:
                if explicit:
                    raise KeyError("in a collator") from oom
                raise KeyError("while handling it")  # noqa: B904 (context, not cause, on purpose)
        except KeyError as error:
            return error
        raise AssertionError("unreachable")

    assert is_oom(wrapped(True)) and is_oom(wrapped(False))
    loop = ValueError("a")
    loop.__context__ = ValueError("b")
    loop.__context__.__context__ = loop  # a cycle must not hang
    assert not is_oom(loop)


def test_sample_too_large_is_final_even_with_an_oom_inside() -> None:
    error = SampleTooLargeError("no", length=9, max_tokens=4.0, step=0, rank=0)
    error.__cause__ = torch.OutOfMemoryError("CUDA out of memory.")
    assert not is_oom(error)


# -- the budget rule every rank applies -------------------------------------------------


OK = Outcome()


def oom(phase: Phase, cost: float, longest: int, rows: int) -> Outcome:
    return Outcome("oom", phase, cost=cost, longest=longest, rows=rows)


def rule(outcomes: list[Outcome], **kwargs: object) -> object:
    options: dict[str, object] = dict(
        epoch=1, step=7, mode="split", max_tokens=1000.0, factor=0.5, min_tokens=None, attempt=0
    )
    options.update(kwargs)
    return next_event(outcomes, **options)  # type: ignore[arg-type]


def test_new_budget_is_factor_times_the_smaller_of_budget_and_failed_cost() -> None:
    event = rule([oom("forward", 400.0, 40, 10), oom("backward", 600.0, 60, 10), OK])
    assert event.new_max_tokens == 300.0  # 0.5 * min(1000, 600)
    assert (event.ranks, event.where, event.longest) == ((0, 1), ("forward", "backward"), 60)
    oversize = rule([oom("forward", 5000.0, 500, 10)])
    assert oversize.new_max_tokens == 500.0  # an oversize batch: the budget rules


def test_single_sample_oom_raises_with_its_length() -> None:
    with pytest.raises(SampleTooLargeError, match="single sample of 300 tokens") as info:
        rule([OK, oom("backward", 300.0, 300, 1)])
    assert (info.value.length, info.value.rank, info.value.step, info.value.max_tokens) == (300, 1, 7, 1000.0)


def test_min_tokens_is_a_floor_then_an_error() -> None:
    assert rule([oom("forward", 900.0, 90, 10)], min_tokens=600.0).new_max_tokens == 600.0
    with pytest.raises(SampleTooLargeError, match="already at min_tokens=600"):
        rule([oom("forward", 500.0, 50, 10)], max_tokens=600.0, min_tokens=600.0)


def test_outcomes_summed_over_ranks_give_every_rank_all_of_them() -> None:
    outcomes = [OK, oom("backward", 123.5, 41, 3), Outcome("error", "forward")]
    flags = [[True, False, False], [False, False, True], [False, False, False]]
    summed = sum(pack(o, f, rank=r, world=3) for r, (o, f) in enumerate(zip(outcomes, flags, strict=True)))
    assert unpack(summed, world=3) == (outcomes, [True, False, True])
    assert pack(OK, [], rank=0, world=1).dtype == torch.float64


# -- reading and splitting batches ------------------------------------------------------


def padded(lengths: list[int], *, left: bool = False) -> dict[str, torch.Tensor]:
    width = max(lengths)
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if left:
            mask[i, width - n :] = 1
        else:
            mask[i, :n] = 1
    ids = mask * torch.arange(1, width + 1)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.arange(len(lengths)),
        "targets": torch.rand(len(lengths), width),  # float (batch, width): multi-label, not per token
    }


def test_inspect_reads_lengths_and_padding_side() -> None:
    shape = inspect_batch(padded([5, 3, 8]))
    assert (shape.size, shape.width, shape.lengths.tolist(), shape.right_padded) == (3, 8, [5, 3, 8], True)
    assert not inspect_batch(padded([5, 3, 8], left=True)).right_padded
    ids_only = {"input_ids": padded([2, 4])["input_ids"]}
    assert inspect_batch(ids_only, pad_token_id=0).lengths.tolist() == [2, 4]
    assert inspect_batch(ids_only).lengths.tolist() == [4, 4]  # no pad id: every row is full width
    assert inspect_batch((torch.zeros(6, 3), torch.zeros(6))).lengths.tolist() == [3] * 6
    with pytest.raises(TypeError, match="no tensor"):
        inspect_batch({"text": ["a"]})


@pytest.mark.parametrize("budget", [1.0, 20.0, 33.0, 64.0, 1000.0])
def test_micro_batches_cover_every_row_once_within_budget(budget: float) -> None:
    rng = np.random.default_rng(int(budget))
    lengths = rng.integers(1, 17, 23).tolist()
    shape = inspect_batch(padded(lengths))
    cost = CostModel(quadratic=1 / 16, pad_to_multiple_of=4)
    groups = plan_micro_batches(shape, cost, budget)
    assert sorted(np.concatenate(groups).tolist()) == list(range(23))
    for rows in groups:
        group_cost = len(rows) * float(cost.sample_cost(int(shape.lengths[rows].max())))
        assert group_cost <= budget or len(rows) == 1


def test_micro_batches_share_rows_evenly_when_they_can() -> None:
    even = plan_micro_batches(inspect_batch(padded([10] * 13)), CostModel(), 60.0)
    assert [len(rows) for rows in even] == [5, 4, 4]  # not 6, 6, 1
    mixed = plan_micro_batches(inspect_batch(padded([10] + [1] * 9)), CostModel(), 10.0)
    assert [len(rows) for rows in mixed] == [1, 9]  # sharing evenly would not fit: greedy


def test_split_trims_right_padding_and_keeps_rows_aligned() -> None:
    batch = padded([8, 2, 3, 7])
    shape = inspect_batch(batch)
    pieces = split_batch(batch, shape, CostModel(), 16.0)
    assert [rows.tolist() for _, _, rows in pieces] == [[0, 3], [1, 2]]
    second = pieces[1][0]
    assert second["input_ids"].shape == (2, 3) and second["attention_mask"].sum().item() == 5
    assert torch.equal(second["labels"], torch.tensor([1, 2]))
    assert second["targets"].shape == (2, 8)  # float (batch, width) tensors keep their columns
    assert sum(weight for _, weight, _ in pieces) == pytest.approx(1.0)
    tokens = split_batch(batch, shape, CostModel(), 16.0, weight="tokens")
    assert [w for _, w, _ in tokens] == pytest.approx([15 / 20, 5 / 20])
    custom = split_batch(batch, shape, CostModel(), 16.0, weight=lambda b: float(b["labels"].sum()))
    assert [w for _, w, _ in custom] == pytest.approx([3 / 6, 3 / 6])


def test_left_padding_is_not_trimmed() -> None:
    batch = padded([8, 2, 3, 7], left=True)
    pieces = split_batch(batch, inspect_batch(batch), CostModel(), 16.0)
    assert all(piece["input_ids"].shape[1] == 8 for piece, _, _ in pieces)


def test_take_rows_keeps_the_batch_type() -> None:
    from transformers import BatchEncoding

    batch = BatchEncoding(padded([4, 2]))
    part = take_rows(batch, inspect_batch(batch), np.array([1]), 2)
    assert isinstance(part, BatchEncoding) and part["input_ids"].tolist() == [[1, 2]]
    pair = (torch.arange(6).reshape(3, 2), torch.tensor([0, 1, 2]), "meta")
    assert take_rows(pair, inspect_batch(pair), np.array([2]), None)[1].tolist() == [2]
    with pytest.raises(ValueError, match="weight should be"):  # checked once, where the option is given
        OOMFallback(TokenBudgetBatchSampler([4, 2], 16), torch.nn.Linear(2, 2), weight="rows")


# -- the fallback's saved state ------------------------------------------------------------


def test_fallback_state_is_checked_whole_before_anything_changes() -> None:
    """Issue 11, item 15: another mode's state, or a malformed event, is refused naming the field."""
    import json

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler
    from tokenbatch.oom import OOMEvent

    def fallback(mode: str) -> OOMFallback:
        return OOMFallback(TokenBudgetBatchSampler([8] * 16, 64), torch.nn.Linear(2, 1), mode=mode)

    event = OOMEvent(
        epoch=0,
        step=3,
        mode="split",
        old_max_tokens=64,
        new_max_tokens=32,
        longest=8,
        ranks=(1,),
        where=("backward",),
    )
    split = fallback("split")
    good = {**split.state_dict(), "max_tokens": 32.0, "events": [event.as_dict()]}
    split.load_state_dict(json.loads(json.dumps(good)))  # lists for tuples, as JSON gives them back
    assert split.max_tokens == 32 and split.events == [event]
    sampler_state = {**good["sampler"], "steps_done": 99}
    bad = [
        ({**good, "mode": "halve"}, ValueError, r"state\['mode'\] should be 'split', this fallback's mode"),
        ({**good, "max_tokens": float("nan")}, ValueError, r"state\['max_tokens'\] should be a positive"),
        ({**good, "events": {"0": event}}, TypeError, r"state\['events'\] should be a list"),
        ({**good, "version": 2}, ValueError, r"state should be an OOMFallback\.state_dict\(\) \(version 3"),
        (
            {**good, "max_tokens": 16.0, "sampler": sampler_state},
            ValueError,
            r"state\['steps_done'\] should be",
        ),
    ]
    broken = {
        "ranks": (r"state\['events'\]\[0\] should be an OOMEvent\.as_dict\(\), with keys", None),
        "step": (r"state\['events'\]\[0\]\['step'\] should be an integer >= 0, but got .*=-1", -1),
        "where": (r"state\['events'\]\[0\]\['where'\] should hold 'forward' or 'backward' for each", []),
        "mode": (r"state\['events'\]\[0\]\['mode'\] should be one of 'split', 'halve'", "double"),
    }
    for key, (match, value) in broken.items():
        entry = {k: v for k, v in event.as_dict().items() if value is not None or k != key}
        if value is not None:
            entry[key] = value
        bad.append(({**good, "max_tokens": 16.0, "events": [entry]}, ValueError, match))
    for state, error, match in bad:
        with pytest.raises(error, match=match):
            split.load_state_dict(state)
        assert split.max_tokens == 32 and split.events == [event]  # unchanged
    halve = fallback("halve")
    with pytest.raises(ValueError, match=r"state\['mode'\] should be 'halve'.* mode='split'"):
        halve.load_state_dict(good)
    assert halve.events == []
