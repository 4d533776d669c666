"""The probe's strategies: measure steps, fit a grid and check the budget, or double then bisect.

:func:`tokenbatch.probe.find_max_tokens` is the public API; this module holds how it
chooses shapes. Budgets are in bytes (fit) or in the caller's cost units (search).
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from tokenbatch.cost import CostModel
from tokenbatch.probe._measure import Prober, held_bytes, model_device
from tokenbatch.probe._model import Measurement, MemoryModel, fit_memory

logger = logging.getLogger(__name__)


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
        estimate = MemoryModel.from_config(config, dtype=dtype, device=device.type, pad_to_multiple_of=pad)
        return estimate.token_cost()
    except (AttributeError, TypeError, ValueError):
        return CostModel(pad_to_multiple_of=pad)
