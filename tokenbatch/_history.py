"""An epoch's plan as a pure function of its history: how it started, then each re-plan.

A :class:`~tokenbatch.TokenBudgetBatchSampler` keeps no plan of its own,
only how the epoch's plan came about; :meth:`Planner.plan` makes the plan
from that, the same on every rank and after a restart::

    History(max_tokens=B0, num_replicas=W0, replans=(Replan(s1, B1, W0), Replan(s2, B1, W2)))

    steps   0 ......... s1-1 | s1 ......... s2-1 | s2 ......... end
    plan    every sample     | what was left     | what was left
            under B0, W0     | after s1: B1, W0  | after s2: B1, W2

A re-plan keeps the first ``s`` steps (they have been trained) and plans
every sample after them again: under a new budget (an out-of-memory error in
halve mode), or for a new number of ranks (a resume on another number of
processes; the steps before keep their width, and step numbers go on). The
``k``-th re-plan draws its random choices from ``(seed, epoch, k)``.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from tokenbatch._pack import fit_count
from tokenbatch.cost import CostModel
from tokenbatch.plan import Plan, oversize_error, plan_batches

logger = logging.getLogger("tokenbatch.sampler")


@dataclass(frozen=True)
class Replan:
    """From step ``steps_done`` on, the samples left are planned under ``max_tokens`` for ``num_replicas``."""

    steps_done: int
    max_tokens: float
    num_replicas: int
    """The ranks the part is planned for."""


@dataclass(frozen=True)
class History:
    """How an epoch's plan came about: the budget and ranks it started with, then every re-plan in order."""

    max_tokens: float
    num_replicas: int | None = None
    """None: the sampler's number of ranks, read when the plan is made (a fresh epoch)."""
    replans: tuple[Replan, ...] = ()

    def then(self, replan: Replan) -> History:
        return History(self.max_tokens, self.num_replicas, (*self.replans, replan))

    def extends(self, earlier: History) -> bool:
        """This is ``earlier`` with more re-plans (no new epoch or resume in between)."""
        return (
            (self.max_tokens, self.num_replicas) == (earlier.max_tokens, earlier.num_replicas)
            and self.replans[: len(earlier.replans)] == earlier.replans
            and len(self.replans) > len(earlier.replans)
        )

    def on(self, world: int) -> History:
        """This history, planned from the start for ``world`` ranks where it does not say."""
        return self if self.num_replicas is not None else History(self.max_tokens, world, self.replans)

    def check_steps_done(self, steps_done: int, plan: Plan, name: str = "steps_done") -> None:
        """Refuse a count of steps trained beyond ``plan`` (this history's) or before its last re-plan."""
        last = self.replans[-1].steps_done if self.replans else 0
        if steps_done < last:
            raise ValueError(
                f"{name} should be at least {last}, the step the epoch was last re-planned at (the steps "
                f"before it have been trained), but got {name}={steps_done}"
            )
        if steps_done > plan.num_steps:
            raise ValueError(
                f"{name} should be at most the {plan.num_steps} steps of the epoch's plan, but got "
                f"{name}={steps_done}"
            )

    def budget_per_batch(self, plan: Plan) -> np.ndarray:
        """The budget each batch of ``plan`` (this history's) was planned under."""
        budgets = np.full(plan.num_batches, self.max_tokens)
        for replan in self.replans:
            budgets[plan.step_start(replan.steps_done) :] = replan.max_tokens
        return budgets

    def world(self, default: int) -> int:
        """The ranks the last part is planned for (``default``: the sampler's)."""
        if self.replans:
            return self.replans[-1].num_replicas
        return default if self.num_replicas is None else self.num_replicas


def per_sample_costs(cost: CostModel, keys: np.ndarray) -> np.ndarray:
    """``cost.sample_cost(keys)``, through a table of the lengths when that is cheaper."""
    longest = int(keys.max())
    if longest <= 4 * len(keys):  # one entry per length up to the longest: far fewer than samples
        table = cost.sample_cost(np.arange(longest + 1))
        per_sample: np.ndarray = table[keys]
        return per_sample
    return cost.sample_cost(keys)


