"""Token lengths from a Trainer's datasets, and the sampler and DataLoader options for a token budget."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import IterableDataset

from tokenbatch.cost import CostModel
from tokenbatch.lengths import column_lengths
from tokenbatch.sampler import TokenBudgetBatchSampler


def dataset_lengths(dataset: Any, length_column: str, input_name: str) -> np.ndarray:
    """Every example's length, read as ``group_by_length`` reads it.

    A ``datasets.Dataset``: its ``length_column`` if it has one, else the
    lengths of its ``input_name`` sequences. Another map-style dataset:
    ``len(dataset[i][input_name])`` for every ``i``.

    Raises:
        KeyError: neither column exists (the message says how to tokenize).
        TypeError: the dataset is iterable-only or its examples are not dicts.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"a token budget needs every example's length up front, but got an iterable dataset of type "
            f"{type(dataset).__name__}; use a map-style dataset (datasets.Dataset without streaming=True)"
        )
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        column = length_column if length_column in columns else input_name
        if column not in columns:
            raise KeyError(
                f"the dataset has neither a {length_column!r} column (TrainingArguments.length_column_name) "
                f"nor {input_name!r}; its columns are {columns}. Tokenize it first, for example "
                f"dataset.map(lambda rows: tokenizer(rows['text'], truncation=True), batched=True)"
            )
        return column_lengths(dataset, column)
    try:
        return np.asarray([len(dataset[i][input_name]) for i in range(len(dataset))], dtype=np.int64)
    except (KeyError, TypeError, IndexError) as error:
        raise TypeError(
            f"cannot read token lengths: each example should be a dict with {input_name!r} "
            f"(a sequence of token ids), but reading example 0 failed with {error!r}"
        ) from None


def budget_sampler(
    lengths: np.ndarray,
    max_tokens: float,
    *,
    cost: CostModel,
    seed: int,
    num_replicas: int,
    training: bool,
    options: dict[str, Any],
) -> TokenBudgetBatchSampler:
    """A sampler for ``lengths``: shuffled by ``seed`` for training, in order otherwise.

    ``options`` are the sampler's keyword options (``max_batch_size``,
    ``batch_size_multiple``, ``oversize``); evaluation never drops a sample
    (``oversize="alone"``). The sampler itself warns about samples over the budget.
    """
    options = dict(options)
    if not training:
        options["oversize"] = "alone"
    return TokenBudgetBatchSampler(
        lengths, max_tokens, cost=cost, shuffle=training, seed=seed, num_replicas=num_replicas, **options
    )


def loader_options(args: Any, *, training: bool) -> dict[str, Any]:
    """The DataLoader keywords ``Trainer._get_dataloader`` takes from ``TrainingArguments`` ``args``."""
    params: dict[str, Any] = {
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
    }
    for name, option in (
        ("multiprocessing_context", "dataloader_multiprocessing_context"),
        ("in_order", "dataloader_in_order"),
    ):
        if hasattr(args, option):
            params[name] = getattr(args, option)
    if training:
        from transformers.trainer_utils import seed_worker

        params["worker_init_fn"] = partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        )
    return params
