"""tokenbatch.lengths: the lengths agree exactly with what DataCollatorWithPadding pads to."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import pytest
import torch
from transformers import DataCollatorWithPadding

from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.lengths import column_lengths, text_lengths

MAX_LENGTH = 24  # short enough that some emotion texts are truncated


@pytest.fixture(scope="module")
def raw(emotion_data_dir: Path) -> datasets.Dataset:
    """600 emotion texts (real or synthetic) plus a few that need truncation, in memory."""
    rows = [json.loads(line) for line in (emotion_data_dir / "train.jsonl").read_text().splitlines()[:600]]
    rows += [{"text": "so very " * 40, "label": 1}, {"text": "", "label": 0}, {"text": "ok", "label": 2}]
    return datasets.Dataset.from_list(rows)


@pytest.fixture(scope="module")
def tokenized(raw: datasets.Dataset, minilm_tokenizer: Any) -> datasets.Dataset:
    """``raw`` tokenized the way a training script does it, with truncation."""
    return raw.map(
        lambda batch: minilm_tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH),
        batched=True,
        remove_columns=["text"],
    )


def collated_length(collator: DataCollatorWithPadding, dataset: datasets.Dataset, rows: list[int]) -> int:
    features = [dataset[i] for i in rows]
    for feature in features:
        feature.pop("label", None)
    batch = collator(features)
    assert batch["input_ids"].shape == batch["attention_mask"].shape
    return int(batch["input_ids"].shape[1])


def test_column_lengths_equal_each_collated_sample(
    tokenized: datasets.Dataset, minilm_tokenizer: Any
) -> None:
    lengths = column_lengths(tokenized)
    collator = DataCollatorWithPadding(minilm_tokenizer)
    per_sample = np.array([collated_length(collator, tokenized, [i]) for i in range(len(tokenized))])
    np.testing.assert_array_equal(lengths, per_sample)
    assert lengths.dtype == np.int64
    # Special tokens are counted, truncation is respected: "" is [CLS] [SEP], the long text is cut.
    assert lengths[-2] == 2
    assert lengths[-3] == MAX_LENGTH
    assert lengths.max() == MAX_LENGTH


@pytest.mark.parametrize("multiple", [1, 8])
def test_sampler_batches_collate_to_the_planned_shape(
    tokenized: datasets.Dataset, minilm_tokenizer: Any, multiple: int
) -> None:
    """pad_to_multiple_of is the CostModel's job: the collated width is its padded_length."""
    lengths = column_lengths(tokenized)
    cost = CostModel.attention(crossover=64, pad_to_multiple_of=multiple)
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=600, cost=cost, seed=3)
    collator = DataCollatorWithPadding(
        minilm_tokenizer, pad_to_multiple_of=None if multiple == 1 else multiple
    )
    seen = 0
    for batch in sampler:
        width = collated_length(collator, tokenized, batch)
        assert width == cost.padded_length(int(lengths[batch].max()))
        assert cost.cost(len(batch), width) <= 600
        seen += len(batch)
    assert seen == len(tokenized)


def test_text_lengths_dataset_list_and_column_agree(
    raw: datasets.Dataset, tokenized: datasets.Dataset, minilm_tokenizer: Any
) -> None:
    expected = column_lengths(tokenized)
    from_dataset = text_lengths(raw, minilm_tokenizer, max_length=MAX_LENGTH, batch_size=128)
    from_list = text_lengths(list(raw["text"]), minilm_tokenizer, max_length=MAX_LENGTH, batch_size=100)
    np.testing.assert_array_equal(from_dataset, expected)
    np.testing.assert_array_equal(from_list, expected)


def test_text_lengths_follow_the_tokenizer_settings(minilm_tokenizer: Any) -> None:
    texts = ["so very " * 40, "ok"]
    assert list(text_lengths(texts, minilm_tokenizer, truncation=False, add_special_tokens=False)) == [80, 1]
    assert list(text_lengths(texts, minilm_tokenizer, truncation=False)) == [82, 3]
    assert list(text_lengths(texts, minilm_tokenizer, max_length=10)) == [10, 3]
    # Truncation without max_length stops at the tokenizer's model_max_length, as a tokenizer call does.
    assert list(text_lengths(["word " * 600], minilm_tokenizer)) == [minilm_tokenizer.model_max_length]
    with pytest.raises(ValueError, match=r"tokenized texts: row 1 has length 0 \(1 such row"):
        text_lengths(["ok", ""], minilm_tokenizer, add_special_tokens=False)


