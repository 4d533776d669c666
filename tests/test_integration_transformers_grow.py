"""TokenBudgetTrainer(oom_grow=True): after an OOM the budget climbs back towards what fits, in both modes.

A real ``torch.OutOfMemoryError`` is raised by ``tokenbatch.testing.inject_oom``
in the forward of every batch over ``LIMIT`` padded tokens (the true limit
here). Which samples each optimizer step used is read from the gradients
(tests/scripts/trainer_common.py), not from tokenbatch's own bookkeeping.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))
try:
    import trainer_common as tc
    from test_integration_transformers import assert_every_sample_once, assert_one_run, uses_per_epoch
finally:
    del sys.path[:2]

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
EPOCHS = 3
RESUME_STEP = 14  # in epoch 1, after the growth of epoch 0
LIMIT = 200.0  # the true limit: 320 halves to 240, which fails, then to 200; growth tries above


@pytest.fixture(scope="module", params=[("halve", 1), ("split", 1), ("halve", 2)], ids=str)
def grown(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    emotion_data_dir: Path,
    minilm_tokenizer: Any,
) -> Any:
    """A 3-epoch run with growth on (mode, accumulation), OOM over LIMIT; a checkpoint at RESUME_STEP."""
    mode, accumulation = request.param
    out = tmp_path_factory.mktemp(f"grow_{mode}_{accumulation}")
    options: dict[str, Any] = {"oom_mode": mode, "epochs": EPOCHS, "accumulation": accumulation}
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, out, oom_grow=True, **options)
    trainer.add_callback(tc.save_at(steps=(RESUME_STEP,)))
    with inject_oom(trainer.model, LIMIT, where="forward") as injector:
        trainer.train()
    trainer.injector = injector
    return trainer


def test_the_budget_climbs_back_and_every_sample_trains_once(grown: Any) -> None:
    trainer, steps = grown, grown.recorder.steps
    fallback = trainer.oom_fallback
    assert trainer.oom_events and fallback.growth_events, "no OOM, or no larger budget trained"
    assert trainer.oom_events[0].new_max_tokens < fallback.max_tokens
    # Within the growth tolerance of the true limit (plus the plan's granularity), never above it for long.
    assert 0.9 * LIMIT <= fallback.max_tokens <= 1.05 * LIMIT, fallback.max_tokens
    assert sum(e.growth for e in trainer.oom_events) <= fallback.grow.max_failures
    assert_every_sample_once(steps, epochs=EPOCHS)
    assert_one_run(trainer, steps)  # global_step == max_steps: the run's length followed the re-plans
    if trainer.oom_mode == "halve":
        assert trainer.train_sampler.max_tokens == fallback.max_tokens


def test_resume_after_growth_continues_with_the_grown_budget(
    grown: Any, emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    original = grown
    checkpoint = Path(original.args.output_dir) / f"checkpoint-{RESUME_STEP}"
    options: dict[str, Any] = {"oom_mode": original.oom_mode, "epochs": EPOCHS}
    options["accumulation"] = original.args.gradient_accumulation_steps
    resumed = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, oom_grow=True, **options)
    with inject_oom(resumed.model, LIMIT, where="forward"):
        resumed.train(resume_from_checkpoint=str(checkpoint))
    expected = [s for s in original.recorder.steps if s["global_step"] >= RESUME_STEP]
    assert resumed.recorder.steps == expected  # same samples, budgets, learning rates, run length
    assert resumed.oom_events == original.oom_events  # the history, and no OOM the original did not have
    assert resumed.oom_fallback.growth_events == original.oom_fallback.growth_events
    assert resumed.oom_fallback.max_tokens == original.oom_fallback.max_tokens
    assert torch.equal(tc.flat_params(resumed.model), tc.flat_params(original.model))


def test_max_steps_run_grows_and_keeps_its_length(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """With max_steps, growth re-plans in halve mode and the run stays that many steps, no sample twice."""
    max_steps = 24  # into the second epoch
    trainer = tc.make_trainer(
        emotion_data_dir,
        minilm_tokenizer,
        tmp_path,
        oom_mode="halve",
        oom_grow=True,
        arguments={"max_steps": max_steps},
    )
    with inject_oom(trainer.model, LIMIT, where="forward"):
        trainer.train()
    steps = trainer.recorder.steps
    assert trainer.oom_fallback.growth_events or any(e.growth for e in trainer.oom_events)
    assert [s["global_step"] for s in steps] == list(range(max_steps))
    assert trainer.state.global_step == trainer.state.max_steps == max_steps
    counts = uses_per_epoch(steps)
    assert sorted(counts[0]) == list(range(tc.TRAIN_SIZE))
    assert all(set(count.values()) == {1} for count in counts.values())


def test_bad_oom_grow_is_refused_naming_it(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    with pytest.raises(TypeError, match=r"oom_grow should be True, False or a tokenbatch.oom.Grow, but got"):
        tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, oom_grow="yes")


def test_a_stream_only_shrinks_under_the_same_default(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """Growth proves a budget on a plan, which a stream has not: oom_grow=True (the default) shrinks only."""
    trainer = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, oom_grow=True, arguments={"max_steps": 4}
    )
    trainer.train_dataset = trainer.train_dataset.to_iterable_dataset(num_shards=2)
    with inject_oom(trainer.model, 150, times=1):
        trainer.train()
    assert trainer.state.global_step == 4 and len(trainer.oom_events) == 1
    assert trainer.oom_fallback is not None and trainer.oom_fallback.grow is None
    assert trainer.oom_fallback.growth_events == [] and trainer.oom_fallback.max_tokens < tc.MAX_TOKENS
