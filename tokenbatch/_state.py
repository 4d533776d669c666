"""Where a :class:`~tokenbatch.TokenBudgetBatchSampler`'s epoch is, and its saved state, checked.

:class:`EpochPosition` is the one cursor of an epoch. The sampler owns it and
moves it when it plans, yields and re-plans; the training loop (the OOM
guard's :class:`~tokenbatch._epoch.EpochCursor`, the Trainer's feed) writes
only ``trained``. Everything that asks "where are we?" (a checkpoint, a
re-plan, the progress bar) reads it, rather than keeping a count of its own::

    step:      0    1    2    3    4    5    6   (the epoch's plan)
    trained    ^^^^^^^^^^^                        trained = 3
    handed out ^^^^^^^^^^^^^^^^^^^                handed_out = 5: the DataLoader reads ahead

A saved state (version 2) holds the dataset's fingerprint, the settings the
plan depends on, and the epoch's history (:mod:`tokenbatch._history`) with
the number of ranks of each part; nothing in it depends on the rank, and a
state from another number of ranks is resumed by re-planning what is left.
Version 1 states (one number of ranks for the whole epoch, kept in the
settings) are still read.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from tokenbatch import _checks
from tokenbatch._history import History, Replan
from tokenbatch._reader import Reader
from tokenbatch.cost import CostModel
from tokenbatch.plan import Plan

logger = logging.getLogger("tokenbatch.sampler")

STATE_VERSION = 2
_KEYS_V1 = {
    "version",
    "num_samples",
    "lengths_digest",
    "settings",
    "epoch",
    "max_tokens",
    "epoch_max_tokens",
    "replans",
    "steps_done",
}
STATE_KEYS = {*_KEYS_V1, "epoch_num_replicas"}
_WORLD_SETTINGS = ("num_replicas", "rank")  # in version 1's settings; they need not match


@dataclass
class EpochPosition:
    """Where the sampler's epoch is, in global steps of the epoch's plan."""

    epoch: int = 0
    start: int = 0
    """The step the next pass over the sampler starts at (0, or where a resume or re-plan left it)."""
    handed_out: int = 0
    """Steps the sampler has yielded in this epoch (ahead of training when the DataLoader prefetches)."""
    generation: int = 0
    """Bumped whenever the plan changes under a running pass (re-plan, new epoch, resume)."""
    served: int = -1
    """The generation of the plan the latest pass over the sampler started on, or carried on with."""
    finished: bool = False
    """That pass reached the end of its plan."""
    managed: bool = False
    """A re-plan-aware iterator (``EpochBatches``) draws the epoch: it starts a new pass after a re-plan."""
    counted: bool = False
    """A training loop marks ``trained`` (the OOM guard, the Trainer): checkpoints then use it."""
    full_pass: int = -1
    """The generation of the last DataLoader pass that reached the end of the plan (-1: none)."""
    reader: Reader | None = field(default=None, compare=False, repr=False)
    """The DataLoader pass now reading the plan, where one was found (:mod:`tokenbatch._reader`)."""
    _trained: int = 0

    @property
    def trained(self) -> int:
        """Steps trained in this epoch, as the training loop counts them."""
        return self._trained

    @trained.setter
    def trained(self, steps: int) -> None:
        self._trained, self.counted = steps, True

    def steps_done(self) -> int:
        """The steps trained, as well as the sampler can tell: what a default checkpoint records.

        ``trained`` where a training loop marks it; else the step the
        DataLoader pass has given the loop (every batch received counts as
        trained); else, with no DataLoader in sight, the steps handed out.
        """
        if self.counted:
            return self._trained
        taken = None if self.reader is None else self.reader.steps_taken(self.generation, self.handed_out)
        return self.handed_out if taken is None else min(taken, self.handed_out)

    def move_to(self, step: int) -> None:
        """The plan changed: the next pass starts at ``step``, and every step before it was trained."""
        self.start = self.handed_out = self._trained = step
        self.generation += 1

    def walk(
        self, plan: Plan, rank: int | None, reader: Reader | None = None
    ) -> Generator[list[int], None, int | None]:
        """One pass over ``plan`` from ``start``: ``rank``'s batch of each step, or every rank's (None).

        The cursor moves as batches go out; the pass stops when the plan
        changes under it (a re-plan, a new epoch, a resume), and returns the
        step of the batch it gave last (None: it reached the end of the plan).
        ``reader`` is the DataLoader pass it feeds, if known.

        Raises:
            ValueError: the pass would cover steps planned for another number
                of ranks (an epoch resumed on another number of processes).
        """
        generation, start, world = self.generation, self.start, plan.num_replicas
        if plan.step_starts is not None and np.any(np.diff(plan.step_starts[start:]) != world):
            raise ValueError(
                f"epoch {self.epoch} was resumed on {world} processes after steps planned for another "
                f"number of processes, and those steps cannot be shared out again; call "
                f"set_epoch({self.epoch + 1}) to start the next epoch"
            )
        # A pass starts where the cursor says: every step before it has been trained.
        self.handed_out = self._trained = start
        self.served, self.finished = generation, False
        if reader is not None:
            reader.begin(start, generation)
        self.reader = reader
        slots = [rank] if rank is not None else range(world)
        out = start  # the step of the batch last yielded
        for step in range(start, plan.num_steps):
            for slot in slots:
                if self.generation != generation:
                    return out  # the plan changed: stop this pass, and leave the new plan's position alone
                if slot == slots[-1]:
                    # Counted as the step's last batch goes out, not when the next one is asked for:
                    # a DataLoader without workers asks only when it needs it, so k batches taken
                    # are k steps handed out (in the global plan, a step is every rank's batch).
                    self.handed_out = step + 1
                out = step
                yield plan.batch(plan.step_start(step) + slot).tolist()
        if self.generation != generation:
            return out  # changed while the last batch was out
        self.start, self.finished = 0, True
        if reader is not None:
            reader.exhausted, self.full_pass = True, generation
        return None


@dataclass(frozen=True)
class Saved:
    """What a checked state says: the epoch, the budget in force, how the epoch's plan came about."""

    epoch: int
    max_tokens: float
    history: History
    steps_done: int


