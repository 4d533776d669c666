"""Trainer's training step with its forward and backward passes run by :class:`~tokenbatch.OOMFallback`.

Also what a token-budget run cannot honour among ``TrainingArguments`` (:func:`check_supported`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tokenbatch.integrations import _upstream
from tokenbatch.oom import OOMFallback
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

logger = logging.getLogger("tokenbatch.integrations.transformers")


class SyncEveryStep:
    """The accelerator as the fallback sees it: gradients averaged across ranks after every batch.

    With gradient accumulation, the gradients of the group's earlier batches
    are kept aside while each batch runs (the fallback drops every gradient
    when a batch fails) and added back after, so each batch's gradients are
    averaged on their own: one all-reduce per batch rather than per group.
    """

    sync_gradients = True

    def __init__(self, accelerator: Any) -> None:
        self._accelerator = accelerator

    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        self._accelerator.backward(loss, **kwargs)


def count_items(batch: Any, *, shifts_labels: bool) -> float:
    """Items a batch's loss averages over, counted as Trainer counts ``num_items_in_batch``; else rows.

    ``shifts_labels``: the model's loss drops each row's first label (causal language models).
    """
    labels = batch.get("labels") if isinstance(batch, Mapping) else None
    if isinstance(labels, torch.Tensor) and labels.dim() > 0:
        if shifts_labels and labels.dim() > 1:
            labels = labels[..., 1:]
        return float((labels != -100).sum())
    values = batch.values() if isinstance(batch, Mapping) else [batch]
    first = next((v for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), None)
    return float(first.shape[0]) if first is not None else 1.0


def labelled_items(trainer: Any, batch: Any) -> float:
    """:func:`count_items` as ``trainer``'s loss counts them."""
    return count_items(batch, shifts_labels=_upstream.loss_shifts_labels(trainer))


def make_fallback(
    trainer: Any,
    sampler: TokenBudgetBatchSampler | TokenBudgetStream,
    model: nn.Module,
    state: dict[str, Any] | None,
) -> OOMFallback:
    """The trainer's fallback for ``model`` (as Trainer wrapped it), resumed from ``state`` if given."""
    pad_token_id = getattr(trainer.processing_class, "pad_token_id", None)
    # Shares that make the micro-batch losses add up to the batch loss (see share_loss); a stream's
    # batches formed before a re-budget run in micro-batches in halve mode too.
    weight = lambda piece: max(labelled_items(trainer, piece), 1e-12)  # noqa: E731
    fallback = OOMFallback(
        sampler,
        model,
        accelerator=SyncEveryStep(trainer.accelerator),
        mode=trainer.oom_mode,
        factor=trainer.oom_factor,
        min_tokens=trainer.oom_min_tokens,
        grow=trainer.oom_grow,  # halve mode: a growth re-plan restarts the feed like a shrinking one
        weight=weight,
        pad_token_id=pad_token_id,
    )
    if state:
        fallback._load_own_state(state)  # the Trainer has put the sampler where its loop is
    return fallback


def share_loss(
    compute: Callable[[Any, torch.Tensor | float | None], torch.Tensor],
    batch: Any,
    num_items: torch.Tensor | int | None,
    *,
    shifts_labels: bool,
    divisor: float,
) -> Callable[[Any], torch.Tensor]:
    """The fallback's ``loss_fn`` for ``batch``: ``compute(part, num_items_of_part) / divisor``.

    ``compute`` is Trainer's ``compute_loss`` for one (micro-)batch;
    ``divisor`` is the accumulation steps for a loss not yet scaled for them, else 1.
    """
    whole = count_items(batch, shifts_labels=shifts_labels)

    def loss_fn(part: Any) -> torch.Tensor:
        items: torch.Tensor | float | None = num_items
        count = count_items(part, shifts_labels=shifts_labels)
        if items is not None and part is not batch and count > 0 and whole > 0:
            # A loss normalised by num_items (a sum over items / N) becomes, for a micro-batch holding
            # a share w of the items, (its sum) / (N * w): times the fallback's weight w, the sum over N.
            items = items * (count / whole)
        # A copy: compute_loss may pop "labels", and a failed attempt is run again.
        inputs = dict(part) if isinstance(part, Mapping) else part
        loss = compute(inputs, items)
        return loss if divisor == 1 else loss / divisor

    return loss_fn


