"""What TokenBudgetTrainer's run says in Trainer's own log lines: the budget and the plan, not a batch size.

Trainer logs its run summary on the ``transformers.trainer`` logger at info
level (what ``transformers.logging.set_verbosity_info()`` shows, as the
transformers examples do); the test reads those records as a user would see them.
"""

from __future__ import annotations

import logging
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenbatch import TokenBudgetBatchSampler

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))
try:
    import trainer_common as tc
finally:
    sys.path.pop(0)


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(line.strip() for line in record.getMessage().splitlines() if line.strip())

    def take(self) -> list[str]:
        lines, self.lines = self.lines, []
        return lines


@pytest.fixture
def trainer_log() -> Iterator[Lines]:
    """Trainer's info lines, as ``set_verbosity_info()`` prints them."""
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logger = logging.getLogger("transformers.trainer")
    handler, level = Lines(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(level)
    assert not logger.filters  # the rewriting ends with the run


def value(lines: list[str], prefix: str) -> str:
    (line,) = [line for line in lines if line.startswith(prefix)]
    return line[len(prefix) :]


def test_training_summary_tells_the_budget_and_the_plans(
    trainer_log: Lines, emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, accumulation=2, save_steps=3)
    trainer.train()
    lines = trainer_log.take()

    lengths = trainer.train_sampler.lengths
    per_epoch = []
    for epoch in range(2):
        sampler = TokenBudgetBatchSampler(lengths, tc.MAX_TOKENS, seed=0, oversize="alone")
        sampler.set_epoch(epoch)
        per_epoch.append(math.ceil(len(sampler) / 2))
    assert value(lines, "Total optimization steps = ") == str(trainer.state.max_steps) == str(sum(per_epoch))
    assert value(lines, "Num examples = ") == str(tc.TRAIN_SIZE)
    first = TokenBudgetBatchSampler(lengths, tc.MAX_TOKENS, seed=0, oversize="alone")
    assert value(lines, "Token budget per batch and device = ") == (
        f"max_tokens=320 (mean batch {tc.TRAIN_SIZE / len(first):.1f} samples in epoch 0's plan; "
        "per_device_train_batch_size is not used for batching)"
    )
    step = value(lines, "Mean samples per optimizer step (w. parallel, distributed & accumulation) = ")
    assert step == f"{tc.TRAIN_SIZE / per_epoch[0]:.1f}"
    if any(line.startswith("Num update steps per epoch") for line in lines):  # transformers 5
        counts = f"{min(per_epoch)}" if min(per_epoch) == max(per_epoch) else f"{min(per_epoch)} to"
        assert value(lines, "Num update steps per epoch = ").startswith(counts)
    # Trainer's own figures from the ignored batch size and the loader's bound are gone.
    assert not [line for line in lines if "batch size" in line.lower() or "Total train batch" in line]

    trainer.evaluate()
    lines = trainer_log.take()
    sampler = trainer._loader_samplers[trainer.get_eval_dataloader()]
    assert value(lines, "Num examples = ") == str(tc.EVAL_SIZE)
    assert value(lines, "Token budget per batch = ") == (
        f"max_tokens=320 ({sampler.plan.num_batches} batches, mean batch "
        f"{tc.EVAL_SIZE / sampler.plan.num_batches:.1f} samples; per_device_eval_batch_size is not used)"
    )
    assert not [line for line in lines if line.startswith("Batch size")]

    resumed = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path / "again", accumulation=2)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))
    lines = trainer_log.take()
    assert value(lines, "Total optimization steps = ") == str(sum(per_epoch))
    told = [line for line in lines if "epoch" in line and ("Resuming" in line or "Continuing" in line)]
    assert told == ["Continuing training from epoch 0, step 6 of its plan"] or told == [
        "Resuming training from checkpoint at epoch 0, step 6 of its plan, global step 3 "
        "(the sampler resumes at the next sample)"
    ]
    assert not [line for line in lines if "skip" in line and "no batch skipped" not in line]
