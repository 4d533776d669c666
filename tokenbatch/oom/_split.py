"""Reading a collated batch and cutting it into micro-batches that fit a budget.

The OOM fallback's split mode works on whatever the collator returned: a
dict (or ``BatchEncoding``) of tensors with the batch on dimension 0, a
tuple or list of them, or one tensor. Each row's length comes from the
``attention_mask`` (else ``input_ids`` against a pad id, else the padded
width), and micro-batches are packed longest first so that each one can be
trimmed to its own longest row when the batch is padded on the right.

A flattened batch (a pack: whole examples in one row, with ``position_ids``;
see :mod:`tokenbatch._packs`) is read as its examples, and cut into smaller
packs of whole examples, each one a flattened batch as the collator would
have made it of those examples. Every batch, padded or packed, is costed as
the cost model says (:meth:`~tokenbatch.CostModel.batch_cost` of its lengths).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch._packs import PackedExamples, packed_examples, take_examples
from tokenbatch.cost import CostModel
from tokenbatch.plan import fit_count

Piece = tuple[Any, float, np.ndarray]
"""A micro-batch, its loss weight, and its rows (a pack's examples) in the batch."""

Weight = str | Callable[[Any], float] | None


def check_weight(weight: Any) -> Weight:
    """``weight`` as the micro-batch options take it: ``"samples"``, ``"tokens"``, a function or None."""
    if not (weight is None or weight in ("samples", "tokens") or callable(weight)):
        raise ValueError(
            f"weight should be 'samples', 'tokens', a function or None, but got weight={weight!r}"
        )
    return weight  # type: ignore[no-any-return]


@dataclass(frozen=True)
class BatchShape:
    """What the splitter needs to know about one collated batch.

    Its units are rows, or a pack's examples (``packed``): ``size`` and
    ``lengths`` count those, and micro-batches take whole ones.
    """

    size: int
    """Rows in the batch (a pack: examples)."""
    width: int
    """The padded sequence length (a pack: its row's length; 1 for batches without a sequence dimension)."""
    lengths: np.ndarray
    """Each row's (example's) real length."""
    right_padded: bool
    """Padding sits at the end of each row, so trailing columns can be trimmed."""
    packed: PackedExamples | None = None
    """Where a flattened batch's examples are; None for a padded batch."""

    def cost(self, cost: CostModel, rows: np.ndarray | None = None) -> float:
        """The cost of ``rows`` (default: all) as a batch of their own, padded or packed as ``cost`` says."""
        return cost.batch_cost(self.lengths if rows is None else self.lengths[rows])

    def tokens(self, rows: np.ndarray) -> float:
        """What ``weight="tokens"`` counts of ``rows``: real tokens, or a pack's labelled ones.

        A flattened row's loss (``model(**batch).loss``) is a mean over its
        labelled tokens, and each example's first label is -100, so each
        example's count is its own: shares by it add up to the pack's mean.
        """
        if self.packed is not None and self.packed.labelled is not None:
            return float(self.packed.labelled[rows].sum())
        return float(self.lengths[rows].sum())

    def weight(self, weight: Weight) -> str | Callable[[Any], float]:
        """``weight`` in force for this batch: None is ``"tokens"`` for a pack, ``"samples"`` otherwise."""
        if weight is None:
            return "tokens" if self.packed is not None else "samples"
        return weight


def _tensors(batch: Any) -> list[tuple[str | int, torch.Tensor]]:
    if isinstance(batch, torch.Tensor):
        return [(0, batch)]
    if isinstance(batch, Mapping):
        return [(k, v) for k, v in batch.items() if isinstance(v, torch.Tensor)]
    if isinstance(batch, (tuple, list)):
        return [(i, v) for i, v in enumerate(batch) if isinstance(v, torch.Tensor)]
    return []


def inspect_batch(batch: Any, pad_token_id: int | None = None) -> BatchShape:
    """The rows, padded width and real row lengths of a collated batch.

    Raises:
        TypeError: the batch holds no tensor with a batch dimension.
    """
    packed = packed_examples(batch)
    if packed is not None:
        return BatchShape(len(packed.lengths), packed.width, packed.lengths, False, packed)
    tensors = _tensors(batch)
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        bool_mask = mask.detach().to("cpu") != 0
        lengths = bool_mask.sum(dim=1).numpy().astype(np.int64)
        # Right padding: every row starts with a real token (rows are never empty).
        right = bool(bool_mask[:, 0].all())
        return BatchShape(int(mask.shape[0]), int(mask.shape[1]), np.maximum(lengths, 1), right)
    if isinstance(ids, torch.Tensor) and ids.dim() == 2:
        size, width = int(ids.shape[0]), int(ids.shape[1])
        if pad_token_id is None:
            return BatchShape(size, width, np.full(size, width, np.int64), False)
        real = ids.detach().to("cpu") != pad_token_id
        lengths = np.maximum(real.sum(dim=1).numpy().astype(np.int64), 1)
        return BatchShape(size, width, lengths, bool(real[:, 0].all()))
    candidates = [t for _, t in tensors if t.dim() >= 1]
    if not candidates:
        raise TypeError(
            f"cannot split a batch of type {type(batch).__name__} with no tensor in it; the collator "
            f"should return a dict, tuple or list of tensors with the batch on dimension 0"
        )
    first = candidates[0]
    size = int(first.shape[0])
    width = int(first.shape[1]) if first.dim() >= 2 else 1
    return BatchShape(size, width, np.full(size, width, np.int64), False)


def plan_micro_batches(
    shape: BatchShape, cost: CostModel, budget: float, *, fill: bool = False, at_least: int = 1
) -> list[np.ndarray]:
    """Rows of each micro-batch, longest first, each within ``budget`` (a row alone may exceed it).

    Greedy packing along the rows sorted by length gives the fewest
    micro-batches; the rows are then shared out evenly among that many, when
    every share still fits, so that no micro-batch is a small remainder.
    ``fill``: keep the greedy cut, whose first micro-batch fills ``budget`` as far
    as the rows allow (growth's try of a larger budget is proven by a piece that large).
    With ``cost.packing`` the micro-batches are packs: see :func:`plan_packs`.
    ``at_least``: halve the micro-batch with the most rows (a pack's: examples) until there are that
    many, or every micro-batch is one row (ranks under FSDP run as many passes as the rank that needs
    the most); part of a micro-batch that fits fits too.

    Example:
        >>> shape = BatchShape(4, 4, np.array([4, 4, 4, 4]), right_padded=True)
        >>> [len(rows) for rows in plan_micro_batches(shape, CostModel(), 12.0)]  # shared out evenly
        [2, 2]
        >>> [len(rows) for rows in plan_micro_batches(shape, CostModel(), 12.0, fill=True)]
        [3, 1]
    """
    if cost.packing is not None:
        return _at_least(plan_packs(shape.lengths, cost, budget, fill=fill), at_least)
    order = np.argsort(-shape.lengths, kind="stable")
    units = cost.sample_cost(shape.lengths[order])  # each row's cost padded to itself, longest first

    def fits(sizes: list[int]) -> bool:
        starts = np.cumsum([0, *sizes[:-1]])
        return all(
            n == 1 or n * float(units[start]) <= budget for start, n in zip(starts, sizes, strict=True)
        )

    greedy: list[int] = []
    start = 0
    while start < len(order):
        greedy.append(max(1, fit_count(float(units[start]), budget, len(order) - start)))
        start += greedy[-1]
    parts = len(greedy)
    even = [len(order) // parts + (1 if i < len(order) % parts else 0) for i in range(parts)]
    sizes = even if not fill and fits(even) else greedy
    bounds = np.cumsum([0, *sizes])
    return _at_least([np.sort(order[a:b]) for a, b in itertools.pairwise(bounds)], at_least)


def _at_least(groups: list[np.ndarray], at_least: int) -> list[np.ndarray]:
    """``groups`` with the largest halved until there are ``at_least``, or each holds one."""
    while len(groups) < at_least and max(len(g) for g in groups) > 1:
        widest = max(range(len(groups)), key=lambda i: len(groups[i]))
        rows = groups[widest]
        groups[widest : widest + 1] = [rows[: (len(rows) + 1) // 2], rows[(len(rows) + 1) // 2 :]]
    return groups


class _Packs:
    """Packs being filled: per pack its examples and the sums its cost depends on."""

    def __init__(self, cost: CostModel, parts: int = 0) -> None:
        self.cost = cost
        self.members: list[list[int]] = [[] for _ in range(parts)]
        self.counts = np.zeros(parts)
        self.totals = np.zeros(parts, np.int64)
        self.squares = np.zeros(parts)

    def costs(self, length: int = 0) -> np.ndarray:
        """Each pack's cost with one more example of ``length`` (0: as it is), as ``CostModel.batch_cost``."""
        cost = self.cost
        extra = 1 if length else 0
        row = np.asarray(cost.padded_length(self.totals + length), dtype=np.float64)
        area = self.squares + float(length) ** 2 if cost.packing == "varlen" else row * row
        counts = self.counts + extra
        value: np.ndarray = cost.linear * row + cost.quadratic * area + cost.per_sample * counts
        return value

    def add(self, pack: int, example: int, length: int) -> None:
        if pack == len(self.members):
            self.members.append([])
            self.counts, self.totals = np.append(self.counts, 0), np.append(self.totals, 0)
            self.squares = np.append(self.squares, 0.0)
        self.members[pack].append(example)
        self.counts[pack] += 1
        self.totals[pack] += length
        self.squares[pack] += float(length) ** 2

    def groups(self) -> list[np.ndarray]:
        return [np.sort(np.asarray(m, dtype=np.int64)) for m in self.members if m]


def plan_packs(
    lengths: np.ndarray, cost: CostModel, budget: float, *, fill: bool = False
) -> list[np.ndarray]:
    """The examples of each smaller pack of a pack, each within ``budget`` (an example alone may not be).

    First fit over the examples, longest first, gives few packs, the first
    ones full; unless ``fill``, the examples are then dealt out, longest
    first, to the cheapest of that many packs, where every one still fits, so
    that no pack is a small remainder. Each pack lists its examples in the
    batch's order.

    Example:
        >>> cost, lengths = CostModel(packing="varlen"), np.array([4, 4, 4, 4, 1, 1])
        >>> [g.tolist() for g in plan_packs(lengths, cost, 12.0)]  # dealt out: 9 tokens each
        [[0, 2, 4], [1, 3, 5]]
        >>> [g.tolist() for g in plan_packs(lengths, cost, 12.0, fill=True)]  # first fit: 12 and 6
        [[0, 1, 2], [3, 4, 5]]
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(-lengths, kind="stable")
    first = _Packs(cost)
    for example in order.tolist():
        length = int(lengths[example])
        fits = np.flatnonzero(first.costs(length) <= budget)
        first.add(int(fits[0]) if len(fits) else len(first.members), example, length)
    if fill or len(first.members) < 2:
        return first.groups()
    dealt = _Packs(cost, len(first.members))
    for example in order.tolist():
        length = int(lengths[example])
        dealt.add(int(np.argmin(dealt.costs())), example, length)
    alone = dealt.counts == 1
    return dealt.groups() if bool(np.all((dealt.costs() <= budget) | alone)) else first.groups()


def take_rows(batch: Any, shape: BatchShape, rows: np.ndarray, width: int | None) -> Any:
    """The sub-batch of ``rows``; tensors over (batch, sequence) cut to ``width`` columns if given.

    A tensor is treated as per-token (and trimmed) when its first two
    dimensions are (batch, padded width) and it is an integer or boolean
    matrix (ids, masks, token labels) or has three or more dimensions
    (embeddings); a float matrix of that shape (multi-label targets) is not.
    Of a pack, ``rows`` are examples, and the sub-batch is their pack
    (:func:`tokenbatch._packs.take_examples`).
    """
    if shape.packed is not None and isinstance(batch, Mapping):
        return take_examples(batch, shape.packed, rows)
    index = torch.as_tensor(rows, dtype=torch.long)

    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != shape.size:
                return value
            part = value.index_select(0, index.to(value.device))
            per_token = (
                value.dim() >= 2
                and value.shape[1] == shape.width
                and (value.dim() >= 3 or not value.is_floating_point())
            )
            return part[:, :width] if width is not None and per_token else part
        if isinstance(value, list) and len(value) == shape.size:
            return [value[i] for i in rows.tolist()]
        return value

    if isinstance(batch, torch.Tensor):
        return cut(batch)
    if isinstance(batch, Mapping):
        data = {key: cut(value) for key, value in batch.items()}
        kind: Any = type(batch)  # dict, BatchEncoding, ...: keep the collator's type where it allows
        try:
            return kind(data)
        except TypeError:
            return data
    if isinstance(batch, tuple):
        return type(batch)(cut(v) for v in batch) if type(batch) is tuple else type(batch)(*map(cut, batch))
    if isinstance(batch, list):
        return [cut(v) for v in batch]
    raise TypeError(f"cannot split a batch of type {type(batch).__name__}")


def split_batch(
    batch: Any,
    shape: BatchShape,
    cost: CostModel,
    budget: float,
    *,
    weight: Weight = None,
    trim: bool = True,
    fill: bool = False,
    at_least: int = 1,
) -> list[Piece]:
    """``(micro_batch, loss_weight, rows)`` for each micro-batch; the weights sum to 1.

    Args:
        weight: ``"samples"`` (each micro-batch's share of the rows, for a loss
            averaged over samples), ``"tokens"`` (its share of real tokens, for
            a loss averaged over tokens; of a pack, its labelled tokens), a
            function of a micro-batch that returns its share's numerator (for
            example its count of labelled tokens), or None: ``"tokens"`` for a
            pack, ``"samples"`` otherwise (see :meth:`BatchShape.weight`).
        trim: cut each micro-batch to its longest row when the batch is
            padded on the right.
        fill: cut greedily, the first micro-batch as large as ``budget`` allows
            (see :func:`plan_micro_batches`); the weights still add up to the whole batch's.
        at_least: cut into at least this many micro-batches where the rows allow.
    """
    groups = plan_micro_batches(shape, cost, budget, fill=fill, at_least=at_least)
    pieces = []
    for rows in groups:
        width = None
        if trim and shape.right_padded and shape.packed is None:
            width = min(shape.width, int(cost.padded_length(int(shape.lengths[rows].max()))))
        pieces.append((take_rows(batch, shape, rows, width), rows))
    shares = piece_shares(shape, weight, [piece for piece, _ in pieces], groups)
    return [(piece, share, rows) for (piece, rows), share in zip(pieces, shares, strict=True)]


def piece_shares(
    shape: BatchShape, weight: Weight, parts: Sequence[Any], groups: Sequence[np.ndarray]
) -> list[float]:
    """Each micro-batch's share of the batch's loss, by ``weight`` (see :func:`split_batch`); they sum to 1.

    ``"tokens"`` on a batch with none to count (a pack labelled nowhere) counts real tokens.

    Raises:
        ValueError: a weight function gave shares that do not add up to a positive count.
    """
    weight = shape.weight(weight)
    if callable(weight):
        shares = [float(weight(part)) for part in parts]
    elif weight == "tokens":
        shares = [shape.tokens(rows) for rows in groups]
        if not sum(shares) > 0:
            shares = [float(shape.lengths[rows].sum()) for rows in groups]
    else:  # "samples"
        shares = [float(len(rows)) for rows in groups]
    total = sum(shares)
    if not total > 0:
        raise ValueError(
            f"the weight function gave micro-batch shares {shares} that sum to {total}; it should "
            f"return a positive count (e.g. of samples or labelled tokens) for each micro-batch"
        )
    return [share / total for share in shares]
