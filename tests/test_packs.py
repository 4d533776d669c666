"""tokenbatch._packs: the examples of a flattened batch, read from what the real collators emit.

Packs come from transformers' ``DataCollatorWithFlattening`` (with and without the
flash-attention kwargs and ``seq_idx``) and TRL's padding-free collator; a sub-pack
must be exactly what the collator makes of those examples alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening
from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

from tokenbatch._packs import packed_examples, take_examples


def features(lengths: list[int], seed: int = 0, unlabelled: float = 0.0) -> list[dict[str, Any]]:
    """Examples of these lengths: ids, and labels with a share ``unlabelled`` of -100 (a prompt)."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in lengths:
        ids = rng.integers(1, 50, length).tolist()
        labels = [-100 if rng.random() < unlabelled else t for t in ids]
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert set(a) == set(b)
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        else:
            assert a[key] == b[key], key


COLLATORS = {
    "flattening": lambda: DataCollatorWithFlattening(),
    "flattening+flash": lambda: DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_seq_idx=True
    ),
    "flattening+start2": lambda: DataCollatorWithFlattening(position_ids_start=2),
    "trl": lambda: DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True),
}


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=9),
    name=st.sampled_from(sorted(COLLATORS)),
    unlabelled=st.sampled_from([0.0, 0.4]),
    data=st.data(),
)
def test_a_sub_pack_is_what_the_collator_makes_of_those_examples(
    lengths: list[int], name: str, unlabelled: float, data: st.DataObject
) -> None:
    collator = COLLATORS[name]()
    rows = features(lengths, unlabelled=unlabelled)
    batch = collator(rows)
    examples = packed_examples(batch)
    assert examples is not None
    assert examples.lengths.tolist() == lengths
    assert examples.row.tolist() == [0] * len(lengths)
    assert examples.start.tolist() == np.concatenate([[0], np.cumsum(lengths)[:-1]]).tolist()
    labels = batch["labels"][0]
    assert examples.labelled is not None and int(examples.labelled.sum()) == int((labels != -100).sum())
    # Each example's first label is -100 (the collators put it there): its labelled tokens are its own.
    assert examples.labelled.tolist() == [sum(t != -100 for t in r["labels"][1:]) for r in rows]
    chosen = sorted(data.draw(st.sets(st.integers(0, len(lengths) - 1), min_size=1)))
    same(take_examples(batch, examples, chosen), collator([rows[i] for i in chosen]))
    # Every token is in exactly one example.
    assert sorted(examples.positions(range(len(lengths))).tolist()) == list(range(sum(lengths)))


def test_boundaries_alone_or_a_sequence_index_mark_the_examples() -> None:
    rows = features([3, 5, 2])
    flash = DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)(rows)
    by_index = DataCollatorWithFlattening(return_position_ids=False, return_seq_idx=True)(rows)
    for batch in (flash, by_index):
        examples = packed_examples(batch)
        assert examples is not None and examples.lengths.tolist() == [3, 5, 2]
    sub = take_examples(flash, packed_examples(flash), [2, 0])  # any order: the pack is rebuilt in it
    assert sub["cu_seq_lens_q"].tolist() == [0, 2, 5] and sub["max_length_k"] == 3
    assert sub["input_ids"][0].tolist() == rows[2]["input_ids"] + rows[0]["input_ids"]


def test_trl_padding_to_a_multiple_counts_as_one_token_examples_as_its_own_boundaries_do() -> None:
    rows = features([3, 6])
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True, pad_to_multiple_of=4)(rows)
    examples = packed_examples(batch)
    assert examples is not None and examples.lengths.tolist() == [3, 6, 1, 1, 1]
    assert np.diff(batch["cu_seq_lens_q"].numpy()).tolist() == examples.lengths.tolist()
    assert examples.labelled is not None and examples.labelled.tolist() == [2, 5, 0, 0, 0]


def test_padded_batches_are_not_packs() -> None:
    rows = features([3, 5])
    trl_padded = DataCollatorForLanguageModeling(pad_token_id=0, return_position_ids=True)(rows)
    assert "position_ids" in trl_padded and packed_examples(trl_padded) is None  # its mask says padded
    rows_without_mask = {
        "input_ids": torch.ones(2, 4, dtype=torch.long),
        "position_ids": torch.arange(4).repeat(2, 1),
    }
    assert packed_examples(rows_without_mask) is None  # several rows of one example each
    assert (
        packed_examples(torch.ones(2, 3)) is None and packed_examples({"input_ids": torch.ones(1, 3)}) is None
    )


def test_a_pack_of_several_rows_is_read_row_by_row_and_per_row_values_are_refused() -> None:
    batch = {
        "input_ids": torch.arange(8).reshape(2, 4),
        "position_ids": torch.tensor([[0, 1, 0, 1], [0, 1, 2, 3]]),
        "labels": torch.tensor([[-100, 1, -100, 3], [-100, 5, 6, 7]]),
    }
    examples = packed_examples(batch)
    assert examples is not None
    assert (examples.row.tolist(), examples.start.tolist(), examples.lengths.tolist()) == (
        [0, 0, 1],
        [0, 2, 0],
        [2, 2, 4],
    )
    sub = take_examples(batch, examples, [0, 2])
    assert sub["input_ids"].tolist() == [[0, 1, 4, 5, 6, 7]] and sub["position_ids"].tolist() == [
        [0, 1, 0, 1, 2, 3]
    ]
    with pytest.raises(TypeError, match=r"batch\['weights'\] has one entry per row"):
        take_examples({**batch, "weights": torch.ones(2)}, examples, [0])
