"""The guard's side of growth: what it feeds :class:`~tokenbatch.oom._grow.BudgetSearch`, and when.

:class:`Growth` turns what the guard sees into the search's inputs, all of
them the same on every rank: a failed step's shared outcomes, what a trained
step showed to fit, from the sampler's global plan (the cheapest batch, or
micro-batch, that every rank ran), the step count, and, every ``check_every`` steps, the
smallest budget any rank's peak memory proposes (one all-reduce, only where
peaks can be read). It records a :class:`~tokenbatch.oom.GrowEvent` for each
try that trained, and logs it. Made with ``grow=None`` (``OOMFallback(grow=False)``)
it does nothing, so the guard calls it without asking.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from typing import Any, cast

from torch import nn

from tokenbatch import distributed
from tokenbatch.oom._events import OOMEvent
from tokenbatch.oom._grow import BudgetSearch, Grow, GrowEvent
from tokenbatch.oom._outcome import Outcome
from tokenbatch.oom._peak import PeakFit, cuda_reader
from tokenbatch.oom._split import BatchShape, plan_micro_batches
from tokenbatch.oom._strategies import Strategy
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

logger = logging.getLogger("tokenbatch.oom")


class Growth:
    """One guard's growth: the search, the peak fit, the growth events (all idle for ``grow=None``)."""

    def __init__(
        self,
        grow: Grow | None,
        *,
        sampler: TokenBudgetBatchSampler | TokenBudgetStream,
        model: nn.Module,
        strategy: Strategy,
    ) -> None:
        # Growth proves budgets on the global plan, which a stream has not: as_grow gives it none.
        assert grow is None or isinstance(sampler, TokenBudgetBatchSampler)
        self.sampler = cast(TokenBudgetBatchSampler, sampler)  # read only while growing
        self.strategy, self.mode = strategy, strategy.name
        near = not strategy.keeps_step
        self.search = None if grow is None else BudgetSearch(grow, ceiling=sampler.max_tokens, near=near)
        self.events: list[GrowEvent] = []
        self._read: Callable[[], float | None] | None = None
        self._capacity: float | None = None
        if grow is not None and grow.memory_fraction is not None:
            self._read, self._capacity = (grow.peak, grow.capacity) if grow.peak else cuda_reader(model)
            if self._read is not None and self._capacity is None:
                raise ValueError(
                    "Grow(peak=...) should come with capacity=... (the bytes memory_fraction is a "
                    "fraction of), but got capacity=None"
                )
        self._fit = PeakFit()
        self._trained = 0

    def step_cost(self, step: int, budget: float) -> float:
        """What step ``step`` showed to fit on every rank: the cheapest of its batches in the global plan.

        A batch's cost is its own, or, where split mode cut it to ``budget``, its costliest
        micro-batch (cut as the guard cuts it, from the plan's lengths: greedily while a try
        is in force, see :meth:`filling`). The cheapest over
        the ranks, as ranks may differ in memory: each of them ran at least that much.
        """
        plan, lengths, cost = self.sampler.plan, self.sampler.lengths, self.sampler.cost
        split = self.strategy.split_budget(budget, self.sampler.max_tokens) is not None
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
        return self.search is not None and self.search.trying is not None and self.strategy.keeps_step

    def failed(self, event: OOMEvent, outcomes: Sequence[Outcome]) -> OOMEvent:
        """The event of an OOM, with the budget put back (and ``growth`` set) where a try failed."""
        if self.search is None:
            return event
        if self._read is not None:
            self._read()  # the failed attempt's peak is no trained step's: reset it
        failed_cost = max(o.cost for o in outcomes if o.status == "oom")
        tried = self.search.trying is not None
        new = self.search.failed_try(
            budget=event.old_max_tokens, failed_cost=failed_cost, halved=event.new_max_tokens
        )
        return event.replace(new_max_tokens=new, growth=tried)

    def trained(self, *, step: int, budget: float, batch: Any) -> GrowEvent | None:
        """Step ``step`` trained under ``budget``: the growth event if it proved a try, else None."""
        if self.search is None:
            return None
        self._trained += 1
        if self._read is not None:
            # The peak since the last reading: the previous optimizer step and this forward and
            # backward, paired with this rank's batch cost where the batch ran whole.
            peak = self._read()
            local = self.strategy.read(batch).cost(self.sampler.cost) if peak is not None else 0.0
            if peak is not None and (local <= budget or not self.strategy.keeps_step):
                self._fit.add(local, peak)
        reason = self.search.reason
        old = self.search.trained(budget=budget, step_cost=self.step_cost(step, budget))
        if old is None:
            return None
        event = GrowEvent(self.sampler.epoch, step, self.mode, old, budget, reason)
        self.events.append(event)
        if distributed.rank() == 0:
            logger.info("%s", event)
        return event

    def try_larger(self, budget: float, steps_done: int, put: Callable[..., None]) -> bool:
        """At a step boundary, ``put`` a larger budget in force where the search proposes one.

        Returns True where halve mode re-planned (the DataLoader must start afresh).
        """
        target = self._next_budget(budget)
        if target is None or self.search is None:
            return False
        halve = not self.strategy.keeps_step
        # Halve mode re-plans after a step that trained: only a re-plan-aware pass (iterate, the
        # Trainer) starts the DataLoader afresh, and an epoch's last step leaves nothing to re-plan.
        if halve and (not self.sampler.position.managed or steps_done >= self.sampler.plan.num_steps):
            self.search.cancel()
            return False
        try:
            put(target, steps_done=steps_done)
        except ValueError:  # too few samples left for every rank under the larger budget: stay
            self.search.cancel()
            return False
        if distributed.rank() == 0:
            logger.debug("trying max_tokens=%g (from %g)", target, budget)
        return halve

    def _next_budget(self, budget: float) -> float | None:
        """The larger budget to try now, or None; the same on every rank."""
        if self.search is None:
            return None
        target, reason = self.search.next_try(budget), "bracket"
        if target is None and self._read is not None and self._trained % self.search.grow.check_every == 0:
            target, reason = self._proposal(budget), "memory"
        if target is not None:
            self.search.start(target, before=budget, reason=reason)
        return target

    def _proposal(self, budget: float) -> float | None:
        assert self.search is not None and self._capacity is not None
        fraction = self.search.grow.memory_fraction
        assert fraction is not None
        mine = self._fit.budget_for(fraction * self._capacity)
        # Every rank calls this at the same trained-step count: the smallest proposal is everyone's.
        local = math.inf if mine is None else mine
        agreed = -distributed.all_reduce_max([-local], device=distributed.collective_device())[0]
        return None if not math.isfinite(agreed) else self.search.memory_try(agreed, budget)

    def memory_changed(self) -> None:
        if self.search is not None:
            self.search.memory_changed()

    def state(self) -> dict[str, Any] | None:
        if self.search is None:
            return None
        return {"search": self.search.state(), "events": [e.as_dict() for e in self.events]}

    def load(self, state: Any) -> None:
        """Resume the bracket and growth events from :meth:`state` (None: nothing), checked first."""
        if state is None or self.search is None:
            return
        if not isinstance(state, dict) or set(state) != {"search", "events"}:
            raise ValueError(f"state['growth'] should hold 'search' and 'events', but got {state!r:.200}")
        saved = state["events"]
        if not isinstance(saved, list | tuple):
            raise TypeError(f"state['growth']['events'] should be a list, but got {saved!r:.100}")
        events = [GrowEvent.from_dict(e, name=f"state['growth']['events'][{i}]") for i, e in enumerate(saved)]
        self.search.load(state["search"], name="state['growth']['search']")
        self.events = events