def guarded_backward(
    fallback: OOMFallback, model: nn.Module, batch: Any, loss_fn: Callable[[Any], torch.Tensor]
) -> torch.Tensor | None:
    """``fallback.backward(batch, loss_fn)``, with the gradients of the group's earlier batches kept.

    The Trainer's guarded steps all synchronise (``SyncEveryStep``), so the
    gradients of the group's earlier batches are averaged already: they are
    set aside while the fallback runs, so that its average covers this batch
    only, and added back after. (The fallback would keep them through a
    failure by itself too, but would then average them again.) Returns the
    detached loss, or None when the fallback re-planned the epoch (halve
    mode) instead of training this batch.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    kept: list[torch.Tensor | None] | None = [p.grad for p in params]
    if any(grad is not None for grad in kept or []):
        for param in params:
            param.grad = None
    else:
        kept = None
    try:
        return fallback.backward(batch, loss_fn)
    finally:
        if kept is not None:
            for param, grad in zip(params, kept, strict=True):
                if grad is not None:
                    param.grad = grad if param.grad is None else param.grad.add_(grad)


def check_supported(args: Any, oom_mode: str | None, *, sharded: str | None) -> None:
    """Raise for ``TrainingArguments`` ``args`` that a token-budget run cannot honour.

    ``sharded``: ``"DeepSpeed"`` or ``"FSDP"`` when one trains the model, else None.

    Raises:
        ValueError: ``auto_find_batch_size`` (it restarts the run), a
            fractional ``num_train_epochs`` (epochs have a varying number of
            steps), or an out-of-memory guard under DeepSpeed, FSDP or DataParallel.
    """
    if args.auto_find_batch_size:
        raise ValueError(
            "auto_find_batch_size=True restarts training with a smaller batch size on out-of-memory; "
            "TokenBudgetTrainer recovers in place instead (oom_mode): set auto_find_batch_size=False"
        )
    if args.max_steps <= 0 and not float(args.num_train_epochs).is_integer():
        raise ValueError(
            f"num_train_epochs should be a whole number with TokenBudgetTrainer (epochs have a varying "
            f"number of steps), but got num_train_epochs={args.num_train_epochs}; use max_steps instead"
        )
    if oom_mode is not None and sharded == "DeepSpeed":
        raise ValueError(
            f"oom_mode should be None under DeepSpeed, but got oom_mode={oom_mode!r}: DeepSpeed's engine "
            f"runs the backward pass and the optimizer step itself, so the guard can neither run a batch "
            f"again nor tell a rank's failure from a finished step. The sampler works unchanged with "
            f"oom_mode=None"
        )
    if oom_mode is not None and sharded == "FSDP":
        raise ValueError(
            f"oom_mode should be None under the Trainer's FSDP, but got oom_mode={oom_mode!r}: under FSDP "
            f"out of memory in the passes cannot be recovered from in place (the other ranks wait inside "
            f"FSDP's collectives), and the guard stops the job for a restart only where the lowered budget "
            f"is recorded for the restarted job (tokenbatch.probe.remember_budget), which TokenBudgetTrainer "
            f"does not do yet. Use oom_mode=None (the sampler works unchanged), or the accelerate loop of "
            f"docs/restarts.md (FSDP), which restarts the job from its last checkpoint"
        )
    if oom_mode is not None and args.n_gpu > 1:
        raise ValueError(
            f"oom_mode={oom_mode!r} guards single-process and DDP training (accelerate launch, "
            f"torchrun), not DataParallel; use oom_mode=None there, or launch one process per GPU"
        )
    strategy = getattr(args, "train_sampling_strategy", None)  # transformers 5; 4.x: group_by_length=True
    if strategy in ("group_by_length", "batch_rebalance") or getattr(args, "group_by_length", False):
        setting = f"train_sampling_strategy={strategy!r}" if strategy else "group_by_length=True"
        logger.warning("%s is ignored: batches follow the token budget", setting)