@dataclass(frozen=True)
class Planner:
    """The sampler's planning inputs: sort keys and costs of every sample, and its settings."""

    keys: np.ndarray
    unit: np.ndarray
    shuffle: bool
    seed: int
    max_batch_size: int | None
    batch_size_multiple: int
    drop_last: bool
    oversize: str
    admitted: float | None = None
    """The budget ``oversize`` is judged against: under a lower one, a sample within it goes alone."""

    def plan(self, epoch: int, history: History, world: int, *, names: Sequence[str] | None = None) -> Plan:
        """The plan of ``epoch`` after ``history``, on ``world`` ranks where the history does not say.

        Args:
            names: what to call the start and each re-plan in an error (the
                fields of a loaded state), in order.

        Raises:
            ValueError: a re-plan starts beyond the steps planned before it, or
                a part cannot be planned (:class:`OversizeSampleError`, too few
                samples for the ranks); with ``names``, the message names the part.
        """
        plan: Plan | None = None
        start = Replan(0, history.max_tokens, world if history.num_replicas is None else history.num_replicas)
        for number, replan in enumerate([start, *history.replans]):
            name = names[number] if names is not None else f"re-plan {number}"
            if plan is None:
                rest = np.arange(len(self.keys))
            elif replan.steps_done > plan.num_steps:
                raise ValueError(
                    f"{name} should re-plan within the {plan.num_steps} steps planned before it, "
                    f"but got steps_done={replan.steps_done}"
                )
            else:
                rest = plan.remaining_after(replan.steps_done)
            try:
                part = self.part(rest, replan.max_tokens, replan.num_replicas, epoch, number)
            except ValueError as error:  # OversizeSampleError, or too few samples for the ranks
                if names is None:
                    raise
                raise type(error)(f"{name} cannot be planned: {error}") from error
            plan = part if plan is None else plan.first_steps(replan.steps_done).then(part)
        assert plan is not None  # the loop ran at least once
        return plan

    def part(self, indices: np.ndarray, max_tokens: float, world: int, epoch: int, replan: int) -> Plan:
        """The plan of the samples ``indices`` under ``max_tokens``: the ``replan``-th part of the epoch."""
        rng = np.random.default_rng([self.seed, epoch, replan]) if self.shuffle else None
        plan = plan_batches(
            indices,
            self.keys,
            self.unit,
            max_tokens,
            rng=rng,
            num_replicas=world,
            max_batch_size=self.max_batch_size,
            batch_size_multiple=self.batch_size_multiple,
            drop_last=self.drop_last,
            oversize=self.oversize,
            admitted=self.admitted,
        )
        if len(plan.skipped):
            logger.warning(
                "epoch %d: left out %d sample(s) that alone exceed max_tokens=%g (oversize='skip'), "
                "for example sample %d",
                epoch,
                len(plan.skipped),
                max_tokens,
                plan.skipped[0],
            )
        if len(plan.dropped):
            logger.warning(
                "epoch %d: dropped %d sample(s) so that %d ranks get the same number of batches "
                "(drop_last=True)",
                epoch,
                len(plan.dropped),
                world,
            )
        return plan


def check_oversize(keys: np.ndarray, unit: np.ndarray, max_tokens: float, oversize: str) -> None:
    """Raise (``oversize="error"``) or warn (``"alone"``) where a sample alone exceeds ``max_tokens``."""
    too_big = np.flatnonzero(unit > max_tokens)
    if len(too_big) and oversize == "error":
        raise oversize_error(too_big, keys, unit, max_tokens)
    if len(too_big) and oversize == "alone":
        logger.warning(
            "%d sample(s) alone exceed max_tokens=%g and get a batch of their own (oversize='alone'), "
            "for example sample %d",
            len(too_big),
            max_tokens,
            too_big[0],
        )


def check_rank(rank: int | None, world: int) -> None:
    """Refuse a rank the world does not have."""
    if rank is not None and rank >= world:
        raise ValueError(
            f"rank should be below num_replicas={world}, but got rank={rank}; ranks count from 0"
        )


def warn_if_one_length(lengths: np.ndarray, unit: np.ndarray, max_tokens: float, cap: int | None) -> None:
    """Token budgets need lengths that vary: warn when every sample has the same length."""
    if len(lengths) < 2 or np.any(lengths != lengths[0]):
        return
    fixed = max(1, fit_count(float(unit[0]), max_tokens, len(lengths) if cap is None else cap))
    warnings.warn(
        f"TokenBudgetBatchSampler: all {len(lengths)} samples have the same length ({int(lengths[0])}), "
        f"so max_tokens={max_tokens:g} is a fixed batch of {fixed} and a token budget gains nothing. "
        f"Were the lengths measured after padding to a fixed length? Pad each batch to its longest "
        f"sample instead (DataCollatorWithPadding; in transformers' run_classification.py or "
        f"run_glue.py, pass --pad_to_max_length False) and give the sampler the unpadded lengths",
        UserWarning,
        stacklevel=3,
    )
