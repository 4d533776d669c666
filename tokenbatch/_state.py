"""Where a :class:`~tokenbatch.TokenBudgetBatchSampler`'s epoch is, and the checks of a saved state.

:class:`EpochPosition` is the one cursor of an epoch. The sampler owns it and
moves it when it plans, yields and re-plans; the training loop (the OOM
guard's :class:`~tokenbatch._epoch.EpochCursor`, the Trainer's feed) writes
only ``trained``. Everything that asks "where are we?" (a checkpoint, a
re-plan, the progress bar) reads it, rather than keeping a count of its own::

    step:      0    1    2    3    4    5    6   (the epoch's plan)
    trained    ^^^^^^^^^^^                        trained = 3
    handed out ^^^^^^^^^^^^^^^^^^^                handed_out = 5: the DataLoader reads ahead
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

STATE_VERSION = 1
STATE_KEYS = {
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


@dataclass
class EpochPosition:
    """Where the sampler's epoch is, in global steps of the epoch's plan."""

    epoch: int = 0
    start: int = 0
    """The step the next pass over the sampler starts at (0, or where a resume or re-plan left it)."""
    handed_out: int = 0
    """Steps the sampler has yielded in this epoch (ahead of training when the DataLoader prefetches)."""
    trained: int = 0
    """Steps trained in this epoch, as the training loop counts them."""
    generation: int = 0
    """Bumped whenever the plan changes under a running pass (re-plan, new epoch, resume)."""

    def move_to(self, step: int) -> None:
        """The plan changed: the next pass starts at ``step``, and every step before it was trained."""
        self.start = self.handed_out = self.trained = step
        self.generation += 1


def lengths_digest(lengths: np.ndarray) -> str:
    """A short fingerprint of the dataset's lengths, to refuse a state saved for other data."""
    return hashlib.blake2b(lengths.tobytes(), digest_size=16).hexdigest()


def check_state(state: Any, *, num_samples: int, digest: str, settings: dict[str, Any]) -> None:
    """Raise unless ``state`` is a state_dict of this version for this dataset and these settings.

    Raises:
        TypeError: ``state`` is not a dict.
        ValueError: unknown or missing keys, another version, dataset or settings.
    """
    if not isinstance(state, dict):
        raise TypeError(f"state should be a dict from state_dict(), but got {type(state).__name__}")
    unknown = set(state) - STATE_KEYS
    missing = STATE_KEYS - set(state)
    if unknown or missing:
        raise ValueError(
            f"state is not a TokenBudgetBatchSampler state_dict: unknown keys {sorted(unknown)}, "
            f"missing keys {sorted(missing)}"
        )
    if state["version"] != STATE_VERSION:
        raise ValueError(
            f"state has version={state['version']!r}, but this tokenbatch reads version "
            f"{STATE_VERSION}; resume with the tokenbatch that saved it"
        )
    if state["num_samples"] != num_samples or state["lengths_digest"] != digest:
        raise ValueError(
            f"state was saved for a different dataset ({state['num_samples']} samples, lengths "
            f"digest {state['lengths_digest']}) than this sampler's ({num_samples} samples, "
            f"digest {digest}); build the sampler from the same lengths"
        )
    # Nothing in the state depends on the rank (the plan is global; a rank only picks its share
    # of each step), so any rank resumes from the state one rank saved.
    saved = {k: v for k, v in dict(state["settings"]).items() if k != "rank"}
    settings = {k: v for k, v in settings.items() if k != "rank"}
    if saved != settings:
        diff = {
            k: (saved.get(k), settings.get(k))
            for k in set(saved) | set(settings)
            if saved.get(k) != settings.get(k)
        }
        changes = ", ".join(f"{k}: saved {a!r}, now {b!r}" for k, (a, b) in sorted(diff.items()))
        raise ValueError(
            f"state was saved with different sampler settings ({changes}); "
            f"build the sampler with the saved settings to resume"
        )