def test_length_column_and_any_sequence_column(raw: datasets.Dataset, minilm_tokenizer: Any) -> None:
    with_length = raw.map(
        lambda batch: minilm_tokenizer(
            batch["text"], truncation=True, max_length=MAX_LENGTH, return_length=True
        ),
        batched=True,
    )
    from_ids = column_lengths(with_length, "input_ids")
    np.testing.assert_array_equal(column_lengths(with_length, "length"), from_ids)
    np.testing.assert_array_equal(column_lengths(with_length, "attention_mask"), from_ids)


def test_row_order_follows_select_and_shuffle(tokenized: datasets.Dataset) -> None:
    lengths = column_lengths(tokenized)
    shuffled = tokenized.shuffle(seed=7).select(range(50, 250))
    order = np.random.default_rng(7).permutation(len(tokenized))  # what Dataset.shuffle(seed=7) does
    np.testing.assert_array_equal(column_lengths(shuffled), lengths[order[50:250]])
    np.testing.assert_array_equal(column_lengths(shuffled), [len(row) for row in shuffled["input_ids"]])


def test_map_is_cached_and_parallel(tmp_path: Path, raw: datasets.Dataset, minilm_tokenizer: Any) -> None:
    """From files, datasets caches the measuring map; num_proc gives the same lengths."""
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in raw.to_list()))
    on_disk = datasets.load_dataset(
        "json", data_files=str(path), split="train", cache_dir=str(tmp_path / "c")
    )
    expected = text_lengths(raw, minilm_tokenizer, max_length=MAX_LENGTH)
    first = text_lengths(on_disk, minilm_tokenizer, max_length=MAX_LENGTH, num_proc=2, batch_size=100)
    caches = sorted(p.name for p in (tmp_path / "c").rglob("cache-*.arrow"))
    second = text_lengths(on_disk, minilm_tokenizer, max_length=MAX_LENGTH, num_proc=2, batch_size=100)
    np.testing.assert_array_equal(first, expected)
    np.testing.assert_array_equal(second, expected)
    assert caches, "the measuring map wrote no cache file"
    assert sorted(p.name for p in (tmp_path / "c").rglob("cache-*.arrow")) == caches  # reused, not rewritten
    # A different max_length is a different fingerprint, not a stale cache hit.
    shorter = text_lengths(on_disk, minilm_tokenizer, max_length=8, num_proc=2, batch_size=100)
    np.testing.assert_array_equal(shorter, np.minimum(expected, 8))


def test_missing_column_names_it_and_the_available_ones(
    tokenized: datasets.Dataset, raw: datasets.Dataset, minilm_tokenizer: Any
) -> None:
    with pytest.raises(
        KeyError, match=r"column='tokens' is not in the dataset; its columns are 'label', 'input_ids'"
    ):
        column_lengths(tokenized, "tokens")
    with pytest.raises(KeyError, match=r"column='sentence' .* 'text', 'label'"):
        text_lengths(raw, minilm_tokenizer, column="sentence")


def test_wrong_inputs_say_what_to_pass(
    raw: datasets.Dataset, tokenized: datasets.Dataset, minilm_tokenizer: Any
) -> None:
    with pytest.raises(
        TypeError, match=r"column 'text' holds text.*text_lengths\(dataset, tokenizer, column='text'"
    ):
        column_lengths(raw, "text")
    with pytest.raises(TypeError, match=r"column 'label' has type .*sequences"):
        column_lengths(raw.cast_column("label", datasets.Value("float32")), "label")
    with pytest.raises(TypeError, match=r"DatasetDict with splits 'train'.*dataset\['train'\]"):
        column_lengths(datasets.DatasetDict({"train": tokenized}))
    with pytest.raises(TypeError, match="streaming"):
        column_lengths(tokenized.to_iterable_dataset())
    with pytest.raises(TypeError, match="got one string"):
        text_lengths("i feel fine", minilm_tokenizer)
    with pytest.raises(ValueError, match=r"column 'input_ids': row 1 has length 0"):
        column_lengths(datasets.Dataset.from_dict({"input_ids": [[1, 2], [], [3]]}))
    with pytest.raises(ValueError, match=r"column 'input_ids' has 1 null row\(s\), the first at row 1"):
        column_lengths(datasets.Dataset.from_dict({"input_ids": [[1, 2], None, [3]]}))
    with pytest.raises(ValueError, match="no rows"):
        column_lengths(tokenized.select([]))
    with pytest.raises(ValueError, match="max_length should be an integer >= 1, but got max_length=0"):
        text_lengths(["a"], minilm_tokenizer, max_length=0)


def test_lengths_feed_the_sampler_as_tensors_too(tokenized: datasets.Dataset) -> None:
    lengths = column_lengths(tokenized)
    sampler = TokenBudgetBatchSampler(torch.from_numpy(lengths), max_tokens=256, seed=0)
    np.testing.assert_array_equal(sampler.lengths, lengths)
