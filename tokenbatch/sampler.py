"""``TokenBudgetBatchSampler``: batches that fit a token budget, for a DataLoader.

The sampler is a plan, not a training loop. What it holds is the epoch, the
budget, how the epoch's plan came about (:class:`~tokenbatch.plan.History`),
the step its next pass starts at, and its own count of the steps it has
yielded. Where training is in the epoch belongs to the loop that trains:
``OOMFallback`` (its ``steps_done`` and ``state_dict()``), the Trainer,
Lightning's callback, or torchdata's ``StatefulDataLoader``. They move the
sampler only through its public methods::

    set_epoch(e)                        a new plan, from step 0
    replan(max_tokens, steps_done=k)    steps 0..k-1 stay, the rest is planned again
    state_dict(steps_done=k)            the plan's history and k, to resume
    load_state_dict(state)              the next pass starts at the saved k
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
from torch.utils.data import Sampler

from tokenbatch import _accelerate, _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.plan import (
    OVERSIZE_POLICIES,
    Costs,
    History,
    Plan,
    Planner,
    PlanStats,
    Replan,
    UnitTable,
    batch_stats,
    fit_count,
    int_dtype,
    oversize_error,
    samples_above,
)

__all__ = ["TokenBudgetBatchSampler"]

logger = logging.getLogger(__name__)

_STATE_VERSION = 2
_STATE_KEYS = {
    "version",
    "num_samples",
    "lengths_digest",
    "settings",
    "epoch",
    "max_tokens",
    "epoch_max_tokens",
    "epoch_num_replicas",
    "replans",
    "steps_done",
}
_RESOLVE_HINT = (
    "give it a budget with tokenbatch.auto_budget(model, sampler, memory_limit=...) (the remembered "
    "budget, else the probe), or sampler.resolve(max_tokens) with a number; "
    "TokenBudgetTrainer(max_tokens='auto') does this itself"
)


class TokenBudgetBatchSampler(Sampler[list[int]]):
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
    it yields only that rank's batches, for plain DDP loops.

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
            _check_rank(self.rank, self._num_replicas)
        # Sort keys and per-sample costs are computed once for the dataset: the keys (packs: the examples' own
        # lengths, since only a pack's row is rounded to pad_to_multiple_of) in the narrowest
        # integer type, the costs one per padded length where that is shorter (the planner's memory).
        self._keys = _sort_keys(self.cost, self.lengths)
        self._unit = _per_sample_costs(self.cost, self._keys)
        # The budget: NaN until resolved ("auto"); every path that plans calls _need_budget() first.
        self._max_tokens = self._admitted = math.nan  # in force; the one oversize is judged against
        self._resolved = False
        # How this epoch's plan came about: its first budget and ranks (None: read when planned), re-plans.
        self._epoch = 0
        self._epoch_max_tokens = math.nan
        self._epoch_world: int | None = None
        self._replans: tuple[Replan, ...] = ()
        self._start = 0  # the step the next pass starts at
        # The sampler's own bookkeeping of its passes (never set from outside): which plan they walk,
        # the steps they have yielded of it, and the plan the last full pass walked.
        self._version = 0
        self._yielded = 0
        self._finished = -1
        self._read_by: tuple[int, weakref.ref[Any]] | None = None  # accelerate's DataLoader reading a pass
        self._warned_repeat = False
        self._cache: tuple[tuple[Any, ...], Plan] | None = None
        if not is_auto(max_tokens):
            self.resolve(max_tokens)  # type: ignore[arg-type]

    # -- the budget ----------------------------------------------------------------

    @property
    def resolved(self) -> bool:
        """False for a sampler made with ``max_tokens="auto"`` until :meth:`resolve` is called."""
        return self._resolved

    def resolve(self, max_tokens: float) -> None:
        """Give a sampler made with ``max_tokens="auto"`` its budget, before its first plan.

        :func:`tokenbatch.auto_budget` calls it with the agreed budget; call it
        yourself with a number found another way. Oversize samples are checked
        against it as the constructor checks a numeric ``max_tokens``.

        Raises:
            ValueError: the sampler has a budget already (use :meth:`replan` to change it).

        Example:
            >>> sampler = TokenBudgetBatchSampler([5, 3, 8, 2], max_tokens="auto")
            >>> sampler.resolved
            False
            >>> sampler.resolve(16)
            >>> sampler.max_tokens, len(sampler) > 0
            (16.0, True)
        """
        if self._resolved:
            raise ValueError(
                f"resolve() gives a budget to a sampler made with max_tokens='auto', but this one has "
                f"max_tokens={self._max_tokens:g} already; change it with replan(max_tokens, steps_done=...)"
            )
        budget = _checks.positive_number("max_tokens", max_tokens)
        _check_oversize(self._keys, self._unit, budget, self.oversize)
        _warn_if_one_length(self.lengths, self._unit, budget, self.max_batch_size)
        self._max_tokens = self._admitted = self._epoch_max_tokens = budget
        self._resolved = True

    def _need_budget(self) -> None:
        if not self._resolved:
            raise RuntimeError(
                f"this TokenBudgetBatchSampler has max_tokens='auto' and no budget yet: {_RESOLVE_HINT}"
            )

    # -- what the plan is ------------------------------------------------------------

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
        return self._epoch

    @property
    def start_step(self) -> int:
        """The step of this epoch the next pass starts at: 0, or where a resume or re-plan left it."""
        return self._start

    @property
    def plan(self) -> Plan:
        """This epoch's global plan, with every re-plan so far applied."""
        key = (self._epoch, self.num_replicas, self._history)
        if self._cache is None or self._cache[0] != key:
            self._cache = None  # the old plan's memory is free before the new one is made
            self._cache = (key, self._make_plan(self._epoch, self._history))
        return self._cache[1]

    @property
    def _history(self) -> History:
        self._need_budget()
        return History(self._epoch_max_tokens, self._epoch_world, self._replans)

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
        _check_rank(self.rank, world)
        planner = Planner(
            self._keys,
            self._unit,
            self.shuffle,
            self.seed,
            self.max_batch_size,
            self.batch_size_multiple,
            self.drop_last,
            self.oversize,
            self._admitted,
            self.cost,
        )
        return planner.plan(epoch, history, world, names=names)

    def stats(self) -> PlanStats:
        """Padding, budget use, batch sizes and step balance of this epoch's plan, as ``tokenbatch plan``."""
        budget = self._history.budget_per_batch(self.plan) if self._replans else self._epoch_max_tokens
        return batch_stats(self.plan, self.lengths, self.cost, budget, unit=self._unit)

    # -- iteration ---------------------------------------------------------------------

    def __len__(self) -> int:
        plan, start = self.plan, self._start
        return plan.num_steps - start if self.rank is not None else plan.num_batches - plan.step_start(start)

    def __iter__(self) -> Iterator[list[int]]:
        """The plan from :attr:`start_step` on: this rank's batch of each step, or every rank's.

        A pass walks the plan as it was when it started, and stops if the plan
        changes under it (:meth:`replan`, :meth:`set_epoch`, :meth:`load_state_dict`):
        start a new pass for the new plan.
        """
        # Not a generator: what is refused must be refused when the DataLoader iterator is made, on every
        # rank, also where only one rank will ask for batches (accelerate's dispatcher).
        self._need_budget()
        self._refuse_accelerate_misuse()
        plan, start, version = self.plan, self._start, self._version
        world = plan.num_replicas
        if plan.step_starts is not None and np.any(np.diff(plan.step_starts[start:]) != world):
            raise ValueError(
                f"epoch {self._epoch} was resumed on {world} processes after steps planned for another "
                f"number of processes, and those steps cannot be shared out again; call "
                f"set_epoch({self._epoch + 1}) to start the next epoch"
            )
        if start == 0 and self._finished == version and self.shuffle and not self._warned_repeat:
            self._warned_repeat = True
            _warn_repeat(self._epoch)
        self._yielded = start
        return self._walk(plan, start, version)

    def _walk(self, plan: Plan, start: int, version: int) -> Iterator[list[int]]:
        slots = [self.rank] if self.rank is not None else list(range(plan.num_replicas))
        for step in range(start, plan.num_steps):
            for slot in slots:
                if self._version != version:
                    return
                if slot == slots[-1]:
                    # Counted as the step's last batch goes out: a DataLoader without workers asks for
                    # a batch only when the loop wants it, so k batches taken are k steps yielded.
                    self._yielded = step + 1
                yield _Batch(plan.batch(plan.step_start(step) + slot).tolist())
        if self._version == version:
            self._start, self._finished = 0, version

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (a new plan); the current epoch again is a no-op.

        Call it before each epoch, as with ``DistributedSampler``. Setting the
        epoch the sampler is already in keeps a resumed position and any re-plan.
        On one process, accelerate's prepared DataLoader calls this itself with
        its own count of passes; ``OOMFallback.iterate`` aligns the two.
        """
        epoch = _checks.non_negative_int("epoch", epoch)
        if epoch != self._epoch:
            self._move(epoch, self._max_tokens, History(self._max_tokens), 0)

    def replan(self, max_tokens: float, *, steps_done: int) -> None:
        """Change the budget and re-plan every sample after the first ``steps_done`` steps.

        The first ``steps_done`` global steps stay as they were (trained);
        everything after them is planned again under the new budget. The next
        pass starts at step ``steps_done``, and later epochs keep the new
        budget. A pass that is running stops: the DataLoader must be iterated
        afresh (``OOMFallback.iterate`` does it). A remaining sample that alone
        exceeds the new budget gets a batch of its own (see ``oversize``).

        Raises:
            ValueError: ``steps_done`` is beyond the plan, or before the last
                re-plan, or too few samples remain to give every rank a batch
                (see ``drop_last``); the sampler is left unchanged.
        """
        max_tokens = _checks.positive_number("max_tokens", max_tokens)
        steps_done = _checks.non_negative_int("steps_done", steps_done)
        history = self._history
        history.check_steps_done(steps_done, self.plan)
        history = history.then(Replan(steps_done, max_tokens, self.num_replicas))
        plan = self._make_plan(self._epoch, history)  # raises before any change
        self._move(self._epoch, max_tokens, history, steps_done, plan)
        logger.info(
            "epoch %d: re-planned from step %d under max_tokens=%s",
            self._epoch,
            steps_done,
            _checks.budget(max_tokens),
        )

    def _move(
        self, epoch: int, max_tokens: float, history: History, step: int, plan: Plan | None = None
    ) -> None:
        """Go to ``epoch``'s plan after ``history`` (``plan``, where made already), from ``step`` on."""
        history_now = History(self._epoch_max_tokens, self._epoch_world, self._replans)
        now = (self._epoch, self._max_tokens, history_now, self._start)
        same = (epoch, max_tokens, history, step) == now
        self._epoch, self._max_tokens = epoch, max_tokens
        self._epoch_max_tokens, self._epoch_world, self._replans = (
            history.max_tokens,
            history.num_replicas,
            history.replans,
        )
        if plan is not None:
            self._cache = ((epoch, self.num_replicas, history), plan)
        if not same:  # loading the state the sampler is in already leaves a running pass alone
            self._start = self._yielded = step
            self._version += 1

    def _refuse_accelerate_misuse(self) -> None:
        """Refuse accelerate's set-ups that would mangle this pass; note its DataLoader (public state)."""
        loader = _accelerate.reading(self)
        self._read_by = None if loader is None else (self._version, weakref.ref(loader))
        if loader is None:
            return
        # One process to accelerate, several to torch.distributed: the plan is made for the process group,
        # and accelerate would give every process every rank's batches.
        _accelerate.check_processes()
        chain = _accelerate.batch_samplers(loader)
        if _accelerate.is_dispatcher(loader):
            raise ValueError(
                "dispatch_batches should be False for TokenBudgetBatchSampler, but got "
                "dispatch_batches=True: accelerate would concatenate the processes' batches, which have "
                "different sizes and lengths, and cut the result evenly. Leave it at its default for a "
                "map-style dataset (Accelerator(dataloader_config=DataLoaderConfiguration("
                "dispatch_batches=False))): the sampler plans one batch per process for each step"
            )
        skipped = _accelerate.skipped_batches(chain)
        if skipped and self._start:
            raise ValueError(
                f"skip_first_batches should not be used after the sampler's state was loaded: the "
                f"sampler already resumes epoch {self._epoch} at step {self._start}, the first step not "
                f"yet trained, and skipping {skipped} more batches would never train them. Iterate "
                f"the prepared DataLoader itself after accelerator.load_state (or load_state_dict)"
            )

    # -- checkpointing -------------------------------------------------------------------

    @functools.cached_property
    def _lengths_digest(self) -> str:
        # The array's own buffer where it is contiguous: tobytes() would copy 8 bytes a sample first.
        return hashlib.blake2b(np.ascontiguousarray(self.lengths).data, digest_size=16).hexdigest()

    def state_dict(self, *, steps_done: int | None = None) -> dict[str, Any]:
        """Everything needed to resume this epoch at the same sample with the same budget, on any rank.

        Args:
            steps_done: the steps of this epoch trained so far: the training
                loop's count (``OOMFallback.state_dict()`` passes its own).
                None: the steps the sampler has yielded, which is the count of
                steps trained for a loop over the sampler or over a DataLoader
                without workers, and what torchdata's ``StatefulDataLoader``
                asks for (it accounts for what it read ahead itself). A
                DataLoader with workers reads ``prefetch_factor * num_workers``
                batches ahead of the loop, so there pass the loop's count.

        Raises:
            ValueError: ``steps_done`` is beyond this epoch's plan, or before its
                last re-plan; or it is None while accelerate's prepared DataLoader
                reads this sampler mid-epoch, where the sampler's own count runs
                ahead of training (the message says what to checkpoint instead).
        """
        if steps_done is None:
            self._refuse_read_ahead()
            done = self._yielded
        else:
            done = _checks.non_negative_int("steps_done", steps_done)
            self._history.check_steps_done(done, self.plan)
        history = self._history.on(self.num_replicas)  # a fresh epoch: name the ranks it is planned for
        return {
            "version": _STATE_VERSION,
            "num_samples": len(self.lengths),
            "lengths_digest": self._lengths_digest,
            "settings": self._settings(),
            "epoch": self._epoch,
            "max_tokens": self.max_tokens,
            "epoch_max_tokens": history.max_tokens,
            "epoch_num_replicas": history.num_replicas,
            "replans": [[r.steps_done, r.max_tokens, r.num_replicas] for r in history.replans],
            "steps_done": done,
        }

    def _refuse_read_ahead(self) -> None:
        """Refuse a default ``state_dict()`` that accelerate's prepared DataLoader makes inexact.

        Where accelerate's DataLoader read this plan's latest pass, the steps the
        sampler yielded run ahead of those the loop received, unless that
        DataLoader got to its end (the loop had the epoch's last batch).
        """
        if self._read_by is None or self._read_by[0] != self._version:
            return  # no accelerate DataLoader read this plan: the sampler's count is the loop's
        loader = self._read_by[1]()
        finished = self._finished == self._version or self._yielded == self.plan.num_steps
        if loader is not None and finished and getattr(loader, "end_of_dataloader", False):
            return
        if loader is not None and getattr(loader, "use_stateful_dataloader", False):
            if _accelerate.batch_samplers(loader)[0] is self:
                return  # torchdata asks for the state where the loop is (it snapshots as it reads)
            raise ValueError(
                "the sampler should not be checkpointed itself with use_stateful_dataloader=True on "
                "several processes: accelerate's stateful DataLoader resumes it from its own state, "
                "skipping the batches it had given out, and a registered sampler would skip them a "
                "second time. Leave register_for_checkpointing(sampler) out (register the OOMFallback "
                "instead, or nothing: the DataLoader's state resumes the sampler)"
            )
        raise ValueError(
            f"steps_done should be given to sampler.state_dict() while accelerate's prepared DataLoader "
            f"reads this sampler mid-epoch, but got steps_done=None: the sampler has handed out "
            f"{self._yielded} steps, and the DataLoader holds one batch back and its workers read more "
            f"ahead of the loop, so a resume would skip steps never trained. Register the OOMFallback "
            f"for checkpointing instead (accelerator.register_for_checkpointing(fallback): its state "
            f"holds the sampler's at the steps trained), or use Accelerator(dataloader_config="
            f"DataLoaderConfiguration(use_stateful_dataloader=True)) without registering the sampler, or "
            f"save sampler.state_dict(steps_done=steps_trained) yourself"
        )

    def _settings(self) -> dict[str, Any]:
        """The settings a resumed sampler must share (the plan depends on them), JSON-ready."""
        cost = self.cost
        terms: list[Any] = [cost.linear, cost.quadratic, cost.per_sample, cost.pad_to_multiple_of]
        return {
            # A padded sampler's settings are what they were before packing existed: its checkpoints resume.
            "cost": terms if cost.packing is None else [*terms, cost.packing],
            "shuffle": self.shuffle,
            "seed": self.seed,
            "max_batch_size": self.max_batch_size,
            "batch_size_multiple": self.batch_size_multiple,
            "drop_last": self.drop_last,
            "oversize": self.oversize,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (of any rank): the next pass yields the batches not yet done.

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
        epoch, max_tokens, history, steps_done = self._read_state(state)
        names = ["state['epoch_max_tokens']"]
        names += [f"state['replans'][{i}]" for i in range(len(history.replans))]
        plan = self._make_plan(epoch, history, names)
        history.check_steps_done(steps_done, plan, "state['steps_done']")
        world = self.num_replicas
        if history.world(world) != world:
            history = history.then(Replan(steps_done, max_tokens, world))
            names.append(f"the rest after state['steps_done']={steps_done}, on {world} ranks,")
            plan = self._make_plan(epoch, history, names)
            logger.info(
                "epoch %d: resumed at step %d on %d processes; what is left is planned again for them",
                epoch,
                steps_done,
                world,
            )
        self._move(epoch, max_tokens, history, steps_done, plan)

    def _read_state(self, state: Any) -> tuple[int, float, History, int]:
        """``(epoch, max_tokens, history, steps_done)`` of a state, every field checked; names the bad one."""
        if not isinstance(state, dict):
            raise TypeError(f"state should be a dict from state_dict(), but got {type(state).__name__}")
        version = state.get("version")
        if type(version) is not int or version != _STATE_VERSION:
            raise ValueError(
                f"state['version'] should be {_STATE_VERSION}, the version this tokenbatch reads, but got "
                f"state['version']={version!r}; resume with the tokenbatch that saved it"
            )
        unknown, missing = set(state) - _STATE_KEYS, _STATE_KEYS - set(state)
        if unknown or missing:
            raise ValueError(
                f"state is not a TokenBudgetBatchSampler state_dict: unknown keys {sorted(unknown)}, "
                f"missing keys {sorted(missing)}"
            )
        num_samples, digest = len(self.lengths), self._lengths_digest
        if state["num_samples"] != num_samples or state["lengths_digest"] != digest:
            raise ValueError(
                f"state was saved for a different dataset (state['num_samples']={state['num_samples']!r}, "
                f"state['lengths_digest']={state['lengths_digest']!r}) than this sampler's ({num_samples} "
                f"samples, digest {digest!r}); build the sampler from the same lengths"
            )
        saved, settings = state["settings"], self._settings()
        if not isinstance(saved, dict):
            raise TypeError(
                f"state['settings'] should be the dict of sampler settings state_dict() saved, but got "
                f"state['settings']={saved!r:.100}"
            )
        if saved != settings:
            changes = ", ".join(
                f"{k}: saved {saved.get(k, 'missing')!r}, now {settings.get(k, 'missing')!r}"
                for k in sorted(set(saved) | set(settings))
                if saved.get(k, "missing") != settings.get(k, "missing")
            )
            raise ValueError(
                f"state['settings'] differ from this sampler's ({changes}); "
                f"build the sampler with the saved settings to resume"
            )
        world = _checks.positive_int("state['epoch_num_replicas']", state["epoch_num_replicas"])
        epoch = _checks.non_negative_int("state['epoch']", state["epoch"])
        max_tokens = _checks.positive_number("state['max_tokens']", state["max_tokens"])
        epoch_max_tokens = _checks.positive_number("state['epoch_max_tokens']", state["epoch_max_tokens"])
        steps_done = _checks.non_negative_int("state['steps_done']", state["steps_done"])
        replans = _read_replans(state["replans"])
        return epoch, max_tokens, History(epoch_max_tokens, world, replans), steps_done


class _Batch(list[int]):
    """A batch of indices, as the sampler yields it: a list that refuses to be taken for one index.

    ``DataLoader(dataset, sampler=sampler)`` (for ``batch_sampler=``) hands each batch to the
    dataset as if it were one index, where a plain list ends in an error that does not say why
    (``datasets``: ``int() argument must be ... not 'list'``; a list or range: ``list indices must
    be integers``). Everything a list does otherwise, this does.
    """

    __slots__ = ()

    def __index__(self) -> int:
        raise TypeError(
            "a TokenBudgetBatchSampler batch should be a batch of indices, but it was used as one index: "
            "the DataLoader probably got the sampler as sampler=sampler; pass it as its batch sampler, "
            "DataLoader(dataset, batch_sampler=sampler, collate_fn=...), which reads each batch whole"
        )

    __int__ = __index__


# -- checks and warnings ---------------------------------------------------------------------


def is_auto(max_tokens: Any) -> bool:
    """Whether ``max_tokens`` asks for an automatic budget (the string ``"auto"``, any case).

    Raises:
        TypeError: another string (``"100"``, or a typo of "auto").
    """
    if isinstance(max_tokens, str):
        if max_tokens.strip().lower() == "auto":
            return True
        raise TypeError(
            f"max_tokens should be a positive number or 'auto', but got max_tokens={max_tokens!r}"
        )
    return False


def _sort_keys(cost: CostModel, lengths: np.ndarray) -> np.ndarray:
    """``cost.padded_length(lengths)`` in the narrowest integer type, without an int64 array beside it.

    Packs sort by the examples' own lengths: only a pack's row is rounded to ``pad_to_multiple_of``.
    """
    if cost.packing is not None:
        return lengths.astype(int_dtype(0, int(lengths.max())))
    longest = int(cost.padded_length(int(lengths.max())))
    keys = np.empty(len(lengths), int_dtype(0, longest))
    step = 1 << 16  # the int64 temporaries of padding a chunk stay small
    for start in range(0, len(lengths), step):
        keys[start : start + step] = cost.padded_length(lengths[start : start + step])
    return keys


def _per_sample_costs(cost: CostModel, keys: np.ndarray) -> Costs:
    """``cost.sample_cost(keys)``: a table of one cost per length when that is shorter than the samples."""
    longest = int(keys.max())
    if longest <= 4 * len(keys):  # one entry per length up to the longest: far fewer than samples
        return UnitTable(keys, cost.sample_cost(np.arange(longest + 1)))
    return cost.sample_cost(keys)


def _check_oversize(keys: np.ndarray, unit: Costs, max_tokens: float, oversize: str) -> None:
    """Raise (``oversize="error"``) or warn (``"alone"``) where a sample alone exceeds ``max_tokens``."""
    too_big = samples_above(unit, max_tokens)
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


def _check_rank(rank: int | None, world: int) -> None:
    if rank is not None and rank >= world:
        raise ValueError(
            f"rank should be below num_replicas={world}, but got rank={rank}; ranks count from 0"
        )


def _read_replans(replans: Any) -> tuple[Replan, ...]:
    """``state['replans']``: entries ``[steps_done, max_tokens, num_replicas]``, each at or after the last."""
    fields = "[steps_done, max_tokens, num_replicas]"
    if not isinstance(replans, list | tuple):
        raise TypeError(
            f"state['replans'] should be a list of {fields}, but got state['replans']={replans!r:.100}"
        )
    result: list[Replan] = []
    for i, entry in enumerate(replans):
        name = f"state['replans'][{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != 3:
            raise ValueError(f"{name} should be {fields}, but got {name}={entry!r:.100}")
        steps = _checks.non_negative_int(f"{name}[0]", entry[0])
        budget = _checks.positive_number(f"{name}[1]", entry[1])
        ranks = _checks.positive_int(f"{name}[2]", entry[2])
        if result and steps < result[-1].steps_done:
            raise ValueError(
                f"{name} should re-plan at or after the step of the re-plan before it, "
                f"state['replans'][{i - 1}] (steps_done={result[-1].steps_done}), but got {name}={entry!r}; "
                f"one of the two is wrong"
            )
        result.append(Replan(steps, budget, ranks))
    return tuple(result)


def _warn_if_one_length(lengths: np.ndarray, unit: Costs, max_tokens: float, cap: int | None) -> None:
    """Token budgets need lengths that vary: warn when every sample has the same length."""
    if len(lengths) < 2 or lengths.min() != lengths.max():
        return
    fixed = max(1, fit_count(float(unit[0]), max_tokens, len(lengths) if cap is None else cap))
    warnings.warn(
        f"TokenBudgetBatchSampler: all {len(lengths)} samples have the same length ({int(lengths[0])}), "
        f"so max_tokens={max_tokens:g} is a fixed batch of {fixed} and a token budget gains nothing. "
        f"Were the lengths measured after padding to a fixed length? Pad each batch to its longest "
        f"sample instead (DataCollatorWithPadding; in transformers' run_classification.py or "
        f"run_glue.py, pass --pad_to_max_length False) and give the sampler the unpadded lengths",
        UserWarning,
        stacklevel=4,
    )


def _warn_repeat(epoch: int) -> None:
    """A pass goes over the epoch's whole plan again: set_epoch was forgotten."""
    warnings.warn(
        f"TokenBudgetBatchSampler: epoch {epoch} is iterated again in full, with the same "
        f"plan, and set_epoch was not called since: every epoch then trains the same batches in "
        f"the same order. Call sampler.set_epoch(epoch) before each epoch, as with "
        f"DistributedSampler (accelerate's DataLoader does not call it on several processes); a "
        f"sampler meant to repeat, for evaluation, can be built with shuffle=False",
        UserWarning,
        stacklevel=3,
    )