class Sampler(Protocol):
    """What a state is saved from and checked against: the sampler's data, settings and epoch."""

    lengths: np.ndarray
    cost: CostModel
    shuffle: bool
    seed: int
    max_batch_size: int | None
    batch_size_multiple: int
    drop_last: bool
    oversize: str

    @property
    def epoch(self) -> int: ...

    @property
    def max_tokens(self) -> float: ...


def settings_of(sampler: Sampler) -> dict[str, Any]:
    """The settings a resumed sampler must share (the plan depends on them), JSON-ready."""
    cost = sampler.cost
    return {
        "cost": [cost.linear, cost.quadratic, cost.per_sample, cost.pad_to_multiple_of],
        "shuffle": sampler.shuffle,
        "seed": sampler.seed,
        "max_batch_size": sampler.max_batch_size,
        "batch_size_multiple": sampler.batch_size_multiple,
        "drop_last": sampler.drop_last,
        "oversize": sampler.oversize,
    }


def lengths_digest(lengths: np.ndarray) -> str:
    """A short fingerprint of the dataset's lengths, to refuse a state saved for other data."""
    return hashlib.blake2b(lengths.tobytes(), digest_size=16).hexdigest()


def state(sampler: Sampler, digest: str, history: History, steps_done: int) -> dict[str, Any]:
    """``sampler.state_dict()``: plain values only, so that it survives JSON and ``torch.save``.

    ``digest`` is the sampler's :func:`lengths_digest`; ``history`` names the ranks of every part.
    """
    return {
        "version": STATE_VERSION,
        "num_samples": len(sampler.lengths),
        "lengths_digest": digest,
        "settings": settings_of(sampler),
        "epoch": sampler.epoch,
        "max_tokens": sampler.max_tokens,
        "epoch_max_tokens": history.max_tokens,
        "epoch_num_replicas": history.num_replicas,
        "replans": [[r.steps_done, r.max_tokens, r.num_replicas] for r in history.replans],
        "steps_done": steps_done,
    }


