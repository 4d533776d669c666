"""TokenBudgetTrainer checkpoints resumed on another number of processes: 1 -> 2 and 2 -> 1.

The 1-process runs happen in this process; the 2-process ones in
tests/scripts/trainer_world.py under ``torchrun`` (CPU, gloo). Which samples each
optimizer step used is read from the gradients (see tests/scripts/trainer_common.py),
and each rank also records the ids its own forward passes got.
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import trainer_common as tc
    from trainer_world import WIDE_CHECKPOINT, forward_ids
finally:
    sys.path.pop(0)

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
NARROW_CHECKPOINT = 4  # 1 process, accumulation 1: optimizer step 4 of epoch 0's 11


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_tokenizer: Any, torchrun: Any
) -> Any:
    """A 1-process run that saves at NARROW_CHECKPOINT, then the 2-process script (widened, wide)."""
    out = tmp_path_factory.mktemp("trainer_world")
    narrow = tc.make_trainer(emotion_data_dir, minilm_tokenizer, out / "narrow")
    narrow.add_callback(tc.save_at(steps=(NARROW_CHECKPOINT,)))
    narrow.train()
    checkpoint = out / "narrow" / f"checkpoint-{NARROW_CHECKPOINT}"
    torchrun(SCRIPTS / "trainer_world.py", emotion_data_dir, out, checkpoint, timeout=420)
    reports = {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        for name in ("widened", "wide")
    }
    return narrow, reports, out


def assert_once_per_epoch(steps: list[dict[str, Any]], epochs: int = 2) -> None:
    counts: dict[int, Counter[int]] = {}
    for step in steps:
        counts.setdefault(step["epoch"], Counter()).update(step["samples"])
    assert sorted(counts) == list(range(epochs)), "an epoch too many or too few"
    for epoch, count in counts.items():
        assert sorted(count) == list(range(tc.TRAIN_SIZE)), f"epoch {epoch} missed samples"
        assert set(count.values()) == {1}, f"epoch {epoch} used a sample twice: {count.most_common(3)}"


def assert_one_schedule(steps: list[dict[str, Any]], max_steps: int) -> None:
    """Steps 0.. max_steps - 1, a linear schedule that decays without a jump back up to its last step."""
    assert [s["global_step"] for s in steps] == list(range(max_steps))
    rates = [s["lr"] for s in steps]
    assert all(rate > 0 for rate in rates)
    assert all(later <= earlier for earlier, later in itertools.pairwise(rates))
    assert rates[-1] < 0.25 * rates[0]


def test_one_process_checkpoint_resumes_on_two(runs: Any) -> None:
    narrow, reports, _ = runs
    zero, one = reports["widened"]
    assert (zero["world"], zero["rank"], one["rank"]) == (2, 0, 1)
    before = [s for s in narrow.recorder.steps if s["global_step"] < NARROW_CHECKPOINT]
    assert zero["steps"] == one["steps"] and zero["steps"][0]["global_step"] == NARROW_CHECKPOINT
    steps = before + zero["steps"]
    assert_once_per_epoch(steps)
    # Each rank trained its own samples in each step; together, what was left of epoch 0, then epoch 1.
    assert len(zero["ids"]) == len(one["ids"]) == len(zero["steps"])
    for mine, theirs in zip(zero["ids"], one["ids"], strict=True):
        assert not set(mine) & set(theirs)
    trained = Counter(i for ids in zero["ids"] + one["ids"] for i in ids)
    done = {i for s in before for i in s["samples"]}
    assert trained == Counter({i: 1 if i in done else 2 for i in range(tc.TRAIN_SIZE)})
    # The run's length is the new plan's: fewer steps on 2 processes, the schedule followed to its end.
    assert zero["global_step"] == zero["max_steps"] == one["max_steps"] == len(steps)
    assert len(steps) < narrow.state.max_steps
    assert zero["steps"][0]["lr"] == pytest.approx(narrow.recorder.steps[NARROW_CHECKPOINT]["lr"])
    assert_one_schedule(steps, len(steps))
    assert zero["final_lr"] == one["final_lr"] == 0.0  # the schedule ended with the run, not before or after


def test_two_process_checkpoint_resumes_on_one(
    runs: Any, emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    _, reports, out = runs
    zero, one = reports["wide"]
    assert zero["steps"] == one["steps"] and zero["global_step"] == zero["max_steps"]
    before = [s for s in zero["steps"] if s["global_step"] < WIDE_CHECKPOINT]
    assert {s["epoch"] for s in before} == {0, 1}  # the checkpoint is inside epoch 1

    resumed = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, accumulation=2)
    ids = forward_ids(resumed.model)
    resumed.train(resume_from_checkpoint=str(out / "wide" / f"checkpoint-{WIDE_CHECKPOINT}"))

    steps = before + resumed.recorder.steps
    assert_once_per_epoch(steps)
    trained = sorted(i for s in resumed.recorder.steps for i in s["samples"])
    assert sorted(i for batch in ids for i in batch) == trained
    # More, smaller steps on 1 process: the run grew to the new plan, its schedule stretched to it.
    assert resumed.state.global_step == resumed.state.max_steps == len(steps) > zero["max_steps"]
    assert resumed.recorder.steps[0]["lr"] == pytest.approx(zero["steps"][WIDE_CHECKPOINT]["lr"])
    assert_one_schedule(steps, len(steps))
    assert resumed.lr_scheduler.get_last_lr()[0] == zero["final_lr"] == 0.0  # ended with the run
