"""Fitting measured peak memory to ``constant + B * (linear*L + quadratic*L**2 + per_sample)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.probe._model import MemoryModel


@dataclass(frozen=True)
class Measurement:
    """Peak memory of one probe step on ``batch_size`` sequences of ``length`` tokens."""

    batch_size: int
    length: int
    peak_bytes: int
    """The step's peak: the larger of the two phases below (0 when it ran out of memory)."""
    forward_backward_bytes: int
    optimizer_step_bytes: int
    oom: bool
    seconds: float

    @property
    def tokens(self) -> int:
        """Padded tokens in the batch."""
        return self.batch_size * self.length


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best feasible least-squares
    solution over every subset of columns (the optimum is one of them, the problem being convex)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b * b))
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            sub = a[:, columns]
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((sub @ coef - b) ** 2))
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(a.shape[1])
                best[list(columns)] = coef
    return best


def fit_memory(measurements: Sequence[Measurement], *, pad_to_multiple_of: int = 1) -> MemoryModel:
    """Fit a :class:`MemoryModel` to measurements by non-negative, relative least squares.

    Forward + backward peaks are fitted to ``constant + B*(linear*L + quadratic*L**2 +
    per_sample)``, each point weighted by ``1 / measured`` so that the fit minimises
    relative error; ``step_peak`` is the largest optimizer-step peak seen. Runs that
    ran out of memory are ignored.

    Raises:
        ValueError: fewer than 4 measured shapes, or fewer than 3 distinct lengths.
    """
    pad_to_multiple_of = _checks.positive_int("pad_to_multiple_of", pad_to_multiple_of)
    ok = [m for m in measurements if not m.oom]
    shapes = {(m.batch_size, m.length) for m in ok}
    lengths = {m.length for m in ok}
    if len(shapes) < 4 or len(lengths) < 3:
        raise ValueError(
            f"fitting needs at least 4 measured shapes over at least 3 lengths, but got "
            f"{len(shapes)} shapes over lengths {sorted(lengths)}; measure more shapes"
        )
    b = np.array([m.batch_size for m in ok], dtype=np.float64)
    padded = CostModel(pad_to_multiple_of=pad_to_multiple_of).padded_length(
        np.array([m.length for m in ok], dtype=np.int64)
    )
    length = np.asarray(padded, dtype=np.float64)
    y = np.array([m.forward_backward_bytes for m in ok], dtype=np.float64)
    design = np.stack([np.ones_like(b), b * length, b * length**2, b], axis=1)
    # Scale columns to comparable magnitudes so lstsq is well conditioned.
    scale = np.abs(design).max(axis=0)
    weight = 1.0 / y
    coef = _nnls(design / scale * weight[:, None], y * weight) / scale
    return MemoryModel(
        constant=float(coef[0]),
        linear=float(coef[1]),
        quadratic=float(coef[2]),
        per_sample=float(coef[3]),
        step_peak=float(max(m.optimizer_step_bytes for m in ok)),
        pad_to_multiple_of=pad_to_multiple_of,
    )
