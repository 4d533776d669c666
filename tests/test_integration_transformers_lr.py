"""TokenBudgetTrainer(lr_scaling=...): each optimizer step's rate scaled by the step's global size.

The rate is read inside the torch optimizer's ``step()`` (a step pre-hook,
tests/scripts/trainer_lr.py), and the step's size from what trained: the
samples whose gradient reached the step (tests/scripts/trainer_common.py's
marks) and their token lengths in the data set, not tokenbatch's own count.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tokenbatch.testing import inject_oom

SCRIPTS = Path(__file__).resolve().parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import trainer_common as tc
    from trainer_lr import rate_probe
finally:
    sys.path.pop(0)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py
RULES = {"linear": lambda ratio: ratio, "sqrt": math.sqrt}
CHECKPOINT = 3  # the scaled run saves after optimizer step 3


def train(
    data_dir: Path,
    tokenizer: Any,
    out: Path,
    *,
    oom: str | None = None,
    save: tuple[int, ...] = (),
    resume: str | None = None,
    **options: Any,
) -> Any:
    """A trainer of tests/scripts/trainer_common.py, trained with a rate probe (and OOM above OOM_LIMIT).

    ``save``: checkpoints after these global steps; ``resume``: a checkpoint to resume from.
    """
    trainer = tc.make_trainer(data_dir, tokenizer, out, **options)
    trainer.probe = rate_probe(trainer)
    trainer.add_callback(trainer.probe)
    trainer.add_callback(tc.save_at(steps=save))
    injector = None if oom is None else inject_oom(trainer.model, tc.OOM_LIMIT, where=oom)
    trainer.train(resume_from_checkpoint=resume)
    trainer.injected = 0 if injector is None else injector.count
    if injector is not None:
        injector.remove()
    return trainer


def step_sizes(steps: list[dict[str, Any]], lengths: list[int], by: str) -> list[int]:
    """Samples or real tokens of each optimizer step, from the samples whose gradient reached it."""
    return [len(s["samples"]) if by == "samples" else sum(lengths[i] for i in s["samples"]) for s in steps]


def assert_scaled(
    rates: list[dict[str, Any]], sizes: list[int], *, rule: str, reference: float
) -> list[float]:
    """Each step's rates, in every parameter group, are the schedule's times rule(size / reference)."""
    assert len(rates) == len(sizes) > 0
    factors = []
    for rate, size in zip(rates, sizes, strict=True):
        factor = RULES[rule](size / reference)
        assert rate["in_step"] == [lr * factor for lr in rate["schedule"]]
        # Put back before the scheduler steps, and the scheduler's own after: it never sees the scaled rate.
        assert rate["after_step"] == rate["schedule"]
        assert rate["after_schedule"] == rate["schedule_after"]
        factors.append(factor)
    assert len(set(factors)) > 1  # steps of different sizes: a constant factor would pass by luck
    return factors


def lengths_of(trainer: Any) -> list[int]:
    return [len(row) for row in trainer.train_dataset["input_ids"]]


@pytest.fixture(scope="module")
def unscaled(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_tokenizer: Any) -> Any:
    return train(emotion_data_dir, minilm_tokenizer, tmp_path_factory.mktemp("none"))


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_tokenizer: Any) -> Any:
    """lr_scaling="linear" by tokens, the default reference; with the tokenbatch log lines it wrote."""
    logger, lines = logging.getLogger("tokenbatch.integrations.transformers"), Lines()
    level = logger.level
    logger.addHandler(lines)
    logger.setLevel(logging.INFO)
    try:
        out = tmp_path_factory.mktemp("linear")
        trainer = train(emotion_data_dir, minilm_tokenizer, out, lr_scaling="linear", save=(CHECKPOINT,))
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    trainer.lines = lines.messages
    return trainer


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_default_is_off_and_leaves_every_rate_as_scheduled(unscaled: Any) -> None:
    assert unscaled.probe.steps and all(r["in_step"] == r["schedule"] for r in unscaled.probe.steps)
    assert not any("lr_scale" in log for log in unscaled.recorder.logs)


def test_linear_by_tokens_scales_each_step_against_the_fixed_batch(scaled: Any, unscaled: Any) -> None:
    lengths = lengths_of(scaled)
    # The default reference: per_device_train_batch_size (8) x 1 process x 1 accumulation, in mean tokens.
    reference = 8 * 1 * 1 * float(np.mean(lengths))
    said = (
        f"lr_scaling='linear': each optimizer step's learning rate times linear(step tokens / {reference:g})"
    )
    assert (
        f"{said}, {reference:g} = per_device_train_batch_size=8 x 1 process(es) x 1 accumulated x mean "
        f"length {np.mean(lengths):.1f}" in scaled.lines
    )
    sizes = step_sizes(scaled.recorder.steps, lengths, "tokens")
    factors = assert_scaled(scaled.probe.steps, sizes, rule="linear", reference=reference)
    assert float(np.mean(factors)) > 1.2  # the budget (320 padded tokens) holds more than 8 texts
    logs = [log for log in scaled.recorder.logs if "loss" in log]
    assert [log["lr_scale"] for log in logs] == factors  # logging_steps=1: each step's own multiplier
    # The schedule is the unscaled run's, step by step and at the end.
    assert [s["lr"] for s in scaled.recorder.steps] == [s["lr"] for s in unscaled.recorder.steps]
    assert [log["learning_rate"] for log in logs] == [
        log["learning_rate"] for log in unscaled.recorder.logs if "loss" in log
    ]
    assert scaled.lr_scheduler.get_last_lr() == unscaled.lr_scheduler.get_last_lr()
    assert [g["lr"] for g in scaled.optimizer.param_groups] == scaled.lr_scheduler.get_last_lr()
    # Gradient clipping runs before the scaling: the first step's norm is the unscaled run's.
    assert logs[0]["grad_norm"] == next(log for log in unscaled.recorder.logs if "loss" in log)["grad_norm"]
    # A larger rate trained the model differently.
    assert not torch.equal(tc.flat_params(scaled.model), tc.flat_params(unscaled.model))


def test_a_checkpoint_holds_the_unscaled_rate_and_resumes_the_same_rates(
    scaled: Any, emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    checkpoint = scaled.args.output_dir + f"/checkpoint-{CHECKPOINT}"
    saved = torch.load(checkpoint + "/optimizer.pt", weights_only=True)["param_groups"]
    assert [group["lr"] for group in saved] == scaled.probe.steps[CHECKPOINT - 1]["schedule_after"]
    resumed = train(emotion_data_dir, minilm_tokenizer, tmp_path, lr_scaling="linear", resume=checkpoint)
    assert resumed.probe.steps == scaled.probe.steps[CHECKPOINT:]


@pytest.mark.parametrize(
    ("rule", "by", "reference", "mode", "oom"),
    [
        ("sqrt", "samples", None, "split", None),  # reference: 8 x 1 x 2 samples
        ("linear", "tokens", 400.0, "split", "forward"),  # micro-batches after OOM count once
        ("linear", "tokens", None, "halve", "backward"),  # a batch re-planned before it trained: not counted
    ],
)
def test_accumulated_steps_count_what_trained_once(
    emotion_data_dir: Path,
    minilm_tokenizer: Any,
    tmp_path: Path,
    rule: str,
    by: str,
    reference: float | None,
    mode: str,
    oom: str | None,
) -> None:
    options = {"lr_scaling": rule, "lr_scaling_by": by, "lr_reference": reference}
    trainer = train(
        emotion_data_dir, minilm_tokenizer, tmp_path, oom=oom, oom_mode=mode, accumulation=2, **options
    )
    lengths = lengths_of(trainer)
    if oom is not None:
        assert trainer.injected >= 1 and trainer.oom_events
    expected = reference or 8 * 2 * (1 if by == "samples" else float(np.mean(lengths)))
    sizes = step_sizes(trainer.recorder.steps, lengths, by)
    assert_scaled(trainer.probe.steps, sizes, rule=rule, reference=expected)
    # Every sample trained once per epoch: the sizes above are whole epochs, nothing counted twice.
    assert sum(sizes) == 2 * (len(lengths) if by == "samples" else sum(lengths))


def test_the_rate_is_put_back_when_the_optimizer_step_raises(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import TrainerCallback

    class FailingStep(TrainerCallback):  # type: ignore[misc]
        """The torch optimizer's third step raises, from inside ``step()`` (a step pre-hook)."""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.seen: list[float] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 0:
                inner = kwargs["optimizer"]
                getattr(inner, "optimizer", inner).register_step_pre_hook(self.hook)

        def hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
            self.seen.append(optimizer.param_groups[0]["lr"])
            if len(self.seen) == 3:
                raise RuntimeError("the third step fails")

    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, lr_scaling="linear")
    failing = FailingStep()
    trainer.add_callback(failing)
    with pytest.raises(RuntimeError, match="the third step fails"):
        trainer.train()
    schedule = trainer.lr_scheduler.get_last_lr()
    assert failing.seen[-1] != schedule[0]  # it failed with a scaled rate in force
    assert [group["lr"] for group in trainer.optimizer.param_groups] == schedule


