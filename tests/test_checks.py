"""``tokenbatch._checks``: what the argument checks accept, and that each refusal says what to pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch import TokenBudgetBatchSampler, _checks

# -- booleans (item 14: "False" and "no" used to mean True) -------------------------------


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_boolean_accepts_bools(value: Any) -> None:
    result = _checks.boolean("drop_last", value)
    assert result is bool(value)


@pytest.mark.parametrize("value", ["False", "no", "", 0, 1, None, 1.0, torch.tensor(True)])
def test_boolean_refuses_everything_else(value: Any) -> None:
    with pytest.raises(TypeError) as caught:
        _checks.boolean("drop_last", value)
    assert str(caught.value) == f"drop_last should be True or False, but got drop_last={value!r}"


@pytest.mark.parametrize("name", ["shuffle", "drop_last"])
@pytest.mark.parametrize("value", ["False", "no"])
def test_sampler_refuses_string_booleans(name: str, value: str) -> None:
    with pytest.raises(TypeError, match=f"{name} should be True or False, but got {name}='{value}'"):
        TokenBudgetBatchSampler([5, 3, 8], 16, **{name: value})


def test_sampler_keeps_real_booleans() -> None:
    sampler = TokenBudgetBatchSampler([5, 3, 8], 16, shuffle=np.bool_(False), drop_last=True)
    assert sampler.shuffle is False and sampler.drop_last is True


def test_oom_fallback_refuses_a_string_overlap() -> None:
    from tokenbatch import oom

    sampler = TokenBudgetBatchSampler([5, 3, 8], 16)
    with pytest.raises(ValueError, match="mode should be one of 'split', 'halve', but got mode='Split'"):
        oom.OOMFallback(sampler, torch.nn.Linear(2, 2), mode="Split")


# -- lengths (item 15) --------------------------------------------------------------------


def _message(lengths: Any, error: type[Exception] = TypeError) -> str:
    with pytest.raises(error) as caught:
        _checks.lengths_array(lengths)
    return str(caught.value)


@pytest.mark.parametrize(
    ("make", "kind"),
    [(lambda: (n for n in [5, 3]), "generator"), (lambda: map(int, [5, 3]), "map"), (lambda: iter([5]), "")],
)
def test_lengths_read_once_say_pass_a_list(make: Any, kind: str) -> None:
    message = _message(make())
    assert message.startswith("lengths should be a sequence with one length per example")
    assert f"but got a {kind}" in message and "pass list(...)" in message
    assert "shape" not in message


@pytest.mark.parametrize("lengths", [{5, 3, 8}, frozenset({5, 3})])
def test_lengths_in_a_set_have_no_order(lengths: Any) -> None:
    message = _message(lengths)
    assert "lengths should be a sequence" in message and "which has no order; pass a list" in message


def test_lengths_in_a_dict_or_a_scalar_say_what_to_pass() -> None:
    message = _message({"input_ids": [[1, 2]], "label": [0]})
    assert "but got a dict with keys 'input_ids', 'label'" in message
    assert _message(5) == (
        "lengths should be a sequence with one length per example (list, numpy array or tensor), "
        "but got lengths=5"
    )


@given(
    st.lists(st.integers(1, 10_000), min_size=1, max_size=30),
    st.sampled_from([None, "7", object(), [1, 2], 2.5j]),
    st.data(),
)
@settings(max_examples=60, deadline=None)
def test_a_non_number_is_named_with_its_position(good: list[int], bad: Any, data: st.DataObject) -> None:
    first = 1 if isinstance(bad, list) else 0  # a token list first means one token list per example
    position = data.draw(st.integers(first, len(good)), label="position")
    lengths = [*good[:position], bad, *good[position:]]
    message = _message(lengths)
    assert message.startswith(f"lengths should hold integers, but lengths[{position}]={bad!r}"), message


def test_none_is_named() -> None:
    assert _message([5, None, 7]) == "lengths should hold integers, but lengths[1]=None"


@pytest.mark.parametrize(
    ("lengths", "shown"),
    [
        ([5.0, 1e20], "lengths[1]=1e+20"),
        ([5, 10**30], f"lengths[1]={10**30}"),
        (np.array([5, 2**62]), f"lengths[1]={2**62}"),
        (np.array([3, 2**64 - 1], dtype=np.uint64), f"lengths[1]={2**64 - 1}"),
        (torch.tensor([7, 2**41]), f"lengths[1]={2**41}"),
    ],
)
def test_lengths_too_large_are_refused_with_their_position(lengths: Any, shown: str) -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy used to warn "invalid value encountered in cast"
        message = _message(lengths, ValueError)
    assert message == f"lengths should be at most 2**40 tokens per example, but {shown}"


def test_largest_allowed_length_is_accepted() -> None:
    assert _checks.lengths_array([1, 2**40]).tolist() == [1, 2**40]
    assert _checks.lengths_array([1.0, float(2**40)]).dtype == np.int64


def test_text_is_pointed_to_text_lengths() -> None:
    message = _message(["i feel happy", "so sad"])
    assert message.startswith("lengths should hold integers, but lengths[0]='i feel happy' is text")
    assert "tokenbatch.text_lengths" in message


@given(st.lists(st.lists(st.integers(0, 30_000), min_size=1, max_size=40), min_size=1, max_size=30))
@settings(max_examples=60, deadline=None)
def test_token_lists_are_measured_row_by_row(rows: list[list[int]]) -> None:
    expected = [len(row) for row in rows]
    for lengths in (rows, [tuple(row) for row in rows], [np.array(row) for row in rows]):
        array = _checks.lengths_array(lengths)
        assert array.dtype == np.int64 and array.tolist() == expected


def test_token_lists_mixed_with_numbers_are_named() -> None:
    message = _message([[101, 7, 102], 5])
    assert message.startswith("lengths should hold one token list per example (as lengths[0] does)")
    assert "but lengths[1]=5" in message
    assert "lengths[1]=0" in _message([[1, 2], []], ValueError)  # an empty row has no tokens


def test_a_padded_two_dimensional_array_is_still_refused() -> None:
    # Its rows all have the padded width: not the per-example lengths the sampler needs.
    for padded in (np.array([[1, 2], [3, 4]]), torch.ones(2, 3)):
        assert "one-dimensional" in _message(padded, ValueError)


# -- datasets ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenized() -> Any:
    datasets = pytest.importorskip("datasets")
    rng = np.random.default_rng(0)
    ids = [rng.integers(0, 30_000, int(n)).tolist() for n in rng.integers(1, 60, 200)]
    return datasets.Dataset.from_dict({"input_ids": ids, "text": ["t"] * 200, "length": [5] * 200})


def test_a_dataset_points_to_column_and_text_lengths(tokenized: Any) -> None:
    from datasets import DatasetDict

    for dataset in (tokenized, DatasetDict({"train": tokenized})):
        message = _message(dataset)
        assert f"but got a datasets {type(dataset).__name__}" in message
        assert "tokenbatch.column_lengths(dataset, 'input_ids')" in message
        assert "tokenbatch.text_lengths(dataset, tokenizer)" in message


def test_a_datasets_column_of_token_lists_is_accepted(tokenized: Any) -> None:
    from tokenbatch import column_lengths

    expected = column_lengths(tokenized, "input_ids")
    selected = tokenized.shuffle(seed=1).select(range(50))  # row order follows the indices mapping
    for column, want in (
        (tokenized["input_ids"], expected),
        (tokenized.with_format("torch")["input_ids"], expected),
        (list(tokenized["input_ids"]), expected),
        (selected["input_ids"], column_lengths(selected, "input_ids")),
        (tokenized["length"], np.full(200, 5)),
    ):
        np.testing.assert_array_equal(_checks.lengths_array(column), want)
    sampler = TokenBudgetBatchSampler(tokenized["input_ids"], 256, seed=0)
    np.testing.assert_array_equal(sampler.lengths, expected)


def test_a_datasets_column_of_text_or_with_nulls_is_named(tokenized: Any) -> None:
    import datasets

    message = _message(tokenized["text"])
    assert "lengths[0]='t' is text" in message and "tokenbatch.text_lengths" in message
    holes = datasets.Dataset.from_dict({"input_ids": [[1, 2], None, [3]]})
    assert _message(holes["input_ids"]) == "lengths should hold integers, but lengths[1]=None"


def test_budgets_read_rounded_in_messages_but_stay_exact_in_state() -> None:
    from tokenbatch.oom import OOMEvent

    assert [_checks.budget(x) for x in (2047.5, 16384.0, 1.5e6, 99.5, 12.0, 0.001, 1e30)] == [
        "2048",
        "16384",
        "1500000",
        "99.5",
        "12",
        "0.001",
        "1e+30",
    ]
    event = OOMEvent(
        epoch=0,
        step=3,
        mode="split",
        old_max_tokens=4095.0,
        new_max_tokens=2047.5,
        longest=87,
        ranks=(0,),
        where=("forward",),
    )
    assert "max_tokens 4095 -> 2048 (micro-batches)" in str(event)
    assert event.as_dict()["new_max_tokens"] == 2047.5