def read_state(state: Any, sampler: Sampler, digest: str) -> Saved:
    """What ``state`` says for ``sampler`` (``digest``: its lengths'), every field checked.

    A message names the field that is wrong.

    What needs the plan (that each re-plan and ``steps_done`` lie within it)
    is checked by :func:`resume`.

    Raises:
        TypeError: ``state`` or a field of it has the wrong type.
        ValueError: unknown or missing keys, another version, dataset or
            settings, or a value out of range.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state should be a dict from state_dict(), but got {type(state).__name__}")
    version = state.get("version")
    if type(version) is not int or version not in (1, STATE_VERSION):
        raise ValueError(
            f"state['version'] should be 1 or {STATE_VERSION}, the versions this tokenbatch reads, but "
            f"got state['version']={version!r}; resume with the tokenbatch that saved it"
        )
    keys = _KEYS_V1 if version == 1 else STATE_KEYS
    unknown, missing = set(state) - keys, keys - set(state)
    if unknown or missing:
        raise ValueError(
            f"state is not a TokenBudgetBatchSampler state_dict (version {version}): unknown keys "
            f"{sorted(unknown)}, missing keys {sorted(missing)}"
        )
    num_samples, settings = len(sampler.lengths), settings_of(sampler)
    if state["num_samples"] != num_samples or state["lengths_digest"] != digest:
        raise ValueError(
            f"state was saved for a different dataset (state['num_samples']={state['num_samples']!r}, "
            f"state['lengths_digest']={state['lengths_digest']!r}) than this sampler's ({num_samples} "
            f"samples, digest {digest!r}); build the sampler from the same lengths"
        )
    saved = state["settings"]
    if not isinstance(saved, dict):
        raise TypeError(
            f"state['settings'] should be the dict of sampler settings state_dict() saved, but got "
            f"state['settings']={saved!r:.100}"
        )
    if version == 1:
        world = _checks.positive_int("state['settings']['num_replicas']", saved.get("num_replicas"))
        saved = {k: v for k, v in saved.items() if k not in _WORLD_SETTINGS}
    else:
        world = _checks.positive_int("state['epoch_num_replicas']", state["epoch_num_replicas"])
    _compare_settings(saved, settings)
    epoch = _checks.non_negative_int("state['epoch']", state["epoch"])
    max_tokens = _checks.positive_number("state['max_tokens']", state["max_tokens"])
    epoch_max_tokens = _checks.positive_number("state['epoch_max_tokens']", state["epoch_max_tokens"])
    steps_done = _checks.non_negative_int("state['steps_done']", state["steps_done"])
    replans = _read_replans(state["replans"], world if version == 1 else None)
    return Saved(epoch, max_tokens, History(epoch_max_tokens, world, replans), steps_done)


def resume(saved: Saved, world: int, make_plan: Callable[[History, list[str]], Plan]) -> tuple[History, Plan]:
    """The history and plan to resume ``saved`` with on ``world`` ranks; raises before anything changes.

    ``make_plan(history, names)`` plans the saved epoch, naming the state's
    fields in its errors. On another number of ranks, the steps trained stay
    as they were and what is left is planned again for ``world`` ranks.
    """
    history = saved.history
    names = ["state['epoch_max_tokens']"] + [f"state['replans'][{i}]" for i in range(len(history.replans))]
    plan = make_plan(history, names)
    history.check_steps_done(saved.steps_done, plan, "state['steps_done']")
    if history.world(world) == world:
        return history, plan
    history = history.then(Replan(saved.steps_done, saved.max_tokens, world))
    names.append(f"the rest after state['steps_done']={saved.steps_done}, on {world} ranks,")
    plan = make_plan(history, names)
    logger.info(
        "epoch %d: resumed at step %d on %d processes; what is left is planned again for them",
        saved.epoch,
        saved.steps_done,
        world,
    )
    return history, plan


def _compare_settings(saved: dict[str, Any], settings: dict[str, Any]) -> None:
    if saved != settings:
        diff = {
            k: (saved.get(k, "missing"), settings.get(k, "missing"))
            for k in set(saved) | set(settings)
            if k not in saved or k not in settings or saved[k] != settings[k]
        }
        changes = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(
            f"state['settings'] differ from this sampler's ({changes}); "
            f"build the sampler with the saved settings to resume"
        )


def _read_replans(replans: Any, world: int | None) -> tuple[Replan, ...]:
    """``state['replans']``, each entry at or after the one before.

    Entries are ``[steps_done, max_tokens, num_replicas]``, or in version 1
    ``[steps_done, max_tokens]`` on the epoch's ``world`` ranks.
    """
    fields = "[steps_done, max_tokens" + ("]" if world is not None else ", num_replicas]")
    if not isinstance(replans, list | tuple):
        raise TypeError(
            f"state['replans'] should be a list of {fields}, but got state['replans']={replans!r:.100}"
        )
    result: list[Replan] = []
    for i, entry in enumerate(replans):
        name = f"state['replans'][{i}]"
        if not isinstance(entry, list | tuple) or len(entry) != (2 if world is not None else 3):
            raise ValueError(f"{name} should be {fields}, but got {name}={entry!r:.100}")
        steps = _checks.non_negative_int(f"{name}[0]", entry[0])
        budget = _checks.positive_number(f"{name}[1]", entry[1])
        ranks = world if world is not None else _checks.positive_int(f"{name}[2]", entry[2])
        if result and steps < result[-1].steps_done:
            raise ValueError(
                f"{name} should re-plan at or after the step of the re-plan before it "
                f"(steps_done={result[-1].steps_done}), but got {name}={entry!r}"
            )
        result.append(Replan(steps, budget, ranks))
    return tuple(result)