def test_bad_settings_are_refused_by_name(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    def make(**options: Any) -> Any:
        return tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, **options)

    with pytest.raises(
        ValueError,
        match=r"lr_scaling should be one of 'none', 'linear', 'sqrt', but got "
        r"lr_scaling='cubic'",
    ):
        make(lr_scaling="cubic")
    with pytest.raises(
        ValueError,
        match=r"lr_scaling_by should be one of 'tokens', 'samples', but got "
        r"lr_scaling_by='words'",
    ):
        make(lr_scaling="linear", lr_scaling_by="words")
    with pytest.raises(
        ValueError, match=r"lr_reference should be a positive finite number, but got lr_reference=0"
    ):
        make(lr_scaling="linear", lr_reference=0)
    with pytest.raises(
        TypeError, match=r"lr_reference should be a positive number, but got lr_reference='big'"
    ):
        make(lr_scaling="sqrt", lr_reference="big")
    with pytest.raises(
        ValueError,
        match=r"lr_reference is used only with lr_scaling='linear' or 'sqrt', but "
        r"got lr_reference=512.0 with lr_scaling='none'",
    ):
        make(lr_reference=512)
    with pytest.raises(ValueError, match=r"lr_scaling_by is used only with .* lr_scaling_by='samples' with"):
        make(lr_scaling_by="samples")


