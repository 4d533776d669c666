"""The probe's entry point, :func:`find_max_tokens`, and what it returns."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.probe._measure import (
    LossFn,
    MakeBatch,
    Prober,
    ProbeStep,
    held_bytes,
    model_device,
    preserved,
)
from tokenbatch.probe._model import Measurement, MemoryModel, check_margin
from tokenbatch.probe._search import fit_budget, search_budget, search_cost


@dataclass(frozen=True)
class ProbeResult:
    """What the probe found: use ``TokenBudgetBatchSampler(lengths, r.max_tokens, cost=r.cost)``.

    Example:
        >>> r = ProbeResult(max_tokens=4096.0, cost=CostModel(quadratic=0.01), memory_limit=2**30,
        ...                 margin=0.1, method="search", max_len=128)
        >>> r.cost.cost(1, 128) <= r.max_tokens
        True
    """

    max_tokens: float
    """The budget, in units of :attr:`cost` (tokens when ``cost.linear == 1``)."""
    cost: CostModel
    memory_limit: float
    margin: float
    method: str
    max_len: int
    fit: MemoryModel | None = None
    """The fitted memory model in bytes (``method="fit"`` only)."""
    measurements: tuple[Measurement, ...] = ()
    """Steps the fit used, or every step the search tried."""
    checks: tuple[Measurement, ...] = ()
    """Steps at the suggested budget, not used by the fit: held out."""
    steps: int = 0
    """Training steps the probe measured (the warm-up step not counted)."""
    seconds: float = 0.0
    device: str = "cpu"

    def predicted_bytes(self, batch_size: int, length: int) -> float | None:
        """The fitted peak for a shape, or None without a fit."""
        return None if self.fit is None else self.fit.predict(batch_size, length)

    def table(self) -> list[dict[str, Any]]:
        """One row per measured step: shape, measured and predicted peak, relative error, held out or not."""
        rows = []
        for held_out, group in ((False, self.measurements), (True, self.checks)):
            for m in group:
                predicted = self.predicted_bytes(m.batch_size, m.length)
                rows.append(
                    {
                        "batch_size": m.batch_size,
                        "length": m.length,
                        "cost": float(self.cost.cost(m.batch_size, m.length)),
                        "measured_bytes": None if m.oom else m.peak_bytes,
                        "predicted_bytes": predicted,
                        "error": None if m.oom or predicted is None else predicted / m.peak_bytes - 1,
                        "held_out": held_out,
                        "oom": m.oom,
                    }
                )
        return rows

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict of everything above."""
        result = asdict(self)
        result["cost"] = {k: getattr(self.cost, k) for k in ("linear", "quadratic", "per_sample")}
        result["cost"]["pad_to_multiple_of"] = self.cost.pad_to_multiple_of
        result["table"] = self.table()
        return result


