"""A preemption (SIGTERM): a checkpoint at the next optimizer step on every rank, then the end of training.

transformers 5's ``TrainingArguments(enable_jit_checkpoint=True)`` asks for
this: its ``JITCheckpointCallback`` catches SIGTERM and saves a checkpoint.
As it stands it is not exact for a token-budget run:

- each process requests its checkpoint from a timer of its own, 3 s after
  its signal, at whichever hook comes next: on several processes the ranks
  stop at different steps, and one waits in a collective for one that has left;
- that hook may be ``on_pre_optimizer_step``: the step's batches have
  trained, the optimizer has not stepped; the checkpoint would say they were
  trained and the weights would not have them;
- it calls Trainer's ``_save_checkpoint`` without ``on_save``, so the
  checkpoint lacks ``tokenbatch_state.json`` and cannot be resumed.

So with that option :class:`Preemption` takes SIGTERM over while ``train()``
runs (the JIT callback's own handler is put back afterwards): the signal sets
a flag, every rank agrees on it after each optimizer step (one all-reduce of
one number), and at the first step every rank reaches after it Trainer saves
a checkpoint the usual way (with ``on_save``) and stops; ``train()`` returns.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any

from transformers import TrainerCallback

from tokenbatch import _distributed as distributed

logger = logging.getLogger("tokenbatch.integrations.transformers")


def wanted(args: Any) -> bool:
    """True when ``TrainingArguments`` ``args`` ask for a checkpoint on SIGTERM (transformers 5)."""
    return bool(getattr(args, "enable_jit_checkpoint", False))


class Preemption(TrainerCallback):
    """On SIGTERM, a checkpoint at the next optimizer step every rank reaches, then the end of training."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: Any = None
        self._installed = False

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.requested = True  # acted on after the step in progress, by every rank at once

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.requested = False
        if threading.current_thread() is not threading.main_thread():
            logger.warning("enable_jit_checkpoint: train() runs outside the main thread, which gets SIGTERM")
            return
        self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        self._installed = True

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        (flag,) = distributed.all_reduce_max([float(self.requested)], distributed.collective_device())
        if flag:
            logger.warning(
                "SIGTERM: saving a checkpoint at optimizer step %d, then stopping", state.global_step
            )
            control.should_save = True
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