def test_a_stream_needs_a_reference_in_tokens(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import TrainingArguments

    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    stream = tc.tokenized(emotion_data_dir, minilm_tokenizer).to_iterable_dataset(num_shards=2)
    arguments = {"max_steps": 4}
    with pytest.raises(
        ValueError,
        match=r"lr_reference should be given with lr_scaling_by='tokens' and an "
        r"iterable train_dataset .* but got lr_reference=None",
    ):
        TokenBudgetTrainer(
            tc.tiny_model(len(minilm_tokenizer)),
            TrainingArguments(str(tmp_path), use_cpu=True, max_steps=4),
            train_dataset=stream,
            processing_class=minilm_tokenizer,
            max_tokens=320,
            lr_scaling="linear",
        )
    # Set after construction (as the stream tests do): refused when training starts, before any step.
    trainer = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, lr_scaling="linear", arguments=arguments
    )
    trainer.train_dataset = stream
    with pytest.raises(ValueError, match=r"lr_reference should be given with lr_scaling_by='tokens'"):
        trainer.train()
    assert trainer.state.global_step == 0
    # In samples, or with a reference, a stream scales too.
    for options in ({"lr_scaling_by": "samples"}, {"lr_reference": 200.0}):
        trainer = tc.make_trainer(
            emotion_data_dir, minilm_tokenizer, tmp_path, lr_scaling="linear", arguments=arguments, **options
        )
        trainer.train_dataset = stream
        probe = rate_probe(trainer)
        trainer.add_callback(probe)
        trainer.train()
        assert len(probe.steps) == 4
        assert all(r["in_step"] != r["schedule"] for r in probe.steps)


def test_batches_without_an_attention_mask_need_samples(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    from transformers import DataCollatorWithPadding

    pad = DataCollatorWithPadding(minilm_tokenizer)

    def collate(rows: list[dict[str, Any]]) -> dict[str, Any]:
        return {k: v for k, v in pad(rows).items() if k != "attention_mask"}

    options = {"data_collator": collate, "lr_scaling": "linear", "arguments": {"max_steps": 2}}
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, **options)
    with pytest.raises(
        TypeError,
        match=r"lr_scaling_by='tokens' counts the ones of each training batch's "
        r"attention_mask, but got a batch without one",
    ):
        trainer.train()
    options.update(lr_scaling_by="samples", oom_mode=None)  # oom_mode=None: Trainer's own training_step
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, **options)
    probe = rate_probe(trainer)
    trainer.add_callback(probe)
    trainer.train()
    sizes = step_sizes(trainer.recorder.steps, lengths_of(trainer), "samples")
    assert_scaled(probe.steps, sizes, rule="linear", reference=8.0)


@pytest.mark.slow
def test_two_processes_apply_the_same_global_multiplier(
    tmp_path: Path, emotion_data_dir: Path, torchrun: Any
) -> None:
    torchrun(SCRIPTS / "trainer_lr.py", emotion_data_dir, tmp_path, timeout=420)
    zero, one = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2))
    assert (zero["world"], zero["rank"], one["rank"]) == (2, 0, 1)
    assert zero["injected"] == 0 < one["injected"]  # rank 1 ran its batches as micro-batches
    assert zero["events"] == one["events"] > 0
    assert zero["steps"] == one["steps"]  # the same samples reached every step on both ranks
    # The same rates inside every step on both ranks: the schedule's times global tokens / reference.
    assert [r["in_step"] for r in zero["rates"]] == [r["in_step"] for r in one["rates"]]
    lengths = zero["lengths"]
    sizes = step_sizes(zero["steps"], lengths, "tokens")
    assert sum(sizes) == 2 * sum(lengths)  # the whole train set on the two ranks, twice
    reference = 8 * 2 * 2 * float(np.mean(lengths))  # per device x 2 processes x 2 accumulated
    for report in (zero, one):
        factors = assert_scaled(report["rates"], sizes, rule="linear", reference=reference)
        assert [log["lr_scale"] for log in report["logs"] if "loss" in log] == factors
