"""What a TokenBudgetTrainer checkpoint adds to Trainer's: where in the plan, under which budget."""

from __future__ import annotations

import json
import os
from typing import Any

from tokenbatch.oom import OOMFallback
from tokenbatch.sampler import TokenBudgetBatchSampler

STATE_FILE = "tokenbatch_state.json"
VERSION = 1


def write_state(folder: str, state: dict[str, Any]) -> None:
    """Write ``state`` into the checkpoint ``folder`` (before Trainer fills it: it is there when pushed)."""
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, STATE_FILE), "w") as handle:
        json.dump({"version": VERSION, **state}, handle, indent=1)


def read_state(checkpoint: str, oom_mode: str | None) -> dict[str, Any]:
    """The state saved in ``checkpoint``.

    Raises:
        ValueError: the checkpoint was not saved by TokenBudgetTrainer, by
            another version, or with another ``oom_mode``.
    """
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} has no {STATE_FILE}: it was not saved by "
            f"TokenBudgetTrainer, so the sample to resume at and the token budget are unknown; resume "
            f"from a checkpoint TokenBudgetTrainer saved, or start afresh"
        )
    with open(path) as handle:
        state: dict[str, Any] = json.load(handle)
    if state.get("version") != VERSION:
        raise ValueError(
            f"{path} has version={state.get('version')!r}; this tokenbatch reads version {VERSION}"
        )
    if state["oom_mode"] != oom_mode:
        raise ValueError(
            f"{path} was saved with oom_mode={state['oom_mode']!r}, but the trainer has "
            f"oom_mode={oom_mode!r}; resume with the same oom_mode"
        )
    return state


def checkpoint_state(
    *,
    oom_mode: str | None,
    sampler: TokenBudgetBatchSampler,
    fallback: OOMFallback | None,
    max_steps: int,
    schedule_length: int,
) -> dict[str, Any]:
    """Where the run is: the sampler's position and budget, the fallback's state, the run's length.

    Checkpoints are saved after optimizer steps, when every batch handed out
    has been trained: the sampler's ``position.trained`` counts them.
    """
    return {
        "oom_mode": oom_mode,
        "sampler": sampler.state_dict(steps_done=sampler.position.trained),
        "fallback": None if fallback is None else fallback.state_dict(),
        "max_steps": max_steps,
        "schedule_length": schedule_length,
    }
