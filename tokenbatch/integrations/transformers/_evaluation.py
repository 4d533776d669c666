"""Trainer's evaluation loop over token-budget batches: rows gathered as they are, the loss weighted by them.

Trainer's ``evaluation_loop`` gathers each step's logits and labels across
ranks with ``accelerator.gather_for_metrics``, which assumes every rank holds
a batch of the same size at the same step; token-budget batches differ (the
ranks' batches at a step are of similar cost, not of equal size), and the
gather aborts the job. :func:`gather_rows` pads the batch dimension to the
largest rank's, gathers, and drops the padding by each rank's true count, so
every example appears once, in the plan's order (rank 0's batch, then rank
1's, step after step).

Trainer's ``eval_loss`` is the mean of batch means (each batch's loss
repeated ``eval_batch_size`` times); with batches of varying size that is not
the mean over examples. :class:`EvalLoss` weights each batch's loss by the
items it averages (labelled tokens, or samples) and sums over the ranks, so it
is what one big batch would report.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from accelerate.utils import recursively_apply


def gather_rows(accelerator: Any, fallback: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A ``Trainer.gather_function`` for batches whose sizes differ between ranks.

    ``fallback`` (Trainer's own) handles one process and data that is not all tensors.
    """

    def gather(data: Any) -> Any:
        if accelerator.num_processes == 1:
            return fallback(data)
        try:
            recursively_apply(lambda tensor: tensor, data, error_on_other_type=True)
        except TypeError:  # not only tensors: Trainer's gathers them as objects, whatever their sizes
            return fallback(data)
        return recursively_apply(lambda tensor: _gather_tensor(accelerator, tensor), data)

    return gather


def _gather_tensor(accelerator: Any, tensor: torch.Tensor) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on dimension 0, each with its own number of rows."""
    if tensor.dim() == 0:
        return accelerator.gather(tensor)  # type: ignore[no-any-return]
    shape = torch.tensor(tensor.shape, dtype=torch.long, device=tensor.device)
    shapes = accelerator.gather(shape).reshape(accelerator.num_processes, -1).tolist()
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(
            f"cannot gather evaluation outputs of shapes {shapes} across ranks: only the batch dimension "
            f"may differ (Trainer pads dimension 1); pad the outputs to one shape in the model or in "
            f"preprocess_logits_for_metrics"
        )
    rows = [s[0] for s in shapes]
    most = max(rows)
    if tensor.shape[0] < most:
        padding = tensor.new_zeros((most - tensor.shape[0], *tensor.shape[1:]))
        tensor = torch.cat([tensor, padding])
    gathered = accelerator.gather(tensor.contiguous())
    return torch.cat([gathered[r * most : r * most + n] for r, n in enumerate(rows)])


class EvalLoss:
    """Evaluation losses, each weighted by the items it averages over; summed over ranks at the end."""

    def __init__(self, device: torch.device | str) -> None:
        # Weighted sum and weight over finite losses, then over all losses (Trainer filters NaN and inf).
        self.sums = torch.zeros(4, dtype=torch.float64, device=device)
        self.steps = 0
        """Batches evaluated on this rank (every rank evaluates as many)."""

    def add(self, loss: torch.Tensor, weight: float) -> None:
        value = loss.detach().double().reshape(())
        if value.device != self.sums.device:
            value = value.to(self.sums.device)
        weight_t = torch.tensor(float(weight), dtype=torch.float64, device=self.sums.device)
        finite = torch.isfinite(value)
        zero = torch.zeros((), dtype=torch.float64, device=self.sums.device)
        weighted = value * weight_t
        self.sums += torch.stack(
            [torch.where(finite, weighted, zero), torch.where(finite, weight_t, zero), weighted, weight_t]
        )

    def mean(self, accelerator: Any, *, finite_only: bool) -> float | None:
        """The weighted mean over all ranks (a collective: every rank calls it), None without a weight."""
        sums = accelerator.reduce(self.sums, reduction="sum") if accelerator.num_processes > 1 else self.sums
        finite_sum, finite_weight, total, weight = sums.tolist()
        if finite_only and finite_weight > 0:
            return float(finite_sum / finite_weight)
        return float(total / weight) if weight > 0 else None


def real_steps_per_second(metrics: dict[str, float], prefix: str, steps: int) -> None:
    """Make ``metrics``' ``<prefix>_steps_per_second`` (in place) the ``steps`` evaluated per second.

    Trainer counts ``ceil(examples / (per_device_eval_batch_size x processes))`` steps, which does not
    batch here. Its runtime stays as it measured it.
    """
    runtime = metrics.get(f"{prefix}_runtime")
    if f"{prefix}_steps_per_second" in metrics and runtime:
        metrics[f"{prefix}_steps_per_second"] = round(steps / runtime, 3)


@contextlib.contextmanager
def rank_local_loss(args: Any) -> Iterator[None]:
    """Evaluation losses averaged over this rank's batch, not over the items of every rank's.

    With ``average_tokens_across_devices``, Trainer's ``prediction_step``
    gathers the labelled items of all ranks and normalises each rank's loss
    by them: a collective in every evaluation step (which the evaluation
    guard cannot split), and a loss that is not the batch's own mean.
    """
    saved = getattr(args, "average_tokens_across_devices", None)
    if saved:
        args.average_tokens_across_devices = False
    try:
        yield
    finally:
        if saved:
            args.average_tokens_across_devices = saved


# -- predictions back in dataset order ---------------------------------------------


def reorder(value: Any, index: np.ndarray, count: int) -> Any:
    """``value[index]`` for every array of ``count`` rows in a (nested) prediction output."""
    if isinstance(value, np.ndarray | torch.Tensor) and value.ndim > 0 and len(value) == count:
        return value[index]
    if isinstance(value, tuple | list):
        return type(value)(reorder(v, index, count) for v in value)
    if isinstance(value, Mapping):
        return {k: reorder(v, index, count) for k, v in value.items()}
    return value


def inverse_order(order: Sequence[int] | np.ndarray) -> np.ndarray:
    """Where each sample sits in ``order``: ``output[inverse_order(order)]`` is in dataset order."""
    order = np.asarray(order)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(len(order))
    return inverse
