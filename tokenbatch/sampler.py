"""``TokenBudgetBatchSampler``: batches that fit a token budget, for a DataLoader."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from tokenbatch import _checks, _reader, _state, distributed
from tokenbatch._budget import BudgetSlot
from tokenbatch._history import (
    History,
    Planner,
    Replan,
    check_rank,
    per_sample_costs,
)
from tokenbatch._state import EpochPosition
from tokenbatch.cost import CostModel
from tokenbatch.plan import OVERSIZE_POLICIES, Plan
from tokenbatch.stats import PlanStats, batch_stats

logger = logging.getLogger(__name__)


class TokenBudgetBatchSampler(BudgetSlot, Sampler[list[int]]):
    """Batches of similar-length samples, each within a memory budget.

    A drop-in for ``DataLoader(dataset, batch_sampler=...)`` that replaces a
    fixed batch size with ``max_tokens``: a batch may hold any number of
    samples as long as ``cost(batch_size, longest_length) <= max_tokens``.
    Samples are grouped by length with random tie-breaks and boundaries, the
    order of batches is shuffled per (seed, epoch), and the costliest step
    comes first.

    On several processes it works two ways. By default (``rank=None``) it
    yields the *global* plan, every rank's batch for step 0, then step 1, ...,
    with a batch count that is a multiple of the world size: exactly what
    ``accelerator.prepare``'s ``BatchSamplerShard`` expects, which keeps
    batches ``rank, rank + W, ...`` on each rank. With an explicit ``rank``
    it yields only that rank's batches, for plain DDP loops; a DataLoader that
    reads the global plan itself on several processes is refused.

    Args:
        lengths: the padded length of every example, as the collator will pad
            it (list, numpy array or tensor of ints >= 1).
            A column of token lists (``ds["input_ids"]``) gives each row's len().
        max_tokens: the budget for one batch, in ``cost`` units (padded tokens
            with the default cost); ``"auto"``: none until :meth:`resolve` (by
            :func:`tokenbatch.auto_budget`), and nothing plans before it.
        cost: the memory estimate; ``CostModel()`` counts padded tokens.
        shuffle: randomise tie-breaks, batch boundaries and batch order.
        seed: the seed; every rank must use the same one.
        max_batch_size: an optional cap on samples per batch.
        batch_size_multiple: round batch sizes down to a multiple of this
            (for example 8 for tensor cores) where at least that many fit.
        drop_last: when the batch count is not a multiple of the world size,
            drop the cheapest batches instead of splitting the largest.
        oversize: a sample that alone exceeds the budget raises (``"error"``),
            is left out and counted (``"skip"``), or gets a batch of its own
            (``"alone"``). This is judged against ``max_tokens`` as given here:
            after the budget is lowered (:meth:`replan`, ``OOMFallback``), a
            sample that fitted it but not the new budget gets a batch of its
            own; only running out of memory alone shows that it does not fit.
        num_replicas: the world size; defaults to ``torch.distributed``'s, or
            ``$WORLD_SIZE``, read when the plan is made.
        rank: yield only this rank's batches (plain DDP); None yields the
            global plan (``accelerator.prepare``).

    Example:
        >>> sampler = TokenBudgetBatchSampler([5, 3, 8, 2, 7, 4], max_tokens=16, seed=1)
        >>> batches = list(sampler)
        >>> sorted(i for batch in batches for i in batch)
        [0, 1, 2, 3, 4, 5]
        >>> len(batches) == len(sampler)
        True
    """

    @property
    def batch_size(self) -> None:
        """None: there is no fixed batch size (it tells accelerate the batches are dynamic)."""
        # accelerate's prepare(split_batches=True) reads it only to split a fixed batch, and fails
        # on None with a TypeError that names neither: refuse there, saying what to do instead.
        _reader.refuse_split_batches(sys._getframe(1))
        return None

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray | Any,
        max_tokens: float | str,
        *,
        cost: CostModel | None = None,
        shuffle: bool = True,
        seed: int = 0,
        max_batch_size: int | None = None,
        batch_size_multiple: int = 1,
        drop_last: bool = False,
        oversize: str = "error",
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        self.lengths = _checks.lengths_array(lengths)
        self.cost = CostModel() if cost is None else cost
        if not isinstance(self.cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        self.shuffle = _checks.boolean("shuffle", shuffle)
        self.seed = _checks.non_negative_int("seed", seed)
        self.max_batch_size = (
            None if max_batch_size is None else _checks.positive_int("max_batch_size", max_batch_size)
        )
        self.batch_size_multiple = _checks.positive_int("batch_size_multiple", batch_size_multiple)
        self.drop_last = _checks.boolean("drop_last", drop_last)
        self.oversize = _checks.one_of("oversize", oversize, OVERSIZE_POLICIES)
        self._num_replicas = (
            None if num_replicas is None else _checks.positive_int("num_replicas", num_replicas)
        )
        self.rank = None if rank is None else _checks.non_negative_int("rank", rank)
        if self._num_replicas is not None:
            check_rank(self.rank, self._num_replicas)
        # Sort keys and per-sample costs are computed once for the dataset.
        self._keys = np.asarray(self.cost.padded_length(self.lengths), dtype=np.int64)
        self._unit = per_sample_costs(self.cost, self._keys)
        # Oversize is judged against the budget given here (or resolved, for "auto": _budget).
        self._init_budget(max_tokens)
        self._position = EpochPosition()
        self._warned_repeat = False
        # How this epoch's plan came about (_history): first budget and ranks (None: read when planned).
        self._epoch_world: int | None = None
        self._replans: tuple[Replan, ...] = ()
        self._cache: tuple[tuple[Any, ...], Plan] | None = None

    # -- what the plan is --------------------------------------------------------

    @property
    def num_replicas(self) -> int:
        """The world size the plan is made for."""
        return self._num_replicas if self._num_replicas is not None else distributed.world_size()

    @property
    def max_tokens(self) -> float:
        """The budget in force now (after any re-plan)."""
        self._need_budget()
        return self._max_tokens

    @property
    def epoch(self) -> int:
        return self._position.epoch

    @property
    def position(self) -> EpochPosition:
        """Where this epoch is: the one cursor, moved by the sampler; loops set ``position.trained``."""
        return self._position

    @property
    def start_step(self) -> int:
        """The step of this epoch the next iteration starts at: 0, or where a resume or re-plan left it."""
        return self._position.start

    @property
    def plan(self) -> Plan:
        """This epoch's global plan, with every re-plan so far applied."""
        key = (self.epoch, self.num_replicas, self._history)
        if self._cache is None or self._cache[0] != key:
            self._cache = (key, self._make_plan(self.epoch, self._history))
        return self._cache[1]

    @property
    def _history(self) -> History:
        self._need_budget()
        return History(self._epoch_max_tokens, self._epoch_world, self._replans)

    def _switch(
        self, epoch: int, max_tokens: float, history: History, step: int, plan: Plan | None = None
    ) -> None:
        """Go to ``epoch``'s plan after ``history`` (``plan``, where made already), from ``step`` on."""
        self._position.epoch, self._max_tokens = epoch, max_tokens
        self._epoch_max_tokens, self._epoch_world, self._replans = (
            history.max_tokens, history.num_replicas, history.replans,
        )  # fmt: skip
        if plan is not None:
            self._cache = ((epoch, self.num_replicas, history), plan)
        self._position.move_to(step)

    def steps_in_epoch(self, epoch: int, max_tokens: float | None = None) -> int:
        """Global steps of epoch ``epoch``'s plan under ``max_tokens`` (default: the budget in force).

        No re-plan is applied: plans are pure functions of (seed, epoch,
        budget), so the length of a run is known before it starts.
        """
        epoch = _checks.non_negative_int("epoch", epoch)
        budget = self.max_tokens if max_tokens is None else _checks.positive_number("max_tokens", max_tokens)
        return self._make_plan(epoch, History(budget)).num_steps

    def _make_plan(self, epoch: int, history: History, names: list[str] | None = None) -> Plan:
        world = self.num_replicas
        check_rank(self.rank, world)
        planner = Planner(
            self._keys, self._unit, self.shuffle, self.seed, self.max_batch_size,
            self.batch_size_multiple, self.drop_last, self.oversize, self._admitted,
        )  # fmt: skip
        return planner.plan(epoch, history, world, names=names)

    def stats(self) -> PlanStats:
        """Padding, budget use, batch sizes and step balance of this epoch's plan, as ``tokenbatch plan``."""
        budget = self._budget_per_batch() if self._replans else self._epoch_max_tokens
        return batch_stats(self.plan, self.lengths, self.cost, budget, unit=self._unit)

    def _budget_per_batch(self) -> np.ndarray:
        """The budget each batch of this epoch's plan was made under."""
        return self._history.budget_per_batch(self.plan)

    # -- iteration ---------------------------------------------------------------

    def __len__(self) -> int:
        plan, start = self.plan, self._position.start
        return plan.num_steps - start if self.rank is not None else plan.num_batches - plan.step_start(start)

    def __iter__(self) -> Iterator[list[int]]:
        # Not a generator: the look at who iterates (once per pass, _reader) must happen when the
        # DataLoader iterator is made, on every rank, also where only one rank will ask for batches.
        self._need_budget()
        caller = sys._getframe(1)
        reader = _reader.find(caller, self)  # first: it refuses accelerate's dispatching loader by name
        world = distributed.world_size()
        if self.rank is None and world > 1 and _reader.read_by_a_dataloader(caller):
            raise _reader.unsharded_error(world)
        if reader is not None:
            reader.refuse_second_skip(self.epoch, self._position.start)
        return self._pass(reader)

    def _pass(self, reader: _reader.Reader | None) -> Iterator[list[int]]:
        position = self._position
        repeat = reader is not None and position.full_pass == position.generation and position.start == 0
        if repeat and self.shuffle and not self._warned_repeat:  # unshuffled, every epoch has this plan
            self._warned_repeat = True
            _reader.warn_repeat(self.epoch)
        epoch, history = self.epoch, self._history
        stopped = yield from position.walk(self.plan, self.rank, reader)  # the plan as at the first batch
        if (
            stopped is not None
            and self.epoch == epoch
            and self._history.extends(history)
            and position.start >= stopped
        ):
            # Re-planned from the step this pass is at, or later: of what it handed out only that step
            # is re-planned, and its batch was dropped (a loop over a DataLoader without workers), so
            # it carries on with the new plan. A pass that read further ahead stops: a new one starts.
            yield from self._pass(reader)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a new plan); the current epoch again is a no-op.

        Call it before each epoch, as with ``DistributedSampler``. Setting the
        epoch the sampler is already in keeps a resumed position and any re-plan.
        On one process, accelerate's prepared DataLoader calls this itself with
        its own count of passes; when you resume into a later epoch without
        ``OOMFallback.iterate`` (which aligns the two), also call
        ``train_dataloader.set_epoch(epoch)`` on the prepared DataLoader.
        """
        epoch = _checks.non_negative_int("epoch", epoch)
        if epoch == self._position.epoch:
            return
        self._switch(epoch, self._max_tokens, History(self._max_tokens), 0)

    def replan(self, max_tokens: float, *, steps_done: int) -> None:
        """Change the budget and re-plan every sample after the first ``steps_done`` steps.

        The first ``steps_done`` global steps stay as they were (trained);
        everything after them, fetched or not, is planned again under the new
        budget. The next iteration starts at step ``steps_done``, and later
        epochs keep the new budget. A running iterator carries on with the new
        plan if it has handed out nothing after step ``steps_done`` (a DataLoader
        without workers, read one batch at a time); one that read further stops.

        A remaining sample that alone exceeds the new budget gets a batch of
        its own (see ``oversize``).

        Raises:
            ValueError: ``steps_done`` is beyond the plan, or before the last
                re-plan, or too few samples remain to give every rank a batch
                (see ``drop_last``); the sampler is left unchanged.
        """
        max_tokens = _checks.positive_number("max_tokens", max_tokens)
        steps_done = _checks.non_negative_int("steps_done", steps_done)
        self._history.check_steps_done(steps_done, self.plan)
        history = self._history.then(Replan(steps_done, max_tokens, self.num_replicas))
        plan = self._make_plan(self.epoch, history)  # raises before any change
        self._switch(self.epoch, max_tokens, history, steps_done, plan)
        logger.info(
            "epoch %d: re-planned from step %d under max_tokens=%g", self.epoch, steps_done, max_tokens
        )

    # -- checkpointing -----------------------------------------------------------

    @functools.cached_property
    def _lengths_digest(self) -> str:
        return _state.lengths_digest(self.lengths)

    def state_dict(self, *, steps_done: int | None = None) -> dict[str, Any]:
        """Everything needed to resume this epoch at the same sample with the same budget, on any rank.

        Args:
            steps_done: steps trained so far in this epoch. The default is exact
                for the usual loops, ``accelerator.save_state`` included (it
                calls ``state_dict()`` with no argument): where a training loop
                marks the steps trained (``OOMFallback.iterate``, the Trainer),
                ``position.trained``; else, where a ``DataLoader`` reads the
                sampler (prepared by accelerate or not, with workers or not),
                every batch the loop has received counts as trained, not those
                read ahead; else the steps handed out. Save after the step's
                update. A loop that reads batches ahead itself (a prefetcher of
                its own) sets ``sampler.position.trained = steps`` as it trains,
                or passes ``steps_done``. (torchdata's ``StatefulDataLoader``,
                which checkpoints the sampler itself, gets the steps handed out:
                it accounts for what it read ahead.)

        Raises:
            ValueError: ``steps_done`` is beyond this epoch's plan, or before its last re-plan.
        """
        done = self._position.steps_done()
        if steps_done is not None:
            done = _checks.non_negative_int("steps_done", steps_done)
            self._history.check_steps_done(done, self.plan)
        return _state.state(self, self._lengths_digest, self._history.on(self.num_replicas), done)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (of any rank): the next iteration yields the batches not yet done.

        From another number of processes, the steps trained stay as they were
        (its global steps) and what is left is planned again for this one,
        whose steps follow. Every field is checked before anything changes.

        Raises:
            TypeError: a field of the state has the wrong type.
            ValueError: the state is from another version, dataset or settings,
                a field is out of range (the message names it), or what is left
                cannot give every one of this many processes a batch.
        """
        self._need_budget()
        saved = _state.read_state(state, self, self._lengths_digest)
        history, plan = _state.resume(
            saved, self.num_replicas, lambda h, names: self._make_plan(saved.epoch, h, names)
        )
        self._switch(saved.epoch, saved.max_tokens, history, saved.steps_done, plan)
