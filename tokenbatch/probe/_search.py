"""Searching the token budget that fits: :func:`find_max_tokens` and what it returns.

Two strategies choose which steps to measure (each one a real forward +
backward + optimizer step on a worst-case batch, :mod:`tokenbatch.probe._measure`):
:func:`fit_budget` measures a grid of shapes near the limit, fits a
:class:`~tokenbatch.probe.MemoryModel` and checks the budget on held-out worst
cases, with budgets in bytes; :func:`search_budget` doubles then bisects a
budget in the caller's cost units.
"""

from __future__ import annotations

import logging
import math
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
    batch_maker,
    held_bytes,
    model_device,
    preserved,
)
from tokenbatch.probe._model import Measurement, MemoryModel, check_margin, fit_memory, resolve_task

logger = logging.getLogger(__name__)


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
    batch: Any = None,
    make_batch: MakeBatch | None = None,
    loss_fn: LossFn | None = None,
    tolerance: float = 0.02,
    progress: bool = False,
) -> ProbeResult:
    """Measure the largest token budget whose worst batches fit under ``(1 - margin) * memory_limit``.

    Args:
        model: the model to train, on its device (a transformers model, or any
            module with ``batch`` or ``make_batch``, and ``loss_fn``).
        max_len: the longest padded sequence you will train on.
        lengths: your data's lengths, instead of (or besides) ``max_len`` / ``min_len``.
        memory_limit: bytes; default: on CUDA the free device memory plus what PyTorch
            already reserved, on CPU ``MemAvailable`` plus what the model and optimizer hold.
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
        batch: one real collated batch (a dict of tensors, labels and all, of two or more
            rows) that every measured batch copies at its own shape, for a model whose forward
            needs more than synthetic token ids: its keys and dtypes; tensors of shape (rows,
            padded length, ...) stretched to the shape with values drawn from its real tokens
            (``attention_mask`` all ones but the last token); per-row tensors (labels) with
            rows drawn from its rows; anything else as it is.
        make_batch: ``(batch_size, length, generator) -> dict or tuple`` of
            tensors for the model, instead of ``batch``; default synthetic token ids for
            transformers models.
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
    make_batch = batch_maker(batch, make_batch)
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


def lengths_between(min_len: int, max_len: int, count: int) -> list[int]:
    grid = np.geomspace(min_len, max_len, count) if max_len > min_len else np.array([max_len])
    return sorted({round(float(x)) for x in grid})


def fit_budget(
    prober: Prober, *, min_len: int, max_len: int, pad: int, memory_limit: float, margin: float
) -> tuple[MemoryModel, float, list[Measurement], list[Measurement]]:
    """Measure a grid near the limit, fit, check the budget on held-out worst cases; budget in bytes."""
    target, runner = prober.target, prober.runner
    idle = (
        torch.cuda.memory_allocated(runner.device)
        if runner.device.type == "cuda"
        else held_bytes(runner.model, runner.optimizer)
    )
    room = target - idle
    # Pilot: double the batch of longest sequences until it fills half the room.
    pilot: list[Measurement] = []
    batch = 1
    while True:
        m = prober.measure(batch, max_len)
        pilot.append(m)
        if not prober.fits(m):
            if batch == 1:
                found = "out of memory" if m.oom else f"{m.peak_bytes:,} bytes"
                raise ValueError(
                    f"one sequence of max_len={max_len} tokens does not fit under {target:,.0f} bytes "
                    f"({found}); lower max_len (truncate) or raise memory_limit"
                )
            break
        if m.forward_backward_bytes - idle >= 0.5 * room or batch >= 2**24:
            break
        batch *= 2
    last = [m for m in pilot if not m.oom][-1]
    per_sequence = max((last.forward_backward_bytes - idle) / last.batch_size, 1.0)
    if pilot[-1].oom:  # the device holds less than memory_limit says
        room = min(room, per_sequence * pilot[-1].batch_size)
    # Small steps are dominated by gradients that the end of backward allocates; fit the big ones.
    measured = [m for m in pilot if m.oom or m.forward_backward_bytes - idle >= 0.2 * room]
    # At shorter lengths, batches filling about half and all of the room if memory grew linearly
    # with length (an overestimate of the batch only when per-sequence terms dominate).
    for length in lengths_between(min_len, max_len, 4)[:-1]:
        full = room / (per_sequence * length / max_len)
        for fraction in (0.5, 0.95):
            size = max(1, int(full * fraction))
            m = prober.measure(size, length)
            measured.append(m)
            while m.oom and size > 1:
                size //= 2
                m = prober.measure(size, length)
                measured.append(m)
    fitted = fit_memory(measured, pad_to_multiple_of=pad)
    cost = fitted.cost_model()
    # A step that ran out of memory bounds what the device holds by its predicted peak.
    limit = min([memory_limit] + [fitted.predict(m.batch_size, m.length) for m in measured if m.oom])
    budget = fitted.budget(limit, margin=margin)
    # The worst batches the budget allows (longest, middle, shortest sequences), held out from the
    # fit; if one runs out of memory or measures above the target, lower the budget and check again.
    checks: list[Measurement] = []
    for _ in range(8):
        checks = [
            prober.measure(int(budget // float(cost.sample_cost(length))), length)
            for length in check_lengths(min_len, max_len)
            if budget >= float(cost.sample_cost(length))
        ]
        if any(c.oom for c in checks):
            limit = min([limit] + [fitted.predict(c.batch_size, c.length) for c in checks if c.oom])
            budget = min(0.99 * budget, fitted.budget(limit, margin=margin))
            continue
        target = limit * (1 - margin)
        worst = max(c.peak_bytes for c in checks)
        if worst <= target:
            break
        budget *= 0.99 * (target - fitted.constant) / (worst - fitted.constant)
    else:
        logger.warning("the probe's budget still failed its checks after 8 corrections")
    return fitted, budget, measured, checks


def check_lengths(min_len: int, max_len: int) -> list[int]:
    grid = lengths_between(min_len, max_len, 3)
    return sorted({max_len, grid[len(grid) // 2], min_len}, reverse=True)


def search_budget(
    prober: Prober, cost: CostModel, *, min_len: int, max_len: int, tolerance: float
) -> tuple[float, list[Measurement]]:
    """Double the budget until a worst-case batch does not fit, then bisect; budget in cost units."""
    tried: list[Measurement] = []
    # Peak memory grows with the batch at a given length, so a measured step also settles every
    # smaller batch (fits) or larger one (does not) at that length: near the end of the bisection
    # the longest lengths' batch sizes stop changing, and those steps need not run again.
    largest_fit: dict[int, int] = {}
    smallest_miss: dict[int, int] = {}
    order = check_lengths(min_len, max_len)

    def fits(budget: float) -> bool:
        for length in list(order):
            size = int(budget // float(cost.sample_cost(length)))
            if size < 1 or size <= largest_fit.get(length, 0):
                continue
            if size < smallest_miss.get(length, size + 1):
                m = prober.measure(size, length)
                tried.append(m)
                if prober.fits(m):
                    largest_fit[length] = size
                    continue
                smallest_miss[length] = size
            # The length that failed is the likeliest to fail the next budget too: check it first.
            order.remove(length)
            order.insert(0, length)
            return False
        return True

    low = float(cost.sample_cost(max_len))
    if not fits(low):
        raise ValueError(
            f"one sequence of max_len={max_len} tokens does not fit under {prober.target:,.0f} bytes; "
            f"lower max_len (truncate) or raise memory_limit"
        )
    high = 2 * low
    while fits(high):
        low, high = high, 2 * high
        if high > 2**60:
            raise ValueError("the budget kept doubling without running out of memory; set memory_limit")
    while high / low > 1 + tolerance:
        middle = math.sqrt(low * high)
        if fits(middle):
            low = middle
        else:
            high = middle
    return low, tried


def search_cost(model: torch.nn.Module, pad: int) -> CostModel:
    """The analytic cost from ``model.config`` in token units, else plain padded tokens."""
    config = getattr(model, "config", None)
    device = model_device(model)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    try:
        task = resolve_task(config, model=model)
        estimate = MemoryModel.from_config(
            config, dtype=dtype, device=device.type, task=task, pad_to_multiple_of=pad
        )
        return estimate.token_cost()
    except (AttributeError, TypeError, ValueError):
        return CostModel(pad_to_multiple_of=pad)