def default_memory_limit(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> int:
    """CUDA: free device memory plus what PyTorch already reserved; CPU: ``MemAvailable`` plus the
    bytes the model and optimizer already hold."""
    device = model_device(model)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    available = None
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return int(available + held_bytes(model, optimizer))


def _resolve_lengths(max_len: int | None, lengths: Any, min_len: int | None) -> tuple[int, int]:
    if lengths is not None:
        array = _checks.lengths_array(lengths)
        max_len = int(array.max()) if max_len is None else max_len
        min_len = int(array.min()) if min_len is None else min_len
    if max_len is None:
        raise ValueError("find_max_tokens needs max_len=... (the longest sequence) or lengths=[...]")
    max_len = _checks.positive_int("max_len", max_len)
    min_len = _checks.positive_int("min_len", min_len if min_len is not None else min(16, max_len))
    if min_len > max_len:
        raise ValueError(f"min_len should be <= max_len={max_len}, but got min_len={min_len}")
    return min_len, max_len


def find_max_tokens(
    model: torch.nn.Module,
    *,
    max_len: int | None = None,
    lengths: Sequence[int] | np.ndarray | None = None,
    memory_limit: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    method: str = "fit",
    cost: CostModel | None = None,
    margin: float = 0.1,
    min_len: int | None = None,
    make_batch: MakeBatch | None = None,
    loss_fn: LossFn | None = None,
    tolerance: float = 0.02,
    progress: bool = False,
) -> ProbeResult:
    """Measure the largest token budget whose worst batches fit under ``(1 - margin) * memory_limit``.

    Args:
        model: the model to train, on its device (a transformers model, or any
            module with ``make_batch`` and ``loss_fn``).
        max_len: the longest padded sequence you will train on.
        lengths: your data's lengths, instead of (or besides) ``max_len`` / ``min_len``.
        memory_limit: bytes; default :func:`default_memory_limit`.
        optimizer: the optimizer you will train with; default AdamW. Its state
            is restored afterwards, as are the weights and the RNGs.
        method: ``"fit"`` (measure a grid, fit a cost model) or ``"search"``
            (double then bisect the budget of ``cost``).
        cost: the cost model to search a budget for (``method="search"``;
            default: the analytic estimate from ``model.config`` in token
            units); for ``"fit"`` only its ``pad_to_multiple_of`` is used.
        margin: fraction of ``memory_limit`` kept free for fragmentation and
            memory outside PyTorch's allocator.
        min_len: the shortest sequence to check (default ``min(16, max_len)``).
        make_batch: ``(batch_size, length, generator) -> dict or tuple`` of
            tensors for the model; default synthetic token ids for transformers models.
        loss_fn: ``(output, batch) -> scalar``; default ``output.loss`` or the mean output.
        tolerance: relative width at which the search stops bisecting.
        progress: show a tqdm progress bar.

    Returns:
        A :class:`ProbeResult`; ``result.max_tokens`` and ``result.cost`` go to
        :class:`~tokenbatch.TokenBudgetBatchSampler`.

    Raises:
        ValueError: one sequence of ``max_len`` or the weights alone do not fit.
    """
    method = _checks.one_of("method", method, ("fit", "search"))
    margin = check_margin(margin)
    tolerance = _checks.positive_number("tolerance", tolerance)
    min_len, max_len = _resolve_lengths(max_len, lengths, min_len)
    pad = cost.pad_to_multiple_of if cost is not None else 1
    own_optimizer = optimizer is None
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    start = time.perf_counter()
    with preserved(model, None if own_optimizer else optimizer):
        runner = ProbeStep(model, optimizer, make_batch=make_batch, loss_fn=loss_fn)
        # Warm-up, not measured: optimizer state, kernels and workspaces exist from here on.
        runner.run(1, min_len, measure=False)
        limit = float(memory_limit) if memory_limit is not None else default_memory_limit(model, optimizer)
        limit = _checks.positive_number("memory_limit", limit)
        prober = Prober(runner, limit * (1 - margin), progress)
        try:
            if method == "fit":
                fitted, budget, measured, checks = fit_budget(
                    prober, min_len=min_len, max_len=max_len, pad=pad, memory_limit=limit, margin=margin
                )
                result_cost = fitted.token_cost()
                max_tokens = budget / fitted.bytes_per_token()
            else:
                result_cost = cost if cost is not None else search_cost(model, pad)
                fitted, checks = None, []
                max_tokens, measured = search_budget(
                    prober, result_cost, min_len=min_len, max_len=max_len, tolerance=tolerance
                )
        finally:
            prober.close()
    return ProbeResult(
        max_tokens=float(max_tokens),
        cost=result_cost,
        memory_limit=limit,
        margin=margin,
        method=method,
        max_len=max_len,
        fit=fitted,
        measurements=tuple(measured),
        checks=tuple(checks),
        steps=prober.steps,
        seconds=time.perf_counter() - start,
        device=str(runner.device),
    )
