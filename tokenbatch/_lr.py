"""Learning rates for batches of varying size: scale each step's rate by its size against a reference.

Under a token budget a step holds many short texts or a few long ones, and on
average more samples than the fixed batch size its learning rate was tuned
for. :class:`BatchScaledLR` multiplies every parameter group's learning rate
for the duration of one ``optimizer.step()`` and puts it back afterwards::

    lr in the step = lr * min(rule(step size / reference), max_scale)

    rule "linear": r         Goyal et al. 2017 (SGD: k times the batch, k times the rate)
    rule "sqrt":   sqrt(r)   Krizhevsky 2014; Malladi et al. 2022 derive it for Adam
    rule "none":   1         (to switch scaling off without changing the loop)

These are DeepSpeed's rules for variable batch sizes (``lr_scaling_method`` in
``deepspeed/runtime/data_pipeline/data_sampling/variable_batch_size_and_lr.py``,
PR #7104); ``reference`` is its ``base_batch_size``, counted in samples or in
real tokens (``by``). Unlike DeepSpeed's wrapper scheduler, the rate is put
back after the step, so an LR scheduler never sees the scaled value: its
schedule is unchanged, and scaling composes with any scheduler (step it
outside the ``with`` block, as usual after ``optimizer.step()``).

The step size must be *global*, the same number on every rank: the samples
(or tokens) of the whole optimizer step, over all ranks and all accumulated
micro-batches. :func:`count_batch` counts one collated batch and
:func:`global_count` sums a count over ranks; :meth:`BatchScaledLR.step_size`
does both. The sum is a collective: every rank must call it at every step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch

from tokenbatch import _checks
from tokenbatch import _distributed as distributed

#: The rules, by name: the learning-rate multiplier for a step ``ratio`` times the reference.
RULES: dict[str, Callable[[float], float]] = {
    "linear": lambda ratio: ratio,
    "sqrt": math.sqrt,
    "none": lambda ratio: 1.0,
}
UNITS = ("samples", "tokens")


def lr_options(rule: Any, by: Any, reference: Any) -> tuple[str, str, float | None]:
    """The ``lr_scaling``, ``lr_scaling_by`` and ``lr_reference`` options, checked for every entry point.

    Raises:
        ValueError: an unknown rule or unit, or a reference (or unit) given with ``lr_scaling="none"``.
    """
    rule = _checks.one_of("lr_scaling", rule, ("none", "linear", "sqrt"))
    by = _checks.one_of("lr_scaling_by", by, ("tokens", "samples"))
    given = None if reference is None else _checks.positive_number("lr_reference", reference)
    if rule == "none" and (given is not None or by != "tokens"):
        name, value = ("lr_reference", given) if given is not None else ("lr_scaling_by", by)
        raise ValueError(
            f"{name} is used only with lr_scaling='linear' or 'sqrt', but got {name}={value!r} with "
            f"lr_scaling='none'; set lr_scaling, or leave {name} at its default"
        )
    return rule, by, given


def count_batch(batch: Any, *, by: str = "samples") -> int:
    """Samples (rows) or real tokens (ones in the attention mask) of one collated batch on this rank.

    Args:
        batch: a mapping with an ``attention_mask`` (what transformers' collators
            return) or the attention mask itself, a 2-D ``(batch, sequence)`` tensor.
        by: ``"samples"`` or ``"tokens"``.

    >>> import torch
    >>> batch = {"attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    >>> count_batch(batch), count_batch(batch, by="tokens")
    (2, 4)
    """
    by = _checks.one_of("by", by, UNITS)
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else batch
    if not isinstance(mask, torch.Tensor):
        got = f"a {type(batch).__name__} with keys {list(batch)[:6]}" if isinstance(batch, Mapping) else None
        raise TypeError(
            "batch should be a mapping with an 'attention_mask' tensor, or that tensor, but got "
            + (got or f"batch={batch!r:.80}")
        )
    if mask.ndim != 2:
        raise ValueError(
            f"attention_mask should be a 2-D (batch, sequence) tensor, but got shape {tuple(mask.shape)}"
        )
    return int(mask.shape[0]) if by == "samples" else int(mask.count_nonzero())


def global_count(count: int) -> int:
    """``count`` summed over all ranks (itself on one process).

    A collective: every rank must call it, at the same point of the same
    step, or the ranks that did wait for the others forever.
    """
    count = _checks.non_negative_int("count", count)
    return int(distributed.all_reduce_sum(torch.tensor([count], dtype=torch.int64))[0])


def global_token_count(batch: Any) -> int:
    """The real tokens of ``batch`` summed over all ranks: the denominator of a per-token loss.

    The LLM fine-tuning convention divides the summed token losses of a step by
    the step's tokens on all ranks, so that every token weighs the same however
    they fall into batches. Gradients averaged over ranks (DDP, ``OOMFallback``)
    then want the loss multiplied by the world size::

        loss = token_losses.sum() / global_token_count(batch) * world_size

    With accumulated micro-batches, sum :func:`count_batch` over them and pass
    it to :func:`global_count` instead. Every rank must call it (a collective).
    """
    return global_count(count_batch(batch, by="tokens"))


class BatchScaledLR:
    """Scale the learning rate of each optimizer step by the step's size against ``reference``.

    Args:
        optimizer: any optimizer with ``param_groups`` (``torch.optim``, or
            accelerate's prepared one). Every group's ``lr`` is scaled.
        reference: the step size the learning rate was tuned for, over all ranks
            (DeepSpeed's ``base_batch_size``): a fixed batch size of 32 on 2
            processes is ``reference=64``, in samples.
        by: the unit of ``reference`` and of step sizes: ``"samples"``, or
            ``"tokens"`` (real tokens; the reference is then, say, the fixed
            batch size times the mean length). Under a token budget, tokens vary
            far less from step to step than samples do, and scaled better in the
            emotion benchmark (``examples/emotion/README.md``).
        rule: ``"linear"`` (the default, as in DeepSpeed; the better of the two
            in that benchmark, with Adam), ``"sqrt"`` or ``"none"``.
        max_scale: optional upper bound on the multiplier.

    Use it around the step, with a size that is the same on every rank::

        for batch in loader:
            loss = fallback.backward(batch, loss_fn)
            if loss is not None:
                with scaling.applied(scaling.step_size(batch)):
                    optimizer.step()
                scheduler.step()  # sees and sets the unscaled rate
                optimizer.zero_grad()

    (``fallback.step(optimizer)``, the guarded step, goes in the block the same way.)

    >>> import torch
    >>> optimizer = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1)
    >>> scaling = BatchScaledLR(optimizer, reference=32, rule="linear")
    >>> batch = {"attention_mask": torch.ones(64, 10, dtype=torch.long)}
    >>> size = scaling.step_size(batch)  # every rank calls it: the step's samples on all ranks
    >>> with scaling.applied(size) as scale:
    ...     lr_in_step = optimizer.param_groups[0]["lr"]
    ...     optimizer.step()
    >>> size, scale, lr_in_step, optimizer.param_groups[0]["lr"]
    (64, 2.0, 0.2, 0.1)
    """

    def __init__(
        self,
        optimizer: Any,
        *,
        reference: float,
        by: str = "samples",
        rule: str = "linear",
        max_scale: float | None = None,
    ) -> None:
        if not isinstance(getattr(optimizer, "param_groups", None), list):
            raise TypeError(
                f"optimizer should be an optimizer with param_groups (torch.optim or accelerate's), "
                f"but got optimizer={optimizer!r:.80}"
            )
        self.optimizer = optimizer
        self.reference = _checks.positive_number("reference", reference)
        self.by = _checks.one_of("by", by, UNITS)
        self.rule = _checks.one_of("rule", rule, tuple(RULES))
        self.max_scale = None if max_scale is None else _checks.positive_number("max_scale", max_scale)
        self._active = False

    def __repr__(self) -> str:
        return (
            f"BatchScaledLR(reference={self.reference:g}, by={self.by!r}, rule={self.rule!r}, "
            f"max_scale={self.max_scale})"
        )

    def scale(self, size: float) -> float:
        """The learning-rate multiplier for a step of ``size`` samples or tokens (over all ranks)."""
        size = _checks.positive_number("size", size)
        factor = RULES[self.rule](size / self.reference)
        return factor if self.max_scale is None else min(factor, self.max_scale)

    def step_size(self, *batches: Any) -> int:
        """The samples or tokens (``by``) of ``batches`` on every rank: this step's global size.

        Pass all the micro-batches accumulated into the step (those whose
        backward pass trained). A collective: every rank must call it.
        """
        if not batches:
            raise TypeError("step_size() should be given the step's batches, but got none")
        return global_count(sum(count_batch(batch, by=self.by) for batch in batches))

    @contextmanager
    def applied(self, size: float) -> Iterator[float]:
        """Every group's ``lr`` times :meth:`scale` of ``size`` inside the block; yields the multiplier.

        The rates are restored on leaving the block, even on an error.
        """
        if self._active:
            raise RuntimeError("BatchScaledLR.applied() should not be nested: it is already in force")
        factor = self.scale(size)
        groups = self.optimizer.param_groups
        # A tensor lr (capturable or fused steps hold on to it) is scaled in place, not replaced.
        saved = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"] for g in groups]
        self._active = True
        try:
            for group in groups:
                if isinstance(group["lr"], torch.Tensor):
                    group["lr"].mul_(factor)
                else:
                    group["lr"] = group["lr"] * factor
            yield factor
        finally:
            for group, lr in zip(groups, saved, strict=True):
                if isinstance(lr, torch.Tensor):
                    group["lr"].copy_(lr)
                else:
                    group["lr"] = lr
            self._active = False
