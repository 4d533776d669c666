"""Every private attribute of another library that tokenbatch reads, in one place.

Each one is read here only, where no public hook does the job, and
``tests/test_upstream.py`` fails loudly, naming it, the day a release moves
it. Code elsewhere calls these functions and never reaches into another
library's private state itself.

- transformers' ``Trainer``: ``_prepare_inputs`` (the guarded training step
  moves a batch to the device as ``training_step`` does),
  ``_get_collator_with_removed_columns`` (a stream's DataLoader gets the
  collator Trainer would give it), ``_loss_shifts_labels`` (transformers 5:
  whether the loss drops each row's first label, so that labelled items
  are counted as Trainer counts them); a model config's ``_attn_implementation``
  (the attention kernel in use, which decides what a packed batch costs:
  transformers has no public getter for it);
- Lightning: the trainer's ``_accelerator_connector.use_distributed_sampler``
  (no public property says whether Lightning will replace the batch
  sampler) and the fit loop's ``_combined_loader`` (where Lightning keeps the
  epoch's length, which a token-budget epoch changes);
- accelerate: the ``Accelerator``'s ``_models`` (what it prepared: ``finish``
  warns when a DDP model outlives the process group, the cause of a hang at
  exit, and accelerate lists its prepared models nowhere public);
- ``warnings._filters_mutated`` (CPython): after one filter entry is taken
  out again, the modules' cached decisions must be dropped, as
  ``warnings.filterwarnings`` does itself.
"""

from __future__ import annotations

import warnings
from typing import Any


def prepare_inputs(trainer: Any, batch: Any) -> Any:
    """``Trainer._prepare_inputs(batch)``: the batch on the device, as ``training_step`` prepares it."""
    return trainer._prepare_inputs(batch)


def collator_without_unused_columns(trainer: Any, collator: Any) -> Any:
    """``Trainer._get_collator_with_removed_columns``: the collator Trainer's training DataLoader gets."""
    return trainer._get_collator_with_removed_columns(collator, description="training")


def loss_shifts_labels(trainer: Any) -> bool:
    """Whether the trainer's loss drops each row's first label (transformers 5; False on 4.x)."""
    return bool(getattr(trainer, "_loss_shifts_labels", False))


def attention_implementation(model: Any) -> str | None:
    """The attention kernel ``model`` runs (``config._attn_implementation``), or None without a config."""
    config = getattr(model, "config", None)
    value = getattr(config, "_attn_implementation", None)
    return value if isinstance(value, str) else None


def lightning_replaces_samplers(trainer: Any) -> bool:
    """Whether Lightning will put a ``DistributedSampler`` into the DataLoaders (its flag)."""
    connector = getattr(trainer, "_accelerator_connector", None)
    return bool(getattr(connector, "use_distributed_sampler", False))


def lightning_combined_loader(fit_loop: Any) -> Any:
    """The fit loop's combined training loader (Lightning's count of the epoch's batches), or None."""
    return getattr(fit_loop, "_combined_loader", None)


def accelerate_prepared_models(accelerator: Any) -> list[Any]:
    """The models ``accelerator.prepare`` returned (``Accelerator._models``)."""
    return list(getattr(accelerator, "_models", []))


def warnings_changed() -> None:
    """Drop the modules' cached warning decisions after a filter was removed by hand."""
    getattr(warnings, "_filters_mutated", lambda: None)()
