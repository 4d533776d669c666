"""Token lengths from a Trainer's datasets, and DataLoaders batched by a token budget."""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset

from tokenbatch.lengths import column_lengths
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.integrations.transformers")


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


def new_sampler(
    trainer: Any, lengths: np.ndarray, max_tokens: float, *, training: bool, warn: bool = True
) -> TokenBudgetBatchSampler:
    """The trainer's sampler for ``lengths``: shuffled by the data seed for training, in order otherwise."""
    args = trainer.args
    options = dict(trainer.sampler_options)
    if not training:
        options["oversize"] = "alone"  # evaluation never drops a sample
    if warn and options["oversize"] != "error":
        cost = trainer.token_cost
        over = int(np.count_nonzero(cost.sample_cost(cost.padded_length(lengths)) > max_tokens))
        if over:
            action = "left out" if options["oversize"] == "skip" else "batched alone"
            logger.warning(
                "%d example(s) alone exceed max_tokens=%g and will be %s", over, max_tokens, action
            )
    return TokenBudgetBatchSampler(
        lengths,
        max_tokens,
        cost=trainer.token_cost,
        shuffle=training,
        seed=args.data_seed if args.data_seed is not None else args.seed,
        num_replicas=trainer.accelerator.num_processes,
        **options,
    )


def budget_dataloader(
    trainer: Any, dataset: Any, description: str, max_tokens: float, *, training: bool
) -> tuple[Any, TokenBudgetBatchSampler]:
    """A DataLoader over ``dataset`` batched by ``max_tokens``, prepared by the trainer's accelerator.

    Mirrors ``Trainer._get_dataloader`` (column removal, collator, worker
    settings), with the sampler as ``batch_sampler``; the sampler yields the
    global plan, which accelerate's ``BatchSamplerShard`` shares out by rank.
    """
    processing = trainer.processing_class
    names = getattr(processing, "model_input_names", None)
    input_name = names[0] if names else "input_ids"
    lengths = dataset_lengths(dataset, trainer.args.length_column_name, input_name)
    sampler = new_sampler(trainer, lengths, max_tokens, training=training)
    collator = trainer.data_collator
    if hasattr(dataset, "column_names") and hasattr(dataset, "remove_columns"):
        dataset = trainer._remove_unused_columns(dataset, description=description)
    else:
        collator = trainer._get_collator_with_removed_columns(collator, description=description)
    args = trainer.args
    params: dict[str, Any] = {
        "batch_sampler": sampler,
        "collate_fn": collator,
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
    return trainer.accelerator.prepare(DataLoader(dataset, **params)), sampler
