"""A TokenBudgetTrainer job that survives a killed worker, or a preemption (run by a test, under torchrun).

Run under ``torchrun --nproc_per_node 2 --max-restarts 1``; arguments: data directory, output
directory, ``save_steps``, ``kill_step``, ``term_step`` (-1: none). Like a user's script, each attempt
resumes from the newest complete checkpoint when there is one
(``tokenbatch.integrations.transformers.last_checkpoint``), with ``save_steps`` and
``enable_jit_checkpoint=True``; halve mode, and a real out-of-memory error in the forward of
every batch over ``OOM_LIMIT`` padded tokens (the first step's), which lowers the budget.

What the test makes happen, with real signals:

- ``kill_step``: in attempt 0, rank 0 SIGKILLs itself while it saves checkpoint-``kill_step``,
  once the model file is written (torchrun restarts both workers);
- ``term_step``: in attempt 0, at the start of optimizer step ``term_step``, rank 0 sends SIGTERM
  to torchrun (the job), which sends it on to both workers; rank 0 waits until it has its own.

Each rank writes, per attempt, one line per optimizer step (the samples whose gradient
reached it, read from the ``marks`` parameter as in trainer_common.py) as the step happens,
and a report once ``train()`` has returned.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import trainer_common as tc

from tokenbatch.integrations.transformers import last_checkpoint
from tokenbatch.testing import inject_oom

PREEMPTION = "enable_jit_checkpoint" in TrainingArguments.__dataclass_fields__  # transformers 5


class Faults(TrainerCallback):  # type: ignore[misc]
    """Writes each step's samples as it trains, and sends this attempt's signal."""

    def __init__(self, trainer: Any, log: Path, rank: int, attempt: int, term_step: int) -> None:
        self.trainer, self.log, self.rank, self.attempt, self.term_step = (
            trainer,
            log,
            rank,
            attempt,
            term_step,
        )
        self.received = threading.Event()
        self.signalled_at: int | None = None

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        handler = signal.getsignal(signal.SIGTERM)  # the trainer's, installed by a callback before this one

        def noted(signum: int, frame: Any) -> None:
            self.received.set()
            handler(signum, frame)  # type: ignore[operator]

        signal.signal(signal.SIGTERM, noted)

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attempt == 0 and self.rank == 0 and state.global_step == self.term_step:
            self.signalled_at = state.global_step
            os.kill(os.getppid(), signal.SIGTERM)  # torchrun, which passes it on to every worker
            if not self.received.wait(60):
                raise RuntimeError("torchrun did not pass SIGTERM on within 60 s")

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        grad = kwargs["model"].marks.grad
        used = [] if grad is None else torch.nonzero(grad).flatten().tolist()
        with open(self.log, "a") as handle:  # written now: the process may be killed at any moment
            line = {"global_step": state.global_step, "epoch": self.trainer.train_sampler.epoch}
            handle.write(json.dumps({**line, "samples": sorted(used)}) + "\n")


def kill_while_saving(model: Any, kill_step: int, trainer: Any) -> None:
    """SIGKILL this process once it has written checkpoint-``kill_step``'s model file, mid-checkpoint."""
    save = model.save_pretrained

    def save_then_die(*args: Any, **kwargs: Any) -> Any:
        result = save(*args, **kwargs)
        if trainer.state.global_step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    model.save_pretrained = save_then_die


def main() -> None:
    data_dir, out = sys.argv[1], Path(sys.argv[2])
    save_steps, kill_step, term_step = (int(value) for value in sys.argv[3:6])
    rank, attempt = int(os.environ["RANK"]), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    torch.set_num_threads(1)
    run = out / "run"
    resume = last_checkpoint(run)
    transformers_choice = get_last_checkpoint(run) if run.is_dir() else None
    trainer = tc.make_trainer(
        data_dir,
        tc.minilm_tokenizer(),
        run,
        oom_mode="halve",
        save_steps=save_steps,
        arguments={"enable_jit_checkpoint": True} if PREEMPTION else {},
    )
    faults = Faults(trainer, out / f"steps.rank{rank}.attempt{attempt}.jsonl", rank, attempt, term_step)
    trainer.add_callback(faults)
    if attempt == 0 and rank == 0:
        kill_while_saving(trainer.model, kill_step, trainer)  # kill_step -1: never
    injector = inject_oom(trainer.model, tc.OOM_LIMIT, where="forward")
    trainer.train(resume_from_checkpoint=resume)
    report = {
        "resumed_from": resume and Path(resume).name,
        "get_last_checkpoint": transformers_choice and Path(transformers_choice).name,
        "injected": injector.count,
        "events": [event.as_dict() for event in trainer.oom_events],
        "max_tokens": trainer.oom_fallback.max_tokens,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "signalled_at": faults.signalled_at,
        "received": faults.received.is_set(),
        "ended": time.time(),
    }
    (out / f"report.rank{rank}.attempt{attempt}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
