"""TokenBudgetTrainer over an iterable train set on 2 processes (accelerate launch, CPU, gloo).

Usage: accelerate launch --num_processes 2 trainer_stream_ddp.py DATA_DIR OUT_DIR

oom_mode="halve" with the out-of-memory error injected on rank 1 only; each rank
writes OUT_DIR/rank<r>.json: its steps (the samples whose gradients reached each
optimizer step, both ranks', as the gradients are averaged), events and budgets.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from teardown import end_process_group
from trainer_common import OOM_LIMIT, make_trainer, minilm_tokenizer

from tokenbatch.testing import inject_oom


def main(data_dir: str, out: Path) -> None:
    options = {"oom_mode": "halve", "arguments": {"max_steps": 16}}
    trainer = make_trainer(data_dir, minilm_tokenizer(), out / "run", **options)
    trainer.train_dataset = trainer.train_dataset.to_iterable_dataset(num_shards=2)
    injector = inject_oom(trainer.model, OOM_LIMIT, ranks=[1])
    result = trainer.train()
    injector.remove()
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "global_step": result.global_step,
        "injected": injector.count,
        "events": [event.as_dict() for event in trainer.oom_events],
        "max_tokens": trainer.oom_fallback.max_tokens,
        "stream_max_tokens": trainer.train_sampler.max_tokens,
        "steps": trainer.recorder.steps,
        "step_samples": [log["step_samples"] for log in trainer.recorder.logs if "step_samples" in log],
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    trainer.accelerator.wait_for_everyone()
    del trainer


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
    end_process_group()
