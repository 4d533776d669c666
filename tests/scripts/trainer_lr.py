"""TokenBudgetTrainer(lr_scaling=...) on 2 processes (torchrun, CPU, gloo), out of memory on rank 1 only.

Usage: python -m torch.distributed.run --nproc_per_node 2 trainer_lr.py DATA_DIR OUT_DIR

Also imported by tests/test_integration_transformers_lr.py for :func:`rate_probe`.
Each rank writes ``OUT_DIR/rank<r>.json``: per optimizer step the rates its
optimizer held inside ``step()``, the schedule's rate, the samples whose
gradient reached the step (on every rank, as the gradients are averaged
across ranks) and the logs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch


def rate_probe(trainer: Any) -> Any:
    """A callback recording, per optimizer step, the learning rates in force inside ``optimizer.step()``.

    The rates are read by a step pre-hook of the torch optimizer itself (what
    the update uses), beside the scheduler's rate at that moment; after the
    step (``on_optimizer_step``, and again after the scheduler stepped) the
    optimizer's rates are recorded too, with the scheduler's.
    """
    from transformers import TrainerCallback

    class RateProbe(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self._hooked: set[int] = set()

        def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self.steps.append(
                {
                    "in_step": [float(group["lr"]) for group in optimizer.param_groups],
                    "schedule": [float(lr) for lr in trainer.lr_scheduler.get_last_lr()],
                }
            )

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            inner = kwargs["optimizer"]
            inner = getattr(inner, "optimizer", inner)  # accelerate's wrapper: the torch optimizer inside
            if id(inner) not in self._hooked:
                self._hooked.add(id(inner))
                inner.register_step_pre_hook(self._hook)

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            groups = kwargs["optimizer"].param_groups
            self.steps[-1]["after_step"] = [float(group["lr"]) for group in groups]

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            groups = kwargs["optimizer"].param_groups
            self.steps[-1]["after_schedule"] = [float(group["lr"]) for group in groups]
            self.steps[-1]["schedule_after"] = [float(lr) for lr in kwargs["lr_scheduler"].get_last_lr()]

    return RateProbe()


def main() -> None:
    torch.set_num_threads(1)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer_common import OOM_LIMIT, make_trainer, minilm_tokenizer

    from tokenbatch.testing import inject_oom

    data_dir, out = sys.argv[1], Path(sys.argv[2])
    trainer = make_trainer(data_dir, minilm_tokenizer(), out / "run", lr_scaling="linear", accumulation=2)
    probe = rate_probe(trainer)
    trainer.add_callback(probe)
    injector = inject_oom(trainer.model, OOM_LIMIT, where="forward", ranks=(1,))
    trainer.train()
    injector.remove()
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "injected": injector.count,
        "events": len(trainer.oom_events),
        "rates": probe.steps,
        "steps": trainer.recorder.steps,
        "logs": trainer.recorder.logs,
        "lengths": [len(row) for row in trainer.train_dataset["input_ids"]],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
