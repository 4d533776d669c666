"""What a TokenBudgetTrainer checkpoint adds to Trainer's: where in the plan, under which budget.

:class:`CheckpointWriter`, a callback, writes :data:`STATE_FILE` into every
checkpoint folder Trainer saves (``on_save``; on transformers 5 also
``on_push_begin``, so that the folder is complete when it is pushed to the
Hub). Resuming reads it back (:func:`read_state`), and :func:`sampler_resumes`
stops Trainer from skipping batches itself: the sampler resumes at the next
sample on its own.

Trainer writes a checkpoint in place, file after file, and
``transformers.trainer_utils.get_last_checkpoint`` returns the newest
``checkpoint-N`` folder however far its writing got: a process killed while
saving leaves one that cannot be resumed, or only wrongly. :data:`STATE_FILE`
is written last, once every process has saved its part, and whole (a
temporary file renamed), so a folder that has it is complete:
:func:`last_checkpoint` is the newest such folder.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from transformers import TrainerCallback
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from tokenbatch import _distributed as distributed
from tokenbatch.oom import OOMFallback
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

STATE_FILE = "tokenbatch_state.json"
VERSION = 1


def write_state(folder: str, state: dict[str, Any]) -> None:
    """Write ``state`` into the checkpoint ``folder``, whole or not at all (it marks the folder complete)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    with open(f"{path}.tmp", "w") as handle:
        json.dump({"version": VERSION, **state}, handle, indent=1)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(f"{path}.tmp", path)


def last_checkpoint(output_dir: str | os.PathLike[str]) -> str | None:
    """The newest checkpoint in ``output_dir`` that TokenBudgetTrainer finished saving; None if there is none.

    Use it where ``transformers.trainer_utils.get_last_checkpoint`` would be
    used: that one also returns a folder whose saving was cut short (a process
    killed, a node lost). A complete folder holds :data:`STATE_FILE`.

    Example:
        >>> last_checkpoint("no-such-dir") is None
        True
    """
    folder = os.fspath(output_dir)
    if not os.path.isdir(folder):
        return None
    pattern = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")
    complete = [
        (int(match[1]), name)
        for name in os.listdir(folder)
        if (match := pattern.fullmatch(name)) and os.path.isfile(os.path.join(folder, name, STATE_FILE))
    ]
    return os.path.join(folder, max(complete)[1]) if complete else None


def read_state(checkpoint: str, oom_mode: str | None) -> dict[str, Any]:
    """The state saved in ``checkpoint``, with the ``global_step`` of Trainer's state there.

    Raises:
        ValueError: the checkpoint was not saved by TokenBudgetTrainer, by
            another version, or with another ``oom_mode``.
    """
    path = os.path.join(checkpoint, STATE_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"resume_from_checkpoint={checkpoint!r} has no {STATE_FILE}: it was not saved by "
            f"TokenBudgetTrainer, or its saving was cut short (a process killed), so the sample to resume "
            f"at and the token budget are unknown; resume from last_checkpoint(output_dir), the newest "
            f"complete one (tokenbatch.integrations.transformers), or start afresh"
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
    trainer_state = os.path.join(checkpoint, TRAINER_STATE_NAME)  # without it Trainer starts at step 0
    if os.path.isfile(trainer_state):
        with open(trainer_state) as handle:
            state["global_step"] = int(json.load(handle).get("global_step", 0))
    else:
        state["global_step"] = 0
    return state


def checkpoint_state(
    *,
    oom_mode: str | None,
    sampler: TokenBudgetBatchSampler | TokenBudgetStream,
    steps_done: int,
    fallback: OOMFallback | None,
    max_steps: int,
    schedule_length: int,
) -> dict[str, Any]:
    """Where the run is: the sampler's state at ``steps_done`` (the loop's count), the guard's, the length.

    Checkpoints are saved after optimizer steps, when every batch handed out
    has been trained. A stream (an iterable train set) saves no position:
    such a run cannot be resumed yet.
    """
    if isinstance(sampler, TokenBudgetStream):
        return {
            "oom_mode": oom_mode,
            "sampler": None,
            "fallback": None,
            "max_steps": max_steps,
            "schedule_length": schedule_length,
        }
    return {
        "oom_mode": oom_mode,
        "sampler": sampler.state_dict(steps_done=steps_done),
        "fallback": None if fallback is None else fallback.state_dict(),
        "max_steps": max_steps,
        "schedule_length": schedule_length,
    }


def checkpoint_folder(output_dir: str, global_step: int) -> str | None:
    """The checkpoint folder Trainer saved last at ``global_step``: ``output_dir/checkpoint-N``.

    Under a hyperparameter search it is ``output_dir/<run>/checkpoint-N``; the
    newest such folder is the one just saved. None when there is none.
    """
    name = f"{PREFIX_CHECKPOINT_DIR}-{global_step}"
    folders = [os.path.join(output_dir, name), *glob.glob(os.path.join(glob.escape(output_dir), "*", name))]
    folders = [folder for folder in folders if os.path.isdir(folder)]
    return max(folders, key=os.path.getmtime) if folders else None


class CheckpointWriter(TrainerCallback):
    """Writes ``state()`` (if not None) into each checkpoint folder Trainer saves, on the saving process."""

    def __init__(self, state: Callable[[], dict[str, Any] | None]) -> None:
        self.state = state

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if distributed.is_initialized():  # every process has saved its part (its RNG state, its shard)
            dist.barrier()
        self._write(args, state)

    def on_push_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._write(args, state)  # transformers 5 pushes the checkpoint folder before on_save

    def _write(self, args: Any, trainer_state: Any) -> None:
        if not args.should_save:
            return
        content = self.state()
        folder = checkpoint_folder(args.output_dir, trainer_state.global_step)
        if content is not None and folder is not None:
            write_state(folder, content)


@contextlib.contextmanager
def sampler_resumes(args: Any, resuming: bool) -> Iterator[None]:
    """While resuming: ``args.ignore_data_skip=True``, so that Trainer does not skip batches itself.

    Trainer would skip ``global_step * gradient_accumulation_steps`` batches
    of the DataLoader, counted as if every epoch had the same batches; the
    sampler starts at the next sample itself (its state is in the checkpoint).
    """
    saved = args.ignore_data_skip
    if resuming:
        args.ignore_data_skip = True
    try:
        yield
    finally:
        args.ignore_data_skip = saved
