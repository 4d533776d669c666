"""Measure an epoch's batching, and build the batchings people use today to compare with.

A batching is ``(order, offsets)``, the layout of :class:`tokenbatch.plan.Plan`:
batch ``b`` is ``order[offsets[b]:offsets[b + 1]]``. With ``W`` processes,
consecutive runs of ``W`` batches form one global step (rank ``r`` takes
batches ``r, r + W, ...``, as accelerate's ``BatchSamplerShard`` does).
Everything is vectorised numpy, and measured by the one
:func:`tokenbatch.plan.batch_stats` that ``sampler.stats()`` uses. Used by
``tokenbatch plan --compare`` and the benchmarks.
"""

from __future__ import annotations

import numpy as np

from tokenbatch.cost import CostModel
from tokenbatch.plan import Plan, PlanStats, batch_stats, fit_count

# What a user comparing batchings calls; the rest (used by the benchmarks) stays importable.
__all__ = ["fixed_batch_size", "length_grouped_batching", "measure", "random_fixed_batching"]

Batching = tuple[np.ndarray, np.ndarray]

#: The columns of a comparison row (benchmarks, ``tokenbatch plan``): their label -> the PlanStats field.
ROW = {
    "efficiency": "cost_efficiency",
    "token_efficiency": "padding_efficiency",
    "steps": "num_steps",
    "steps_over_lower_bound": "steps_over_lower_bound",
    "mean_budget_use": "mean_budget_use",
    "max_budget_use": "max_budget_use",
    "mean_batch_size": "mean_batch_size",
    "step_balance": "step_balance",
}


def from_batches(batches: list[list[int]]) -> Batching:
    """``(order, offsets)`` from a list of batches of indices.

    Example:
        >>> order, offsets = from_batches([[2, 0], [1]])
        >>> order.tolist(), offsets.tolist()
        ([2, 0, 1], [0, 2, 3])
    """
    sizes = np.array([len(b) for b in batches], dtype=np.int64)
    order = np.fromiter((i for b in batches for i in b), dtype=np.int64, count=int(sizes.sum()))
    return order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)


def fixed_offsets(num_samples: int, batch_size: int) -> np.ndarray:
    """Offsets of consecutive batches of ``batch_size`` (the last one may be shorter)."""
    return np.append(np.arange(0, num_samples, batch_size), num_samples).astype(np.int64)


def batch_costs(batching: Batching, lengths: np.ndarray, cost: CostModel) -> np.ndarray:
    """The cost of every batch: its size times the cost of its longest sample."""
    return Plan(*batching, num_replicas=1).batch_costs(lengths, cost)


def fixed_batch_size(lengths: np.ndarray, cost: CostModel, budget: float) -> int:
    """The fixed batch size with the budget's worst-case memory: largest b with cost(b, max L) <= budget.

    Example:
        >>> fixed_batch_size(np.array([5, 87, 20]), CostModel(), 16384)
        188
    """
    unit = float(cost.sample_cost(int(lengths.max())))
    # Bounded by what a numpy index holds, so a huge budget still cuts batches (one of everything).
    size = fit_count(unit, budget, int(np.iinfo(np.int64).max))
    if size == 0:
        raise ValueError(
            f"the longest sample (length {int(lengths.max())}) costs {unit:g} alone, more than "
            f"max_tokens={budget:g}; raise max_tokens to at least {unit:g}"
        )
    return size


def random_fixed_batching(num_samples: int, batch_size: int, rng: np.random.Generator) -> Batching:
    """Random batches of ``batch_size`` (``DataLoader(shuffle=True)``), the last one shorter."""
    return rng.permutation(num_samples), fixed_offsets(num_samples, batch_size)


def length_grouped_batching(
    lengths: np.ndarray, batch_size: int, generator: object | None = None
) -> Batching:
    """transformers' ``LengthGroupedSampler`` order cut into batches of ``batch_size``.

    Pass the same ``torch.Generator`` for consecutive epochs, as Trainer does.
    """
    from transformers.trainer_pt_utils import LengthGroupedSampler

    sampler = LengthGroupedSampler(batch_size, lengths=lengths.tolist(), generator=generator)
    return np.fromiter(iter(sampler), np.int64, len(lengths)), fixed_offsets(len(lengths), batch_size)


def repetition(first: Batching, second: Batching, num_samples: int) -> float:
    """Mean share of a sample's batch-mates in ``first`` that are its batch-mates again in ``second``.

    For a sample in batch ``k`` of ``first`` (``n_k`` samples) and batch ``l``
    of ``second``, with ``c_kl`` samples in both, the share is
    ``(c_kl - 1) / (n_k - 1)``; averaged over samples that had a batch-mate.
    Samples missing from either batching (skipped, dropped) are left out.

    Example:
        >>> a = (np.arange(4), np.array([0, 2, 4]))
        >>> repetition(a, a, 4)
        1.0
        >>> repetition(a, (np.array([0, 2, 1, 3]), np.array([0, 2, 4])), 4)
        0.0
    """
    batch_a = _batch_of(first, num_samples)
    batch_b = _batch_of(second, num_samples)
    present = (batch_a >= 0) & (batch_b >= 0)
    a, b = batch_a[present], batch_b[present]
    size_a = np.bincount(a)[a]
    pair = a * (int(b.max()) + 1) + b
    _, inverse, counts = np.unique(pair, return_inverse=True, return_counts=True)
    both = counts[inverse.reshape(-1)]
    has_mates = size_a > 1
    if not has_mates.any():
        return 0.0
    return float(np.mean((both[has_mates] - 1) / (size_a[has_mates] - 1)))


def _batch_of(batching: Batching, num_samples: int) -> np.ndarray:
    """Batch number of every sample (-1 where it is in no batch)."""
    order, offsets = batching
    result = np.full(num_samples, -1, dtype=np.int64)
    result[order] = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    return result


def measure(
    batching: Batching, lengths: np.ndarray, cost: CostModel, budget: float, num_replicas: int = 1
) -> PlanStats:
    """Padding, step count and budget use of one epoch's batching on ``num_replicas`` ranks.

    A batch count that is not a multiple of ``num_replicas`` counts its last,
    partial step as a full one (accelerate's ``even_batches`` would fill it
    with repeated samples).
    """
    return batch_stats(Plan(*batching, num_replicas=num_replicas), lengths, cost, budget)


def as_row(stats: PlanStats) -> dict[str, float]:
    """``stats`` under the column labels of the comparison tables and their JSON.

    Example:
        >>> row = as_row(measure((np.arange(3), np.array([0, 2, 3])), np.array([3, 4, 8]), CostModel(), 8.0))
        >>> row["steps"], row["token_efficiency"]
        (2, 0.9375)
    """
    return {label: getattr(stats, field) for label, field in ROW.items()}
