"""TokenBudgetTrainer checkpoints across world sizes: the 2-process side (``torchrun``, CPU, gloo).

Usage: torchrun --nproc_per_node 2 trainer_world.py DATA_DIR OUT_DIR CHECKPOINT

Two runs, one after the other in the same processes, each rank writing
``OUT_DIR/<run>.rank<r>.json`` (what tests/test_integration_transformers.py checks):

- ``widened``: resumes ``CHECKPOINT``, saved by a 1-process run (accumulation 1), on 2 processes;
- ``wide``: trains afresh on 2 processes with gradient accumulation 2 and saves a checkpoint
  after optimizer step ``WIDE_CHECKPOINT`` (in epoch 1), which the test resumes on 1 process.

Besides the recorder's steps (the samples each optimizer step's gradient
used, over both ranks), every rank records the ids its own training forward
passes got, so that the test sees what each rank trained.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_common import make_trainer, minilm_tokenizer, save_at

WIDE_CHECKPOINT = 4


def forward_ids(model: torch.nn.Module) -> list[list[int]]:
    """The sample ids of each training forward pass of ``model`` from now on, in order."""
    seen: list[list[int]] = []

    def record(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if module.training and kwargs.get("idx") is not None:
            seen.append([int(i) for i in kwargs["idx"]])

    model.register_forward_pre_hook(record, with_kwargs=True)
    return seen


def report(trainer: Any, ids: list[list[int]]) -> dict[str, Any]:
    return {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "global_step": trainer.state.global_step,
        "max_steps": trainer.state.max_steps,
        "steps": trainer.recorder.steps,
        "ids": ids,
        "final_lr": float(trainer.lr_scheduler.get_last_lr()[0]),  # 0: the schedule's end reached
    }


def main() -> None:
    torch.set_num_threads(1)
    if int(transformers.__version__.split(".")[0]) < 5:
        from trainer_ddp import restore_indexed_cpu

        restore_indexed_cpu()
    data_dir, out, checkpoint = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    tokenizer = minilm_tokenizer()

    widened = make_trainer(data_dir, tokenizer, out / "widened")
    ids = forward_ids(widened.model)
    widened.train(resume_from_checkpoint=checkpoint)
    rank = widened.accelerator.process_index
    (out / f"widened.rank{rank}.json").write_text(json.dumps(report(widened, ids)))

    wide = make_trainer(data_dir, tokenizer, out / "wide", accumulation=2)
    wide.add_callback(save_at(steps=(WIDE_CHECKPOINT,)))
    ids = forward_ids(wide.model)
    wide.train()
    (out / f"wide.rank{rank}.json").write_text(json.dumps(report(wide, ids)))
    wide.accelerator.wait_for_everyone()  # the checkpoint is complete before the test resumes it


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
