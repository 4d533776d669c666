"""Whether a Trainer's batches are padded rows or packs, and the cost model that follows from it.

A collator that flattens each batch into one row with ``position_ids``
(transformers' ``DataCollatorWithFlattening``, TRL's
``DataCollatorForLanguageModeling(padding_free=True)``) makes packs, and what
a pack costs depends on how the model's attention runs over it: per example
for the varlen kernels (flash-attention, flex attention: ``packing="varlen"``),
over the whole row with a block-diagonal mask for eager and sdpa
(``packing="full"``).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from tokenbatch.cost import CostModel
from tokenbatch.integrations import _upstream

logger = logging.getLogger("tokenbatch.integrations.transformers")

_VARLEN_KERNELS = ("flash", "flex")
"""Names of the attention implementations that attend within each example of a pack (varlen)."""


def flattens(collator: Any) -> bool | None:
    """True: ``collator`` flattens a batch into one row; False: it pads rows; None: not known (custom)."""
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding

    if isinstance(collator, DataCollatorWithFlattening):
        return True
    padding_free = getattr(collator, "padding_free", None)  # TRL's collators: a public dataclass field
    if isinstance(padding_free, bool):
        return padding_free
    if isinstance(collator, DataCollatorWithPadding):
        return False
    return None


def attention_packing(model: Any) -> str:
    """The ``packing`` of ``model``'s attention: ``"varlen"`` (flash, flex) or ``"full"`` (eager, sdpa...)."""
    name = _upstream.attention_implementation(model) or "sdpa"  # transformers' default
    return "varlen" if any(kernel in name for kernel in _VARLEN_KERNELS) else "full"


def layout_cost(
    cost: CostModel | None, collator: Any, model: Any, *, packed: bool | None = None
) -> CostModel:
    """The cost model of a Trainer's batches: ``cost`` as given, or the one its collator and model imply.

    Args:
        cost: the ``cost=`` the trainer was given (None: padded tokens, or packed tokens for a collator that
            flattens, costed by the model's attention).
        collator: the trainer's ``data_collator``.
        model: the trainer's model (its attention implementation).
        packed: what the trainer's own options say of the batches (TRL's ``padding_free``), or None.

    Raises:
        ValueError: ``cost`` and the collator disagree on padded or packed batches, or ``packed`` and the
            collator do.
    """
    flat = flattens(collator)
    name = type(collator).__name__
    if packed is not None and flat is not None and flat != packed:
        raise ValueError(
            f"padding_free should match the data_collator, but got padding_free={packed} and a {name} that "
            f"{'flattens' if flat else 'pads'} batches; pass no data_collator (TRL builds its padding-free "
            f"one), or one that {'flattens' if packed else 'pads'}"
        )
    if flat is None:
        flat = packed
    if cost is None:
        if not flat:
            return CostModel()
        cost = CostModel(packing=attention_packing(model))
        logger.info(
            "batches are packs (whole examples in one row, %s): costed with packing=%r for the model's "
            "%s attention; pass cost=CostModel(..., packing=...) to choose",
            name,
            cost.packing,
            _upstream.attention_implementation(model) or "sdpa",
        )
        return cost
    if flat and cost.packing is None:
        wanted = attention_packing(model)
        raise ValueError(
            f"cost should be a packed cost model for a {name}, which flattens each batch into one row, "
            f"but got cost={cost!r}; pass dataclasses.replace(cost, packing={wanted!r}) ({wanted!r}: the "
            f"model's attention), or leave cost out"
        )
    if flat is False and cost.packing is not None:
        raise ValueError(
            f"cost should be padded (packing=None) for a {name}, which pads each batch, but got "
            f"packing={cost.packing!r}; pass {dataclasses.replace(cost, packing=None)!r}, or a collator that "
            f"flattens (transformers.DataCollatorWithFlattening)"
        )
    return cost
