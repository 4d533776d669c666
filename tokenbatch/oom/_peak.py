"""Peak memory per step against its cost: a line fitted as training runs, and the budget it proposes.

On CUDA each guarded step's peak (``torch.cuda.max_memory_allocated``,
reset before the step) is paired with the cost of the batch this rank ran.
A least-squares line ``bytes = constant + per_cost * cost`` through those
pairs says which cost reaches a target fraction of the device's memory; the
ranks agree on the smallest proposal (one all-reduce every ``check_every``
steps) and the guard tries it like any larger budget, guarded, before any
out-of-memory error. Where there is nothing to read (CPU) the reader is None
and no proposal is made: the same code path, with no measurement.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

# Costs must spread this much before a line through them says anything about larger ones.
MIN_SPREAD = 1.2
MIN_POINTS = 4
KEEP = 64  # the latest pairs: an old one may predate a change (a new optimizer state)


@dataclass
class PeakFit:
    """``(cost, peak bytes)`` pairs of trained steps and the line through them.

    Example (forward + backward peaks of a 2-layer BERT, hidden size 64, measured on CPU
    with the torch profiler, as ``tokenbatch.probe`` does: padded tokens, bytes):
        >>> fit = PeakFit()
        >>> for cost, peak in [(256, 4384780), (512, 6887692), (512, 7674124), (1024, 11893516),
        ...                    (1024, 13487724), (2048, 21933804), (2048, 25145068)]:
        ...     fit.add(cost, peak)
        >>> round(fit.budget_for(100e6))  # the padded tokens a 100 MB peak allows
        9238
    """

    costs: list[float] = field(default_factory=list)
    peaks: list[float] = field(default_factory=list)

    def add(self, cost: float, peak: float) -> None:
        if cost > 0 and peak > 0 and math.isfinite(cost) and math.isfinite(peak):
            self.costs.append(float(cost))
            self.peaks.append(float(peak))
            del self.costs[:-KEEP], self.peaks[:-KEEP]

    def line(self) -> tuple[float, float] | None:
        """``(constant, bytes per cost unit)``, or None while the pairs cannot tell (too few, too alike)."""
        if len(self.costs) < MIN_POINTS or max(self.costs) < MIN_SPREAD * min(self.costs):
            return None
        slope, constant = np.polyfit(np.asarray(self.costs), np.asarray(self.peaks), 1)
        return (float(constant), float(slope)) if slope > 0 else None

    def budget_for(self, target_bytes: float) -> float | None:
        """The cost whose predicted peak is ``target_bytes``, or None (no line yet, or none fits)."""
        line = self.line()
        if line is None:
            return None
        constant, slope = line
        budget = (target_bytes - constant) / slope
        return budget if budget > 0 else None


def cuda_reader(model: nn.Module) -> tuple[Callable[[], float | None] | None, float | None]:
    """The peak reader and capacity for ``model``'s device: CUDA's counters, or ``(None, None)`` elsewhere."""
    param = next(model.parameters(), None)
    if param is None or param.device.type != "cuda" or not torch.cuda.is_available():
        return None, None
    device = param.device

    def read() -> float | None:
        peak = float(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
        return peak

    return read, float(torch.cuda.get_device_properties(device).total_memory)
