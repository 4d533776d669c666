"""Each optimizer step's learning rate scaled by the step's global size, inside Trainer's loop.

``TokenBudgetTrainer(lr_scaling="linear")`` applies :class:`~tokenbatch.BatchScaledLR`
around Trainer's ``optimizer.step()`` with :class:`StepScaling`, a callback:

- ``training_step`` calls :meth:`StepScaling.count` for every batch that
  trained on this rank (the whole batch once, however many micro-batches an
  out-of-memory split ran it as; never a no-op padding slot or a batch a
  halve-mode re-plan dropped before it trained);
- ``on_pre_optimizer_step`` (after gradient clipping) sums the count over
  ranks, once per optimizer step (a collective, at the same point on every
  rank), and scales every parameter group's rate by
  ``rule(step size / reference)``; ``on_optimizer_step`` restores it, so the
  LR scheduler steps, logs and checkpoints the unscaled rate.

The reference (``lr_reference=None``) is the step the user's
``learning_rate`` was tuned for: ``per_device_train_batch_size`` x processes x
``gradient_accumulation_steps`` samples, times the training set's mean length
when counting tokens::

    >>> reference_of(by="tokens", per_device=8, world=2, accumulation=1, mean_length=20.0)
    320.0
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from typing import Any

import numpy as np
import torch
from transformers import TrainerCallback

from tokenbatch._lr import BatchScaledLR, count_batch, global_count, lr_options
from tokenbatch._packs import packed_examples
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.integrations.transformers")


def reference_of(
    *, by: str, per_device: int, world: int, accumulation: int, mean_length: float | None
) -> float:
    """The default reference: the fixed batch ``learning_rate`` was set for, in samples or real tokens."""
    samples = float(per_device * world * accumulation)
    if by == "samples":
        return samples
    if mean_length is None:
        raise ValueError(
            "lr_reference should be given with lr_scaling_by='tokens' and an iterable train_dataset "
            "(its mean length is unknown before training), but got lr_reference=None; pass the real "
            "tokens per optimizer step (all processes) your learning_rate suits, or lr_scaling_by='samples'"
        )
    return samples * mean_length


def _rows(batch: Any) -> int:
    """Rows of ``batch``'s first tensor (a mapping's first value with a batch dimension)."""
    values = batch.values() if isinstance(batch, Mapping) else [batch]
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    return 0 if first is None else int(first.shape[0])


class StepScaling(TrainerCallback):
    """Scales the rate of each optimizer step by what trained in it on every rank (see the module).

    Args:
        rule: ``lr_scaling``: ``"linear"``, ``"sqrt"`` or ``"none"`` (inert: nothing counted, no collective).
        by: ``lr_scaling_by``: ``"tokens"`` (ones of the attention mask) or ``"samples"``.
        reference: ``lr_reference``, the step size the rate suits over all ranks; None: :func:`reference_of`.
        sampler: returns the run's sampler (its lengths give the mean length), or None.
    """

    def __init__(self, rule: Any, by: Any, reference: Any, *, sampler: Callable[[], Any]) -> None:
        self.rule, self.by, self.given = lr_options(rule, by, reference)
        self.enabled = self.rule != "none"
        self._sampler = sampler
        self.reference: float | None = self.given
        """The reference in force (resolved at the start of training)."""
        self._count = 0
        self._scaling: BatchScaledLR | None = None
        self._stack = ExitStack()
        self._scales: list[float] = []

    def check(self, *, deepspeed: bool, stream: bool) -> None:
        """Refuse what cannot work: DeepSpeed (its engine steps, not Trainer's ``optimizer.step()``),
        and a default reference in tokens for a stream (``stream``: an iterable train set)."""
        if self.enabled and deepspeed:
            raise ValueError(
                f"lr_scaling={self.rule!r} scales the rate around Trainer's optimizer.step(), which "
                f"DeepSpeed's engine replaces; use lr_scaling='none' with DeepSpeed"
            )
        if self.enabled and stream and self.by == "tokens" and self.given is None:
            reference_of(by=self.by, per_device=1, world=1, accumulation=1, mean_length=None)  # raises

    def count(self, batch: Any) -> None:
        """Add one batch that trained on this rank to the current optimizer step (a pack: its examples)."""
        if not self.enabled:
            return
        pack = packed_examples(batch)
        if pack is not None:
            self._count += len(pack.lengths) if self.by == "samples" else int(pack.lengths.sum())
            return
        mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
        if self.by == "samples":
            self._count += _rows(batch if mask is None else mask)
        elif mask is None:
            keys = list(batch)[:6] if isinstance(batch, Mapping) else type(batch).__name__
            raise TypeError(
                f"lr_scaling_by='tokens' counts the ones of each training batch's attention_mask, but got a "
                f"batch without one ({keys}); use a collator that returns it, or lr_scaling_by='samples'"
            )
        else:
            self._count += count_batch(mask, by="tokens")

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._count, self._scales = 0, []
        if not self.enabled:
            return
        how = "lr_reference"
        if self.given is None:
            sampler = self._sampler()
            lengths = sampler.lengths if isinstance(sampler, TokenBudgetBatchSampler) else None
            mean = None if lengths is None or len(lengths) == 0 else float(np.mean(lengths))
            per_device, world = args.per_device_train_batch_size, args.world_size
            accumulation = args.gradient_accumulation_steps
            self.reference = reference_of(
                by=self.by, per_device=per_device, world=world, accumulation=accumulation, mean_length=mean
            )
            how = (
                f"per_device_train_batch_size={per_device} x {world} process(es) x {accumulation} accumulated"
                + ("" if self.by == "samples" else f" x mean length {mean:.1f}")
            )
        logger.info(
            "lr_scaling=%r: each optimizer step's learning rate times %s(step %s / %g), %g = %s",
            self.rule,
            self.rule,
            self.by,
            self.reference,
            self.reference,
            how,
        )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if not self.enabled:
            return
        self._stack.close()  # a step that raised inside optimizer.step() left its rate: put it back first
        size, self._count = global_count(self._count), 0  # every rank, once per optimizer step
        if size == 0:  # nothing trained on any rank (zero gradients): the scheduler's rate stands
            return
        optimizer = kwargs["optimizer"]
        if self._scaling is None or self._scaling.optimizer is not optimizer:
            assert self.reference is not None  # set by on_train_begin
            self._scaling = BatchScaledLR(optimizer, reference=self.reference, by=self.by, rule=self.rule)
        self._scales.append(self._stack.enter_context(self._scaling.applied(size)))

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._stack.close()

    @contextmanager
    def restoring(self) -> Iterator[None]:
        """While inside (``train``): the rates are put back however training ends."""
        try:
            yield
        finally:
            self._stack.close()

    def pop_logs(self) -> dict[str, float]:
        """``{"lr_scale": mean multiplier}`` of the steps since the last call (empty when none or inert)."""
        scales, self._scales = self._scales, []
        return {"lr_scale": sum(scales) / len(scales)} if scales else {}
