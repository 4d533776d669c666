"""TokenBudgetTrainer with an iterable training set (a TokenBudgetStream per rank) and max_steps.

Which samples each optimizer step trained is read from the gradients of the
tiny model's ``marks`` (see tests/scripts/trainer_common.py), not from
tokenbatch's own bookkeeping.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tokenbatch import TokenBudgetStream
from tokenbatch.testing import inject_oom

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
import trainer_common as tc

sys.path.pop(0)


def stream_trainer(data_dir: Path, tokenizer: Any, out: Path, **options: Any) -> Any:
    trainer = tc.make_trainer(data_dir, tokenizer, out, **options)
    trainer.train_dataset = trainer.train_dataset.to_iterable_dataset(num_shards=2)
    return trainer


def by_epoch(steps: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    seen: dict[int, Counter[int]] = {}
    for step in steps:
        seen.setdefault(step["epoch"], Counter()).update(step["samples"])
    return seen


@pytest.mark.parametrize(("mode", "accumulation"), [("halve", 1), ("split", 2), (None, 1)])
def test_iterable_train_set_trains_each_sample_once_per_epoch_under_oom(
    mode: str | None, accumulation: int, emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    trainer = stream_trainer(
        emotion_data_dir,
        minilm_tokenizer,
        tmp_path,
        oom_mode=mode,
        accumulation=accumulation,
        arguments={"max_steps": 30},
    )
    injector = inject_oom(trainer.model, tc.OOM_LIMIT) if mode else None
    trainer.train()
    steps = trainer.recorder.steps
    assert isinstance(trainer.train_sampler, TokenBudgetStream)
    assert trainer.state.global_step == len(steps) == 30
    seen = by_epoch(steps)
    assert len(seen) >= 2  # epochs until max_steps, each a new order
    for epoch, counts in seen.items():
        assert max(counts.values()) == 1  # never a sample twice in an epoch
        if epoch < max(seen):  # a whole epoch: every sample once
            assert sorted(counts) == list(range(tc.TRAIN_SIZE))
    logged = [log["step_samples"] for log in trainer.recorder.logs if "step_samples" in log]
    assert sum(logged) == sum(len(step["samples"]) for step in steps)
    if mode is not None:
        assert injector is not None and injector.count > 0 and trainer.oom_events
        assert trainer.oom_fallback.max_tokens <= tc.OOM_LIMIT
        if mode == "halve":  # the stream forms its batches under the budget the fallback found
            assert trainer.train_sampler.max_tokens == trainer.oom_fallback.max_tokens
            late = steps[trainer.oom_events[-1].step + 2 :]
            assert all(step["sampler_max_tokens"] <= tc.OOM_LIMIT for step in late)
        injector.remove()


def test_an_iterable_train_set_needs_max_steps(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    trainer = stream_trainer(emotion_data_dir, minilm_tokenizer, tmp_path)
    with pytest.raises(ValueError, match=r"max_steps should be a positive number .* but got max_steps=-1"):
        trainer.train()


def test_checkpoints_of_a_stream_run_are_written_and_resuming_is_refused_clearly(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    trainer = stream_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, save_steps=3, arguments={"max_steps": 4}
    )
    trainer.train()
    assert (tmp_path / "checkpoint-3" / "tokenbatch_state.json").is_file()
    again = stream_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, arguments={"max_steps": 4})
    with pytest.raises(ValueError, match="resume_from_checkpoint is not supported yet with an iterable"):
        again.train(resume_from_checkpoint=str(tmp_path / "checkpoint-3"))


def test_a_torch_iterable_dataset_of_a_generator_trains_too(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    from torch.utils.data import IterableDataset

    rows = list(tc.tokenized(emotion_data_dir, minilm_tokenizer).remove_columns(["text"]))

    class Rows(IterableDataset):  # type: ignore[type-arg]
        def __iter__(self) -> Any:
            yield from rows

    trainer = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, oom_mode="halve", arguments={"max_steps": 12}
    )
    trainer.train_dataset = Rows()
    trainer.train()
    seen = by_epoch(trainer.recorder.steps)
    assert sorted(seen[0]) == list(range(tc.TRAIN_SIZE)) and max(seen[0].values()) == 1


@pytest.mark.slow
def test_two_processes_train_an_iterable_set_with_oom_on_one_rank(
    accelerate_launch: Any, emotion_data_dir: Path, tmp_path: Path
) -> None:
    import json
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    env.update({"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    command = [
        *accelerate_launch(),
        str(repo / "tests" / "scripts" / "trainer_stream_ddp.py"),
        str(emotion_data_dir),
        str(tmp_path),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert reports[0]["global_step"] == reports[1]["global_step"] == 16  # equal steps on both ranks
    assert reports[0]["injected"] == 0 < reports[1]["injected"]  # rank 1 alone ran out of memory
    assert reports[0]["events"] == reports[1]["events"] and reports[0]["events"]
    for report in reports:
        assert report["max_tokens"] == report["stream_max_tokens"] <= tc.OOM_LIMIT
    steps = reports[0]["steps"]
    assert [s["samples"] for s in steps] == [s["samples"] for s in reports[1]["steps"]]
    seen = by_epoch(steps)
    for epoch, counts in seen.items():  # the two ranks' parts together: every sample once an epoch
        assert max(counts.values()) == 1
        if epoch < max(seen):
            assert sorted(counts) == list(range(tc.TRAIN_SIZE))
    assert sum(reports[0]["step_samples"]) == sum(len(s["samples"]) for s in steps)
