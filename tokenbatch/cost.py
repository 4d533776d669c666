"""The units a token budget is counted in: the cost of one batch, padded or packed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import overload

import numpy as np

from tokenbatch import _checks

PACKINGS = ("varlen", "full")
"""How attention is computed on a packed row: per example ("varlen") or over the whole row ("full")."""


@dataclass(frozen=True)
class CostModel:
    """Estimated memory of one batch, in units of your choosing.

    A padded batch (the default) holds its examples in rows padded to the
    longest, ``L`` (``max_len`` rounded up to ``pad_to_multiple_of``)::

        cost = batch_size * (linear * L + quadratic * L**2 + per_sample)

    A packed batch (``packing``) holds whole examples one after another in one
    row with ``position_ids`` and no padding, as transformers'
    ``DataCollatorWithFlattening`` and TRL's ``padding_free=True`` collate them.
    With ``S`` the row's length (the examples' lengths ``L_i`` summed, rounded up
    to ``pad_to_multiple_of``) and ``n`` the examples::

        cost = linear * S + quadratic * A + per_sample * n
        A = sum(L_i**2)  with packing="varlen": attention per example (flash-attention varlen, flex)
        A = S**2         with packing="full": scores over the whole row (eager, sdpa), masked per example

    With the defaults the cost is simply the number of padded tokens; a
    positive ``quadratic`` term models attention scores, which grow with the
    square of the length. For bytes estimated from a transformers config, use
    ``tokenbatch.probe.MemoryModel.from_config(config).cost_model()`` (or
    ``.token_cost()`` for the same shape in token units).

    Args:
        linear: cost per padded token (activations that grow with length).
        quadratic: cost per pair of tokens in a sequence (attention scores).
        per_sample: fixed cost per sequence, whatever its length.
        pad_to_multiple_of: the collator's ``pad_to_multiple_of``; lengths (a
            packed row's length) are rounded up to it before costing.
        packing: None for padded batches; ``"varlen"`` or ``"full"`` for whole
            examples packed into one row, by how attention is computed on it.

    Example:
        >>> CostModel().cost(8, 100)  # 8 sequences padded to 100 tokens
        800.0
        >>> CostModel(quadratic=1 / 1024, pad_to_multiple_of=8).cost(2, 1020)
        4096.0
        >>> lengths = [512, 256, 256]  # padded: 3 * 512 tokens; packed: 1024, attention per example or not
        >>> [CostModel(quadratic=1 / 1024, packing=p).batch_cost(lengths) for p in (None, "varlen", "full")]
        [2304.0, 1408.0, 2048.0]
    """

    linear: float = 1.0
    quadratic: float = 0.0
    per_sample: float = 0.0
    pad_to_multiple_of: int = 1
    packing: str | None = None

    def __post_init__(self) -> None:
        for name in ("linear", "quadratic", "per_sample"):
            object.__setattr__(self, name, _checks.non_negative_number(name, getattr(self, name)))
        object.__setattr__(
            self,
            "pad_to_multiple_of",
            _checks.positive_int("pad_to_multiple_of", self.pad_to_multiple_of),
        )
        if self.packing is not None:
            _checks.one_of("packing", self.packing, PACKINGS)
        if self.linear == 0 and self.quadratic == 0 and self.per_sample == 0:
            raise ValueError(
                "CostModel needs at least one positive term, but got linear=0, quadratic=0, "
                "per_sample=0; use the default CostModel() to count padded tokens"
            )

    @classmethod
    def attention(
        cls, crossover: float = 512.0, *, pad_to_multiple_of: int = 1, packing: str | None = None
    ) -> CostModel:
        """Padded tokens plus quadratic attention, in token units.

        ``crossover`` is the sequence length at which a sequence's attention
        scores (quadratic in length) take as much memory as all its other
        activations (linear in length). The cost of a batch is
        ``batch_size * L * (1 + L / crossover)``: short sequences cost about
        their token count, a sequence of length ``crossover`` costs twice that.
        For a BERT-style encoder storing eager attention scores in 16-bit
        floats, Korthikanti et al. (2022) give about ``34 * hidden`` bytes per
        token and ``5 * heads`` bytes per token pair and layer, so
        ``crossover = 34 * hidden / (5 * heads)``: about 435 for bert-base.

        Example:
            >>> CostModel.attention(crossover=1024).cost(1, 1024)
            2048.0
        """
        crossover = _checks.positive_number("crossover", crossover)
        return cls(
            linear=1.0, quadratic=1.0 / crossover, pad_to_multiple_of=pad_to_multiple_of, packing=packing
        )

    def padded_length(self, max_len: np.ndarray | int) -> np.ndarray | int:
        """``max_len`` rounded up to ``pad_to_multiple_of``."""
        m = self.pad_to_multiple_of
        return -(-max_len // m) * m

    @overload
    def cost(self, batch_size: int, max_len: int) -> float: ...
    @overload
    def cost(self, batch_size: np.ndarray, max_len: np.ndarray | int) -> np.ndarray: ...
    @overload
    def cost(self, batch_size: int, max_len: np.ndarray) -> np.ndarray: ...

    def cost(self, batch_size: np.ndarray | int, max_len: np.ndarray | int) -> np.ndarray | float:
        """Cost of ``batch_size`` sequences padded to ``max_len``; numpy arrays broadcast.

        With ``packing``, the cost of ``batch_size`` examples of length
        ``max_len`` packed in one row: the costliest a packed batch of that
        many examples, none longer than ``max_len``, can be.
        """
        if self.packing is not None:
            count = np.asarray(batch_size, dtype=np.float64)
            length = np.asarray(max_len, dtype=np.float64)
            row = np.asarray(self.padded_length(np.asarray(count * length, dtype=np.int64)), np.float64)
            squares = count * length * length if self.packing == "varlen" else row * row
            packed = self.linear * row + self.quadratic * squares + self.per_sample * count
            return float(packed) if packed.ndim == 0 else packed
        result = np.asarray(batch_size, dtype=np.float64) * self.sample_cost(max_len)
        return float(result) if result.ndim == 0 else result

    def sample_cost(self, length: np.ndarray | int) -> np.ndarray:
        """Cost of one sequence padded to ``length`` (the batch's longest)."""
        padded = np.asarray(self.padded_length(np.asarray(length, dtype=np.int64)), dtype=np.float64)
        return self.linear * padded + self.quadratic * padded * padded + self.per_sample

    def batch_cost(self, lengths: Sequence[int] | np.ndarray) -> float:
        """Cost of one batch of examples of these lengths: padded to the longest, or packed in one row."""
        lengths = np.asarray(lengths, dtype=np.int64)
        return float(self.batch_costs(lengths, np.array([0, len(lengths)]))[0])

    def batch_costs(self, lengths: np.ndarray, offsets: np.ndarray) -> np.ndarray:
        """Each batch's cost, batch ``b`` holding ``lengths[offsets[b]:offsets[b + 1]]`` (never empty)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        starts, sizes = np.asarray(offsets[:-1]), np.diff(offsets)
        if len(sizes) == 0:
            return np.empty(0)
        if self.packing is None:
            costs: np.ndarray = sizes * self.sample_cost(np.maximum.reduceat(lengths, starts))
            return costs
        row = np.asarray(self.padded_length(np.add.reduceat(lengths, starts)), dtype=np.float64)
        if self.packing == "varlen":
            exact = lengths.astype(np.float64)
            squares = np.add.reduceat(exact * exact, starts)
        else:
            squares = row * row
        packed: np.ndarray = self.linear * row + self.quadratic * squares + self.per_sample * sizes
        return packed
