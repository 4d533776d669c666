"""Climbing back after an out-of-memory error: the bracket of budgets, and when to try a larger one.

Halving is safe but lands anywhere between half of what fits and all of it.
:class:`BudgetSearch` keeps the bracket the run has learnt, in cost units:
the costliest step that trained (``proven``) and the cheapest batch that ran
out of memory (``failed``), and at a step boundary proposes the midpoint::

    cost   proven ........ try = (proven + failed) / 2 ........ failed
           trained          the next budget tried               ran out of memory

A try that trains a step costing at least ``1 - tolerance`` of it (split
mode: more than the budget before it) is a success (:class:`GrowEvent`);
a try that runs out of memory moves ``failed`` down and puts the budget
back where it was (the step is recovered like any other OOM). Any later OOM
goes back to ``proven`` rather than below it, unless the batch that failed cost
no more than ``proven`` (memory ranks batches otherwise than the cost model):
then ``proven`` is forgotten and the budget halves from the failed cost. It stops once
``failed - proven <= tolerance * failed`` or after ``max_failures`` failed
tries, and never tries at or above a cost that failed, unless told that
memory changed (:meth:`BudgetSearch.memory_changed`): then the bracket's top
is the ceiling again and the search climbs as after a first OOM there.

:class:`Growth` is the guard's side: it feeds the search only what every
rank knows alike (the shared outcomes, step counts, the sampler's global
plan), so every rank takes the same decision at the same step without a
collective. On CUDA it also pairs each trained step's peak memory with the
cost this rank ran, fits a line through the pairs (bytes per cost unit) and,
every ``check_every`` steps, proposes the cost that reaches
``memory_fraction`` of the device, agreed by the ranks (the smallest); where
there is nothing to read (CPU) no proposal is made.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.oom._errors import OOMEvent
from tokenbatch.oom._split import BatchShape, plan_micro_batches
from tokenbatch.oom._step import Outcome
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.oom")


@dataclass(frozen=True, kw_only=True)
class Grow:
    """How :class:`~tokenbatch.OOMFallback` climbs back towards the largest budget that fits.

    Args:
        tolerance: stop trying once the bracket is this narrow, relative to
            the smallest cost that failed (0.05: within 5%).
        max_failures: failed tries (out-of-memory errors of a try) allowed in
            the run; each costs one dropped (halve) or re-run (split) step.
        patience: steps that must train under a budget before a larger one is tried.
        memory_fraction: with step peaks to read (CUDA), propose a budget at
            this fraction of the device's memory before any OOM; None: never.
        check_every: steps between two proposals from peak memory (one small all-reduce each).
        peak: where a step's peak memory comes from: a function returning the
            bytes since its last call, or None (default: CUDA's
            ``max_memory_allocated`` on a CUDA model, nothing on CPU).
        capacity: the bytes ``memory_fraction`` is a fraction of (default: the CUDA device's total).

    Example:
        >>> import torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> from tokenbatch.oom import Grow
        >>> sampler = TokenBudgetBatchSampler([4, 5, 6] * 4, max_tokens=16)
        >>> fallback = OOMFallback(sampler, torch.nn.Linear(4, 1), mode="halve", grow=Grow(tolerance=0.1))
        >>> fallback.grow.tolerance
        0.1
    """

    tolerance: float = 0.05
    max_failures: int = 3
    patience: int = 1
    memory_fraction: float | None = 0.9
    check_every: int = 20
    peak: Callable[[], float | None] | None = None
    capacity: float | None = None

    def __post_init__(self) -> None:
        tolerance = _checks.positive_number("tolerance", self.tolerance)
        if tolerance >= 1:
            raise ValueError(
                f"tolerance should be below 1 (a fraction), but got tolerance={self.tolerance!r}"
            )
        fraction = self.memory_fraction
        if fraction is not None and not 0 < _checks.positive_number("memory_fraction", fraction) < 1:
            raise ValueError(
                f"memory_fraction should be in (0, 1) or None, but got memory_fraction={fraction!r}"
            )
        if self.peak is not None and not callable(self.peak):
            raise TypeError(f"peak should be a function returning bytes or None, but got peak={self.peak!r}")
        _checks.non_negative_int("max_failures", self.max_failures)
        _checks.non_negative_int("patience", self.patience)
        _checks.positive_int("check_every", self.check_every)
        if self.capacity is not None:
            _checks.positive_number("capacity", self.capacity)


def as_grow(grow: bool | Grow) -> Grow | None:
    """The growth settings for ``grow=`` (True, False or a :class:`Grow`): None for no growth."""
    if not isinstance(grow, Grow | bool):
        raise TypeError(
            f"grow should be True, False or a tokenbatch.oom.Grow, but got grow={grow!r}; "
            f"pass grow=False to shrink only"
        )
    if isinstance(grow, Grow):
        return grow
    return Grow() if grow else None


@dataclass(frozen=True)
class GrowEvent:
    """One successful growth: a larger budget trained a step that the budget before could not hold."""

    epoch: int
    step: int
    """The step of the epoch that trained under the new budget, costing more than the old one."""
    mode: str
    old_max_tokens: float
    new_max_tokens: float
    reason: str = "bracket"
    """``"bracket"`` (midpoint after an OOM) or ``"memory"`` (proposed from measured peaks)."""

    def __str__(self) -> str:
        return (
            f"grew max_tokens {_checks.budget(self.old_max_tokens)} -> {_checks.budget(self.new_max_tokens)} "
            f"at epoch {self.epoch}, "
            f"step {self.step} ({self.reason}; {self.mode} mode)"
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, name: str = "event") -> GrowEvent:
        """The event :meth:`as_dict` gave, every field checked."""
        keys = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(keys):
            raise ValueError(
                f"{name} should be a GrowEvent.as_dict(), with keys {keys}, but got {data!r:.200}"
            )
        count, number = _checks.non_negative_int, _checks.positive_number
        return cls(
            epoch=count(f"{name}['epoch']", data["epoch"]),
            step=count(f"{name}['step']", data["step"]),
            mode=_checks.one_of(f"{name}['mode']", data["mode"], ("split", "halve")),
            old_max_tokens=number(f"{name}['old_max_tokens']", data["old_max_tokens"]),
            new_max_tokens=number(f"{name}['new_max_tokens']", data["new_max_tokens"]),
            reason=_checks.one_of(f"{name}['reason']", data["reason"], ("bracket", "memory")),
        )


@dataclass
class BudgetSearch:
    """The bracket of costs and the pending try; decides when and where to try a larger budget.

    Example:
        >>> search = BudgetSearch(Grow(), ceiling=1000.0)
        >>> search.failed_try(budget=1000.0, failed_cost=990.0, halved=495.0)  # nothing known: halve
        495.0
        >>> search.trained(budget=495.0, step_cost=480.0)  # no try in force: None
        >>> search.next_try(budget=495.0)  # (480 + 990) / 2
        735.0
        >>> search.start(735.0, before=495.0, reason="bracket")
        >>> search.failed_try(budget=735.0, failed_cost=700.0, halved=350.0)  # back to what trained
        495.0
        >>> search.proven, search.failed, search.failures
        (480.0, 700.0, 1)
    """

    grow: Grow
    ceiling: float
    proven: float | None = None
    """The cost of the costliest step that trained (since the last OOM at or below it)."""
    failed: float | None = None
    """The bracket's top: the cost of the cheapest batch that ran out of memory, or the ceiling
    after :meth:`memory_changed` (nothing failed since); None before any OOM (no bracket)."""
    failures: int = 0
    """Tries that ran out of memory."""
    trying: float | None = None
    """The budget of the try in force, not yet shown to fit."""
    before: float | None = None
    """The budget to go back to if the try fails."""
    reason: str = "bracket"
    near: bool = True
    """A try is shown by a step costing ``1 - tolerance`` of it (halve mode: a re-plan puts its
    costliest step first); False: by one costing more than the budget before (split mode: while
    a try is in force its first micro-batch fills it as far as the rows allow, which may fall
    short of ``1 - tolerance`` of it)."""
    calm: int = 0
    """Steps trained since the budget last changed."""

    def failed_try(self, *, budget: float, failed_cost: float, halved: float) -> float:
        """An OOM at ``budget`` on a batch of ``failed_cost``: the new budget.

        ``halved`` is the guard's usual rule (``factor * min(budget, failed_cost)``),
        taken when nothing better is known: a failed try goes back to the budget
        before it, any other OOM to the costliest step that trained, where those
        are below the failed cost; never below ``halved``.
        """
        self.failed = failed_cost if self.failed is None else min(self.failed, failed_cost)
        back, self.trying, self.before, self.calm = self.before, None, None, 0
        if self.proven is not None and self.proven >= failed_cost:
            self.proven = None  # what trained before fails now: memory is tighter than it was
        if back is not None:
            self.failures += 1
        # A budget that trained, or the costliest step that did (a try's cheaper steps count too),
        # below the budget that failed: at that budget the same step would fail again, for ever.
        known = [b for b in (back, self.proven) if b is not None and b < min(failed_cost, budget)]
        return max([*known, halved])

    def trained(self, *, budget: float, step_cost: float) -> float | None:
        """A step of ``step_cost`` trained under ``budget``: the old budget if it proved a try, else None."""
        self.calm += 1
        cost = min(step_cost, budget)  # split mode: the micro-batches fitted the budget
        self.proven = cost if self.proven is None else max(self.proven, cost)
        if self.trying is None or self.before is None:
            return None
        needed = (1 - self.grow.tolerance) * self.trying if self.near else self.before
        if step_cost < needed or step_cost <= self.before:
            return None  # not yet shown: this step would have fitted before (or is far below the try)
        old, self.trying, self.before = self.before, None, None
        return old

    def next_try(self, budget: float) -> float | None:
        """The budget to try now (the bracket's midpoint), or None to stay."""
        if self.trying is not None or self.failed is None or self.proven is None:
            return None
        if self.failures >= self.grow.max_failures or self.calm < self.grow.patience:
            return None
        high = min(self.failed, self.ceiling)
        if high - self.proven <= self.grow.tolerance * high:
            return None
        target = (self.proven + high) / 2
        return target if target > budget else None

    def memory_try(self, proposal: float, budget: float) -> float | None:
        """Where a budget proposed from measured peaks leads: a budget to try, or None."""
        if self.trying is not None or self.calm < self.grow.patience:
            return None
        target = min(proposal, self.ceiling)
        if self.failed is not None and target >= self.failed:
            return None  # never at or above a cost that failed: the bracket's midpoint does that
        return target if target > budget * (1 + self.grow.tolerance) else None

    def start(self, budget: float, *, before: float, reason: str) -> None:
        """A try of ``budget`` is in force; ``before`` was the budget that trained."""
        self.trying, self.before, self.reason, self.calm = budget, before, reason, 0

    def cancel(self) -> None:
        """The try could not be put in force (no step left to re-plan, too few samples): stay."""
        self.trying = self.before = None

    def memory_changed(self) -> None:
        """Memory was freed (or the model changed): forget the failures and search up to the ceiling again.

        The bracket's top becomes the ceiling, as if the first OOM had been there,
        so the next try is the midpoint between what trained and the ceiling.
        (Forgetting ``failed`` alone would leave no bracket, and no try without one.)
        """
        self.failed, self.failures = self.ceiling, 0

    def state(self) -> dict[str, Any]:
        return {
            "ceiling": self.ceiling,
            "proven": self.proven,
            "failed": self.failed,
            "failures": self.failures,
            "trying": self.trying,
            "before": self.before,
            "reason": self.reason,
        }

    def read(self, state: Any, name: str = "state['growth']") -> Callable[[], None]:
        """Check the bracket of :meth:`state`; returns what puts it in force (nothing changes before)."""
        keys = set(self.state())
        if not isinstance(state, dict) or set(state) != keys:
            raise ValueError(f"{name} should hold the keys {sorted(keys)}, but got {state!r:.200}")

        def budget(key: str) -> float | None:
            value = state[key]
            return None if value is None else _checks.positive_number(f"{name}[{key!r}]", value)

        ceiling = _checks.positive_number(f"{name}['ceiling']", state["ceiling"])
        proven, failed, trying, before = (budget(k) for k in ("proven", "failed", "trying", "before"))
        failures = _checks.non_negative_int(f"{name}['failures']", state["failures"])
        reason = _checks.one_of(f"{name}['reason']", state["reason"], ("bracket", "memory"))
        if (trying is None) != (before is None):
            raise ValueError(
                f"{name}['trying'] and {name}['before'] should both be numbers or both None, "
                f"but got {state!r:.200}"
            )

        def apply() -> None:
            self.ceiling, self.proven, self.failed, self.failures = ceiling, proven, failed, failures
            self.trying, self.before, self.reason, self.calm = trying, before, reason, 0

        return apply


# -- the guard's side: what it feeds the search, and when ----------------------------------

# Costs must spread this much before a line through them says anything about larger ones.
_MIN_SPREAD = 1.2
_MIN_POINTS = 4
_KEEP = 64  # the latest pairs: an old one may predate a change (a new optimizer state)


def peak_budget(costs: Sequence[float], peaks: Sequence[float], target_bytes: float) -> float | None:
    """The cost whose peak a line through ``(cost, peak bytes)`` pairs puts at ``target_bytes``, or None.

    None while the pairs cannot tell (too few, too alike) or the line does not rise.

    Example (forward + backward peaks of a 2-layer BERT, hidden size 64, measured on CPU
    with the torch profiler, as ``tokenbatch.probe`` does: padded tokens, bytes):
        >>> costs = [256, 512, 512, 1024, 1024, 2048, 2048]
        >>> peaks = [4384780, 6887692, 7674124, 11893516, 13487724, 21933804, 25145068]
        >>> round(peak_budget(costs, peaks, 100e6))  # the padded tokens a 100 MB peak allows
        9238
    """
    if len(costs) < _MIN_POINTS or max(costs) < _MIN_SPREAD * min(costs):
        return None
    slope, constant = np.polyfit(np.asarray(costs, float), np.asarray(peaks, float), 1)
    if slope <= 0:
        return None
    budget = (target_bytes - float(constant)) / float(slope)
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


class Growth:
    """One guard's growth on a sampler's plan: the search, the step peaks, the growth events.

    ``keeps_step``: split mode (a try is proven by a micro-batch larger than
    the budget before it); False: halve mode (a re-plan puts the try's
    costliest step first). ``read(batch)`` gives a batch's rows and lengths.
    """

    def __init__(
        self,
        grow: Grow,
        *,
        sampler: TokenBudgetBatchSampler,
        model: nn.Module,
        mode: str,
        keeps_step: bool,
        read: Callable[[Any], BatchShape],
    ) -> None:
        self.sampler, self.mode, self.keeps_step, self.read = sampler, mode, keeps_step, read
        self.search = BudgetSearch(grow, ceiling=sampler.max_tokens, near=not keeps_step)
        self.events: list[GrowEvent] = []
        self._peak: Callable[[], float | None] | None = None
        self._capacity: float | None = None
        if grow.memory_fraction is not None:
            self._peak, self._capacity = (grow.peak, grow.capacity) if grow.peak else cuda_reader(model)
            if self._peak is not None and self._capacity is None:
                raise ValueError(
                    "Grow(peak=...) should come with capacity=... (the bytes memory_fraction is a "
                    "fraction of), but got capacity=None"
                )
        self._costs: list[float] = []
        self._peaks: list[float] = []
        self._trained = 0

    def step_cost(self, step: int, budget: float) -> float:
        """What step ``step`` showed to fit on every rank: the cheapest of its batches in the global plan.

        A batch's cost is its own (as the cost model costs it: a pack as a pack), or, where
        split mode cut it to ``budget``, its costliest micro-batch (cut as the guard cuts it,
        from the plan's lengths: greedily while a try is in force, see :meth:`filling`). The cheapest over
        the ranks, as ranks may differ in memory: each of them ran at least that much.
        """
        plan, lengths, cost = self.sampler.plan, self.sampler.lengths, self.sampler.cost
        split = self.keeps_step and budget < self.sampler.max_tokens
        fill = self.filling()
        shown = []
        for index in range(plan.step_start(step), plan.step_start(step + 1)):
            rows = lengths[plan.batch(index)]
            shape = BatchShape(len(rows), int(rows.max()), rows, right_padded=True)
            pieces = (
                plan_micro_batches(shape, cost, budget, fill=fill)
                if split and shape.cost(cost) > budget
                else [None]
            )
            shown.append(max(shape.cost(cost, piece) for piece in pieces))
        return min(shown)

    def filling(self) -> bool:
        """Split mode, while a try is in force: cut micro-batches greedily, the first one filling the try.

        Cut evenly, a batch splits into pieces no larger under the tried budget than under
        the one before, so no step would prove the try. The search's state is the same on
        every rank, and so is this cut (what :meth:`step_cost` reads from the plan).
        """
        return self.search.trying is not None and self.keeps_step

    def failed(self, event: OOMEvent, outcomes: Sequence[Outcome]) -> OOMEvent:
        """The event of an OOM, with the budget put back (and ``growth`` set) where a try failed."""
        if self._peak is not None:
            self._peak()  # the failed attempt's peak is no trained step's: reset it
        failed_cost = max(o.cost for o in outcomes if o.status == "oom")
        tried = self.search.trying is not None
        new = self.search.failed_try(
            budget=event.old_max_tokens, failed_cost=failed_cost, halved=event.new_max_tokens
        )
        return event.replace(new_max_tokens=new, growth=tried)

    def trained(self, *, step: int, budget: float, batch: Any) -> GrowEvent | None:
        """Step ``step`` trained under ``budget``: the growth event if it proved a try, else None."""
        self._trained += 1
        if self._peak is not None:
            # The peak since the last reading: the previous optimizer step and this forward and
            # backward, paired with this rank's batch cost where the batch ran whole.
            peak = self._peak()
            local = self.read(batch).cost(self.sampler.cost) if peak is not None else 0.0
            usable = peak is not None and peak > 0 and local > 0 and math.isfinite(peak)
            if usable and (local <= budget or not self.keeps_step):
                self._costs.append(float(local))
                self._peaks.append(float(peak))  # type: ignore[arg-type]
                del self._costs[:-_KEEP], self._peaks[:-_KEEP]
        if step >= self.sampler.plan.num_steps:
            return None  # a batch the plan does not know (a loop of its own): it proves nothing
        reason = self.search.reason
        old = self.search.trained(budget=budget, step_cost=self.step_cost(step, budget))
        if old is None:
            return None
        event = GrowEvent(self.sampler.epoch, step, self.mode, old, budget, reason)
        self.events.append(event)
        if distributed.rank() == 0:
            logger.info("%s", event)
        return event

    def try_larger(
        self, budget: float, steps_done: int, put: Callable[..., None], *, can_replan: bool
    ) -> bool:
        """At a step boundary, ``put`` a larger budget in force where the search proposes one.

        ``can_replan``: halve mode has a pass that restarts after a re-plan
        (``iterate``, the Trainer's). Returns True where halve mode re-planned.
        """
        target = self._next_budget(budget)
        if target is None:
            return False
        halve = not self.keeps_step
        # Halve mode re-plans after a step that trained, and an epoch's last step leaves nothing to re-plan.
        if halve and (not can_replan or steps_done >= self.sampler.plan.num_steps):
            self.search.cancel()
            return False
        try:
            put(target, steps_done=steps_done)
        except ValueError:  # too few samples left for every rank under the larger budget: stay
            self.search.cancel()
            return False
        if distributed.rank() == 0:
            logger.debug("trying max_tokens=%s (from %s)", _checks.budget(target), _checks.budget(budget))
        return halve

    def _next_budget(self, budget: float) -> float | None:
        """The larger budget to try now, or None; the same on every rank."""
        target, reason = self.search.next_try(budget), "bracket"
        if target is None and self._peak is not None and self._trained % self.search.grow.check_every == 0:
            target, reason = self._proposal(budget), "memory"
        if target is not None:
            self.search.start(target, before=budget, reason=reason)
        return target

    def _proposal(self, budget: float) -> float | None:
        fraction = self.search.grow.memory_fraction
        assert fraction is not None and self._capacity is not None
        mine = peak_budget(self._costs, self._peaks, fraction * self._capacity)
        # Every rank calls this at the same trained-step count: the smallest proposal is everyone's.
        local = math.inf if mine is None else mine
        agreed = -distributed.all_reduce_max([-local], device=distributed.collective_device())[0]
        return None if not math.isfinite(agreed) else self.search.memory_try(agreed, budget)

    def memory_changed(self) -> None:
        self.search.memory_changed()

    def state(self) -> dict[str, Any]:
        return {"search": self.search.state(), "events": [e.as_dict() for e in self.events]}

    def restore(self, state: Any) -> Callable[[], None]:
        """Check the bracket and growth events of :meth:`state` (None: none); returns what resumes them."""
        if state is None:
            return lambda: None
        if not isinstance(state, dict) or set(state) != {"search", "events"}:
            raise ValueError(f"state['growth'] should hold 'search' and 'events', but got {state!r:.200}")
        saved = state["events"]
        if not isinstance(saved, list | tuple):
            raise TypeError(f"state['growth']['events'] should be a list, but got {saved!r:.100}")
        events = [GrowEvent.from_dict(e, name=f"state['growth']['events'][{i}]") for i, e in enumerate(saved)]
        search = self.search.read(state["search"], name="state['growth']['search']")

        def apply() -> None:
            search()
            self.events = events

        return apply
