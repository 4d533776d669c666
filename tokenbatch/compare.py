"""Measure an epoch's batching, and build the batchings people use today to compare with.

A batching is ``(order, offsets)``, the layout of :class:`tokenbatch.plan.Plan`:
batch ``b`` is ``order[offsets[b]:offsets[b + 1]]``. With ``W`` processes,
consecutive runs of ``W`` batches form one global step (rank ``r`` takes
batches ``r, r + W, ...``, as accelerate's ``BatchSamplerShard`` does).
Everything is vectorised numpy. Used by ``tokenbatch plan --compare`` and
the benchmarks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from tokenbatch.cost import CostModel
from tokenbatch.plan import fit_count

Batching = tuple[np.ndarray, np.ndarray]


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
    order, offsets = batching
    longest = np.maximum.reduceat(lengths[order], offsets[:-1])
    result: np.ndarray = np.diff(offsets) * cost.sample_cost(longest)
    return result


def lower_bound_steps(lengths: np.ndarray, cost: CostModel, budget: float, num_replicas: int = 1) -> float:
    """Steps if nothing were padded and every batch filled the budget: sum cost(1, L_i) / budget / W.

    Example:
        >>> lower_bound_steps(np.array([10, 30]), CostModel(), 20.0)
        2.0
    """
    return float(cost.sample_cost(lengths).sum()) / budget / num_replicas


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


@dataclass(frozen=True)
class BatchingStats:
    """How well one epoch's batching uses the budget (see :func:`measure`)."""

    efficiency: float
    """Sum of each sample's cost alone / sum of batch costs (real / padded tokens for linear cost)."""
    token_efficiency: float
    """Real tokens / padded tokens, whatever the cost model."""
    steps: int
    steps_over_lower_bound: float
    mean_budget_use: float
    max_budget_use: float
    mean_batch_size: float
    step_balance: float
    """Sum of batch costs / (W * sum over steps of the costliest batch): 1.0 = no rank waits."""

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def measure(
    batching: Batching, lengths: np.ndarray, cost: CostModel, budget: float, num_replicas: int = 1
) -> BatchingStats:
    """Padding, step count and budget use of one epoch's batching on ``num_replicas`` ranks.

    A batch count that is not a multiple of ``num_replicas`` counts its last,
    partial step as a full one (accelerate's ``even_batches`` would fill it
    with repeated samples).
    """
    order, offsets = batching
    costs = batch_costs(batching, lengths, cost)
    sizes = np.diff(offsets)
    longest = np.maximum.reduceat(lengths[order], offsets[:-1])
    steps = math.ceil(len(costs) / num_replicas)
    padded = np.zeros(steps * num_replicas)
    padded[: len(costs)] = costs
    per_step = padded.reshape(steps, num_replicas)
    return BatchingStats(
        efficiency=float(cost.sample_cost(lengths[order]).sum() / costs.sum()),
        token_efficiency=float(lengths[order].sum() / (sizes * longest).sum()),
        steps=steps,
        steps_over_lower_bound=steps / lower_bound_steps(lengths, cost, budget, num_replicas),
        mean_budget_use=float(costs.mean() / budget),
        max_budget_use=float(costs.max() / budget),
        mean_batch_size=float(sizes.mean()),
        step_balance=float(per_step.sum() / (num_replicas * per_step.max(axis=1).sum())),
    )
