"""What a plan looks like: padding, budget use, batch sizes and balance between ranks.

One function, :func:`batch_stats`, measures any batching laid out as a
:class:`tokenbatch.plan.Plan`; ``sampler.stats()``, ``tokenbatch plan`` and
the comparisons of :mod:`tokenbatch.compare` (random fixed batches,
``LengthGroupedSampler``) all read it, so their numbers mean the same.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tokenbatch.cost import CostModel
from tokenbatch.plan import Plan


@dataclass(frozen=True)
class PlanStats:
    """What an epoch's plan looks like; ``print(sampler.stats())`` to see it."""

    num_samples: int
    num_batches: int
    num_steps: int
    """Global steps: ``num_batches / num_replicas``, a partial last step counted as a whole one."""
    padding_efficiency: float
    """Real tokens / padded tokens over all batches (padded as the cost model pads)."""
    cost_efficiency: float
    """Sum of each sample's cost alone / sum of batch costs (1.0 = no padding cost)."""
    mean_budget_use: float
    """Mean batch cost / budget."""
    max_budget_use: float
    """Costliest batch / budget (above 1 only for a batch of one: ``oversize="alone"``, a lowered budget)."""
    mean_batch_size: float
    max_batch_size: int
    num_skipped: int
    num_dropped: int
    steps_over_lower_bound: float = 0.0
    """Steps / :func:`lower_bound_steps`: 1.0 would be no padding and every batch full."""
    step_balance: float = 0.0
    """Sum of batch costs / (ranks * sum over steps of the costliest batch): 1.0 = no rank waits."""


def lower_bound_steps(
    lengths: np.ndarray,
    cost: CostModel,
    budget: float,
    num_replicas: int = 1,
    *,
    unit: np.ndarray | None = None,
) -> float:
    """Steps if nothing were padded and every batch filled the budget: sum cost(1, L_i) / budget / W.

    ``unit`` is ``cost.sample_cost(lengths)``, where the caller has it already.

    Example:
        >>> lower_bound_steps(np.array([10, 30]), CostModel(), 20.0)
        2.0
    """
    total = float((cost.sample_cost(lengths) if unit is None else unit).sum())
    return total / budget / num_replicas


def batch_stats(
    plan: Plan,
    lengths: np.ndarray,
    cost: CostModel,
    budget: float | np.ndarray,
    *,
    unit: np.ndarray | None = None,
) -> PlanStats:
    """Padding, budget use, batch sizes and step balance of ``plan``.

    Args:
        plan: the batches, ``plan.num_replicas`` to a global step.
        lengths: every sample's real length (the plan holds indices into it).
        cost: the cost model the budget is in.
        budget: the budget, or the one each batch was planned under (an epoch
            re-planned mid-way); the lower bound takes the largest.
        unit: ``cost.sample_cost(lengths)``, where the caller has it already.

    Example:
        >>> plan = Plan(np.array([0, 1, 2]), np.array([0, 2, 3]), num_replicas=1)
        >>> stats = batch_stats(plan, np.array([3, 4, 8]), CostModel(), 8.0)
        >>> stats.num_batches, stats.padding_efficiency, stats.mean_budget_use
        (2, 0.9375, 1.0)
    """
    unit = cost.sample_cost(lengths) if unit is None else unit
    sizes = plan.batch_sizes()
    world = plan.num_replicas
    skipped, dropped = len(plan.skipped), len(plan.dropped)
    if len(sizes) == 0:
        return PlanStats(len(lengths), 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0, skipped, dropped)
    longest = plan.batch_longest(lengths)
    costs = sizes * cost.sample_cost(longest)
    steps = -(-len(costs) // world)
    padded = np.zeros(steps * world)  # a partial last step, filled with batches that cost nothing
    padded[: len(costs)] = costs
    per_step = padded.reshape(steps, world)
    use = costs / budget
    bound = lower_bound_steps(lengths, cost, float(np.max(budget)), world, unit=unit)
    return PlanStats(
        num_samples=len(lengths),
        num_batches=len(sizes),
        num_steps=steps,
        padding_efficiency=float(lengths[plan.order].sum() / (sizes * cost.padded_length(longest)).sum()),
        cost_efficiency=float(unit[plan.order].sum() / costs.sum()),
        # One budget: divide the mean once (the benchmarks' figures were computed so).
        mean_budget_use=float(costs.mean() / budget if np.ndim(budget) == 0 else use.mean()),
        max_budget_use=float(use.max()),
        mean_batch_size=float(sizes.mean()),
        max_batch_size=int(sizes.max()),
        num_skipped=skipped,
        num_dropped=dropped,
        steps_over_lower_bound=steps / bound if bound > 0 else math.inf,  # 0: underflow at a huge budget
        step_balance=float(per_step.sum() / (world * per_step.max(axis=1).sum())),
    )
