"""What the probe trains on: a worst-case batch for a transformers model, and a default loss."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

MakeBatch = Callable[[int, int, torch.Generator], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


def synthetic_batch(
    model: torch.nn.Module, batch_size: int, length: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A worst-case batch for a transformers model: ``batch_size`` sequences all ``length`` tokens long.

    The last sequence ends one pad token early, so the attention mask is a
    real padding mask (transformers drops an all-ones mask, which would let
    sdpa pick a kernel that padded batches never get). Labels follow the
    head named by the class: sequence or token classification, masked or
    causal LM; other models get none and the probe's loss is the mean output.

    Raises:
        ValueError: the model has no ``config.vocab_size`` (pass ``make_batch``),
            or ``length`` exceeds ``config.max_position_embeddings``.
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise ValueError(
            f"{type(model).__name__} has no config.vocab_size to draw synthetic token ids from; "
            f"pass make_batch=lambda batch_size, length, generator: {{...}} that builds a batch"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and length > limit:
        raise ValueError(
            f"length={length} exceeds the model's max_position_embeddings={limit}; "
            f"probe with max_len <= {limit} (truncate your data to it)"
        )
    ids = torch.randint(0, int(vocab), (batch_size, length), generator=generator)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    if length > 1:
        mask[-1, -1] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    name = type(model).__name__
    num_labels = int(getattr(config, "num_labels", 2))
    if name.endswith("ForSequenceClassification"):
        batch["labels"] = (
            torch.zeros(batch_size) if num_labels == 1 else torch.zeros(batch_size, dtype=torch.long)
        )
    elif name.endswith("ForTokenClassification"):
        batch["labels"] = torch.zeros(batch_size, length, dtype=torch.long)
    elif name.endswith(("ForMaskedLM", "ForCausalLM", "LMHeadModel")):
        batch["labels"] = ids.clone()
    return batch


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """``output.loss`` when the model computed one, else the mean of its first floating output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = output.values() if isinstance(output, Mapping) else output
    if isinstance(values, torch.Tensor):
        return values.float().mean()
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float().mean()
    raise ValueError(
        f"cannot make a loss from the model's output of type {type(output).__name__}; "
        f"pass loss_fn=lambda output, batch: ... returning a scalar tensor"
    )
