"""TokenBudgetTrainer end to end on CPU: a tiny BERT, the real MiniLM tokenizer, an emotion slice.

Out-of-memory errors are real ``torch.OutOfMemoryError`` exceptions, raised
in the forward or backward pass by ``tokenbatch.testing.inject_oom`` (over a
cost) or by ``CallOOM`` (at a chosen batch). Which samples each optimizer
step used is read from the gradients (see tests/scripts/trainer_common.py),
not from tokenbatch's own bookkeeping.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenbatch import TokenBudgetBatchSampler, column_lengths
from tokenbatch.integrations.transformers import last_checkpoint
from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import trainer_common as tc
finally:
    sys.path.pop(0)

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py


def uses_per_epoch(steps: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """For each epoch, how many optimizer steps each sample's gradient reached."""
    counts: dict[int, Counter[int]] = {}
    for step in steps:
        counts.setdefault(step["epoch"], Counter()).update(step["samples"])
    return counts


def assert_every_sample_once(steps: list[dict[str, Any]], epochs: int) -> None:
    counts = uses_per_epoch(steps)
    assert sorted(counts) == list(range(epochs))
    for epoch, count in counts.items():
        assert sorted(count) == list(range(tc.TRAIN_SIZE)), f"epoch {epoch} missed samples"
        assert set(count.values()) == {1}, f"epoch {epoch} used a sample twice: {count.most_common(3)}"


def assert_one_run(trainer: Any, steps: list[dict[str, Any]]) -> None:
    """Global step counted from 0 to the end under one schedule, decaying to its end without a restart."""
    assert [s["global_step"] for s in steps] == list(range(len(steps)))
    assert trainer.state.global_step == trainer.state.max_steps == len(steps)
    rates = [s["lr"] for s in steps]
    assert all(rate > 0 for rate in rates)
    assert all(later <= earlier for earlier, later in itertools.pairwise(rates))
    assert rates[-1] < 0.2 * rates[0]


def first_plan_cost(trainer: Any, step: int) -> float:
    """Padded tokens of batch ``step`` in epoch 0's plan (one process), as the injector measures them."""
    sampler = TokenBudgetBatchSampler(trainer.train_sampler.lengths, tc.MAX_TOKENS, seed=0, oversize="alone")
    batch = sampler.plan.batch(step)
    return float(len(batch) * sampler.lengths[batch].max())


@pytest.fixture(scope="module")
def split_run(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_tokenizer: Any) -> Any:
    """oom_mode="split", OOM in the forward of batches over OOM_LIMIT padded tokens; checkpoints kept."""
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path_factory.mktemp("split"))
    trainer.add_callback(tc.save_at(steps=(2,), epochs=(1,)))
    trainer.injector = inject_oom(trainer.model, tc.OOM_LIMIT, where="forward")
    trainer.train()
    trainer.injector.remove()
    return trainer


def test_split_mode_survives_oom_in_place(split_run: Any) -> None:
    trainer, injector, steps = split_run, split_run.injector, split_run.recorder.steps

    assert injector.count == 1  # the costliest batch comes first; micro-batches fit after it
    (event,) = trainer.oom_events
    assert (event.epoch, event.step, event.where, event.old_max_tokens) == (0, 0, ("forward",), tc.MAX_TOKENS)
    assert event.new_max_tokens == 0.5 * min(tc.MAX_TOKENS, first_plan_cost(trainer, 0))
    assert trainer.oom_fallback.max_tokens == event.new_max_tokens
    assert trainer.train_sampler.max_tokens == tc.MAX_TOKENS  # split mode keeps the planned batches
    sampler = trainer.train_sampler  # the guard followed the Trainer's feed: it counted the last epoch
    assert (sampler.epoch, trainer.oom_fallback.steps_done) == (1, sampler.plan.num_steps)
    assert max(injector.costs[1:]) <= event.new_max_tokens
    assert_every_sample_once(steps, epochs=2)
    assert_one_run(trainer, steps)
    # As many optimizer steps as the two epochs' plans have batches: the schedule was sized exactly.
    planned = 0
    for epoch in range(2):
        probe = TokenBudgetBatchSampler(
            trainer.train_sampler.lengths, tc.MAX_TOKENS, seed=0, oversize="alone"
        )
        probe.set_epoch(epoch)
        planned += len(probe)
    assert trainer.state.global_step == planned
    logs = [log for log in trainer.recorder.logs if "loss" in log]
    assert len(logs) == len(steps)
    assert [log["step_samples"] for log in logs] == [len(s["samples"]) for s in steps]
    assert {log["max_tokens"] for log in logs} == {event.new_max_tokens}
    assert {log["oom_events"] for log in logs} == {1.0}
    assert logs[-1]["epoch"] == 2.0


def test_split_mode_trains_as_if_nothing_had_failed(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """Gradient accumulation 2, a loss normalised by num_items, OOM in the backward of a group's 2nd batch."""
    options = {"accumulation": 2, "items_loss": True, "epochs": 1}
    plain = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path / "plain", oom_mode=None, **options)
    plain.train()
    guarded = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path / "guarded", oom_mode="split", **options
    )
    failure = tc.CallOOM(guarded.model, {2}, where="backward")
    guarded.train()

    assert failure.raised == 1
    (event,) = guarded.oom_events
    assert (event.step, event.where) == (1, ("backward",))  # the group's first batch kept its gradient
    assert event.new_max_tokens == 0.5 * min(tc.MAX_TOKENS, first_plan_cost(guarded, 1))
    assert [s["samples"] for s in guarded.recorder.steps] == [s["samples"] for s in plain.recorder.steps]
    assert [s["lr"] for s in guarded.recorder.steps] == [s["lr"] for s in plain.recorder.steps]
    assert_every_sample_once(guarded.recorder.steps, epochs=1)
    difference = (tc.flat_params(guarded.model) - tc.flat_params(plain.model)).abs().max().item()
    assert difference < 1e-5  # micro-batches differ only in float rounding


@pytest.fixture(scope="module")
def halve_run(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_tokenizer: Any) -> Any:
    """oom_mode="halve", accumulation 2, OOM in the forward of a group's 2nd batch; checkpoints kept."""
    out = tmp_path_factory.mktemp("halve")
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, out, oom_mode="halve", accumulation=2)
    trainer.add_callback(tc.save_at(steps=(3,), epochs=(0, 1)))
    failure = tc.CallOOM(trainer.model, {2}, where="forward")
    trainer.train()
    failure.remove()
    return trainer


def test_halve_mode_replans_and_stretches_the_run(halve_run: Any) -> None:
    trainer, steps = halve_run, halve_run.recorder.steps
    (event,) = trainer.oom_events
    assert (event.step, event.where, event.mode) == (1, ("forward",), "halve")
    assert event.new_max_tokens == 0.5 * min(tc.MAX_TOKENS, first_plan_cost(trainer, 1))
    assert trainer.train_sampler.max_tokens == trainer.oom_fallback.max_tokens == event.new_max_tokens
    # The first group trained its first batch and, in place of the failed one, the new plan's first.
    assert_every_sample_once(steps, epochs=2)
    assert_one_run(trainer, steps)
    # More, smaller batches: the run grew past the schedule's original length, which was stretched to it.
    length = trainer.lr_scheduler.length
    assert trainer.state.max_steps > length
    assert steps[-1]["lr"] == pytest.approx(1e-3 / length)  # the original schedule's last step
    assert {s["max_steps"] for s in steps} == {trainer.state.max_steps}  # grown at the first step
    logs = [log for log in trainer.recorder.logs if "loss" in log]
    assert [log["step_samples"] for log in logs] == [len(s["samples"]) for s in steps]
    assert logs[0]["max_tokens"] == event.new_max_tokens


@pytest.mark.parametrize(
    ("mode", "checkpoint"),
    [("split", "checkpoint-2"), ("halve", "checkpoint-3"), ("halve", "end-of-epoch-0")],
)
def test_resume_continues_at_the_same_sample_with_the_same_budget(
    request: pytest.FixtureRequest,
    emotion_data_dir: Path,
    minilm_tokenizer: Any,
    tmp_path: Path,
    mode: str,
    checkpoint: str,
) -> None:
    original = request.getfixturevalue(f"{mode}_run")
    out = Path(original.args.output_dir)
    if checkpoint == "end-of-epoch-0":
        end = max(s["global_step"] for s in original.recorder.steps if s["epoch"] == 0) + 1
        checkpoint = f"checkpoint-{end}"
    state = json.loads((out / checkpoint / "tokenbatch_state.json").read_text())
    assert state["fallback"]["max_tokens"] == original.oom_fallback.max_tokens
    accumulation = original.args.gradient_accumulation_steps

    resumed = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, oom_mode=mode, accumulation=accumulation
    )
    # Anything above the shrunk budget (a forgotten re-plan or micro-batch budget) runs out of memory.
    injector = inject_oom(resumed.model, original.oom_fallback.max_tokens, where="forward")
    resumed.train(resume_from_checkpoint=str(out / checkpoint))

    assert injector.count == 0
    start = int(checkpoint.split("-")[1])
    expected = [s for s in original.recorder.steps if s["global_step"] >= start]
    assert resumed.recorder.steps == expected  # same samples, budget, learning rate, run length
    assert resumed.oom_events == original.oom_events
    assert torch.equal(tc.flat_params(resumed.model), tc.flat_params(original.model))


@pytest.mark.parametrize("mode", ["split", "halve"])
def test_a_finished_run_resumed_trains_nothing(
    request: pytest.FixtureRequest, emotion_data_dir: Path, minilm_tokenizer: Any, mode: str
) -> None:
    """Resumed from its last checkpoint (global_step == max_steps), a run ends at once, as Trainer's does."""
    original = request.getfixturevalue(f"{mode}_run")
    out = Path(original.args.output_dir)
    last = out / f"checkpoint-{original.state.global_step}"  # saved at the end of the last epoch
    assert (last / "tokenbatch_state.json").is_file()
    accumulation = original.args.gradient_accumulation_steps
    resumed = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, out, oom_mode=mode, accumulation=accumulation
    )
    if mode == "halve":  # resume_from_checkpoint=True in the same output_dir (a job run again)
        # A newer checkpoint whose saving was cut short (a process killed): True takes the newest complete.
        (out / "checkpoint-999").mkdir(exist_ok=True)
        (out / "checkpoint-999" / "config.json").write_text("{}")
        assert last_checkpoint(out) == str(last)
    resumed.train(resume_from_checkpoint=True if mode == "halve" else str(last))

    assert resumed.recorder.steps == []
    assert resumed.state.global_step == resumed.state.max_steps == original.state.global_step
    assert torch.equal(tc.flat_params(resumed.model), tc.flat_params(original.model))


def test_max_steps_runs_that_many_steps_across_epochs_and_resumes(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """max_steps into a second epoch that halve mode re-plans: exactly that many steps, resumed in place."""
    lengths = column_lengths(tc.tokenized(emotion_data_dir, minilm_tokenizer))
    first = len(TokenBudgetBatchSampler(lengths, tc.MAX_TOKENS, seed=0, oversize="alone"))  # epoch 0's steps
    max_steps = first + 4
    options: dict[str, Any] = {"oom_mode": "halve", "arguments": {"max_steps": max_steps}}
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path / "run", **options)
    trainer.add_callback(tc.save_at(steps=(first + 2,)))  # in epoch 1, after its re-plan
    failure = tc.CallOOM(trainer.model, {first + 2}, where="forward")  # epoch 1's second batch
    trainer.train()
    failure.remove()

    steps = trainer.recorder.steps
    ((event_epoch, event_step),) = [(event.epoch, event.step) for event in trainer.oom_events]
    assert (event_epoch, event_step) == (1, 1)
    assert [s["global_step"] for s in steps] == list(range(max_steps))
    assert trainer.state.global_step == trainer.state.max_steps == max_steps  # not grown: it is the run
    uses = uses_per_epoch(steps)
    assert sorted(uses) == [0, 1]
    assert sorted(uses[0]) == list(range(tc.TRAIN_SIZE)) and set(uses[0].values()) == {1}
    assert set(uses[1].values()) == {1} and len(uses[1]) < tc.TRAIN_SIZE  # cut at max_steps
    rates = [s["lr"] for s in steps]  # Trainer's own linear schedule over max_steps
    assert rates[0] == pytest.approx(1e-3) and rates[-1] == pytest.approx(1e-3 / max_steps)

    resumed = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path / "resumed", **options)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / f"checkpoint-{first + 2}"))
    assert resumed.recorder.steps == [s for s in steps if s["global_step"] >= first + 2]
    assert resumed.oom_events == trainer.oom_events
    assert torch.equal(tc.flat_params(resumed.model), tc.flat_params(trainer.model))


def test_no_private_trainer_method_is_overridden() -> None:
    """TokenBudgetTrainer stands on Trainer's public extension points, not on what a release may change."""
    from transformers import Trainer

    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    ours = TokenBudgetTrainer.__mro__[: TokenBudgetTrainer.__mro__.index(Trainer)]
    overridden = {name for cls in ours for name in vars(cls) if callable(getattr(Trainer, name, None))}
    assert {name for name in overridden if name.startswith("_") and not name.startswith("__")} == set()
    assert overridden == {
        "__init__",
        "train",
        "get_train_dataloader",
        "get_eval_dataloader",
        "get_test_dataloader",
        "create_scheduler",
        "training_step",
        "log",
        "evaluation_loop",
        "prediction_step",
        "predict",
    }


def test_the_declared_transformers_bound_is_the_one_enforced(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyproject.toml's transformers bound is MIN_TRANSFORMERS; an older transformers is refused by name."""
    import importlib
    import re

    import transformers

    from tokenbatch.integrations import transformers as integration

    bounds = re.findall(r'"transformers>=([0-9.]+)"', (REPO / "pyproject.toml").read_text())
    assert bounds and set(bounds) == {integration.MIN_TRANSFORMERS}
    monkeypatch.setattr(transformers, "__version__", "4.49.0")
    monkeypatch.delitem(sys.modules, integration.__name__)  # restored after the test
    with pytest.raises(ImportError, match=r"needs transformers>=4\.50, but transformers 4\.49\.0 is in"):
        importlib.import_module(integration.__name__)


def test_evaluation_and_prediction_use_the_eval_budget(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    trainer = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, oom_mode=None, eval_max_tokens=200
    )
    dataset = tc.tokenized(emotion_data_dir, minilm_tokenizer, "validation", tc.EVAL_SIZE)
    meter = inject_oom(trainer.model, 1e12)  # records the cost of every forward pass
    output = trainer.predict(dataset)
    metrics = trainer.evaluate()

    assert 2 < meter.calls < 2 * tc.EVAL_SIZE and max(meter.costs) <= 200 < 2 * max(meter.costs)
    assert output.label_ids.tolist() == dataset["label"]  # back in dataset order
    model = trainer.model.eval()
    with torch.no_grad():
        for row, ids in enumerate(dataset["input_ids"]):
            logits = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(torch.as_tensor(output.predictions[row]), logits, atol=1e-5)
    assert math.isclose(metrics["eval_loss"], output.metrics["test_loss"], rel_tol=1e-5)


def test_steps_per_second_count_the_evaluation_batches(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """200 examples under eval_max_tokens=16384 are 1 batch, not 200 / per_device_eval_batch_size."""
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, eval_max_tokens=16384)
    dataset = tc.tokenized(emotion_data_dir, minilm_tokenizer, "validation", 200).remove_columns("idx")
    meter = inject_oom(trainer.model, 1e12)  # counts the forward passes: one per batch
    logged = tc.recorder(trainer)
    trainer.add_callback(logged)
    metrics = trainer.evaluate(dataset)
    predicted = trainer.predict(dataset).metrics

    assert meter.calls == 2
    for values, prefix in ((metrics, "eval"), (logged.logs[-1], "eval"), (predicted, "test")):
        steps = values[f"{prefix}_runtime"] * values[f"{prefix}_steps_per_second"]
        assert steps == pytest.approx(1, rel=0.05), (prefix, values)  # rounded by Trainer to 4 and 3 places


def direct_eval_loss(model: Any, dataset: Any) -> float:
    """The mean cross-entropy over the examples, one forward each: what one big batch would report."""
    model = model.eval()
    with torch.no_grad():
        losses = [
            torch.nn.functional.cross_entropy(
                model(input_ids=torch.tensor([ids])).logits, torch.tensor([label])
            )
            for ids, label in zip(dataset["input_ids"], dataset["label"], strict=True)
        ]
    return float(torch.stack(losses).double().mean())


@pytest.mark.parametrize("items_loss", [False, True])
def test_eval_loss_is_the_mean_over_examples(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path, items_loss: bool
) -> None:
    """Batches of uneven sizes: not the mean of batch means (Trainer's), for a mean or num_items loss."""
    trainer = tc.make_trainer(
        emotion_data_dir,
        minilm_tokenizer,
        tmp_path,
        oom_mode=None,
        eval_max_tokens=200,
        items_loss=items_loss,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] == pytest.approx(
        direct_eval_loss(trainer.model, trainer.eval_dataset), rel=1e-6
    )


def test_evaluation_and_prediction_survive_oom_by_splitting_batches(split_run: Any) -> None:
    trainer, dataset = split_run, split_run.eval_dataset
    budget, planned = trainer.oom_fallback.max_tokens, trainer.train_sampler.max_tokens
    want, want_metrics = trainer.predict(dataset), trainer.evaluate()
    with inject_oom(trainer.model, 150) as injector:  # eval batches of up to MAX_TOKENS run out of memory
        got, got_metrics = trainer.predict(dataset), trainer.evaluate()

    assert injector.count >= 1 and len(trainer.eval_oom_events) == injector.count
    assert max(injector.costs[-3:]) <= 150
    assert trainer.oom_fallback.max_tokens == budget and trainer.train_sampler.max_tokens == planned
    assert torch.allclose(torch.as_tensor(got.predictions), torch.as_tensor(want.predictions), atol=1e-6)
    assert got.label_ids.tolist() == want.label_ids.tolist() == dataset["label"]
    assert got_metrics["eval_loss"] == pytest.approx(want_metrics["eval_loss"], rel=1e-6)
    trainer.oom_mode = None  # no guard: the error reaches the caller
    try:
        with inject_oom(trainer.model, 150), pytest.raises(torch.OutOfMemoryError):
            trainer.evaluate()
    finally:
        trainer.oom_mode = "split"


def test_settings_it_cannot_honour_are_refused(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="max_tokens should be a positive"):
        tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, max_tokens=0)
    with pytest.raises(ValueError, match="oom_mode should be 'split', 'halve' or None"):
        tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path, oom_mode="retry")
    trainer = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path)
    with pytest.raises(ValueError, match="auto_find_batch_size"):
        trainer.args.auto_find_batch_size = True
        type(trainer)(model=trainer.model, args=trainer.args, max_tokens=100)
    trainer.args.auto_find_batch_size = False
    trainer.args.num_train_epochs = 1.5
    with pytest.raises(ValueError, match="num_train_epochs should be a whole number"):
        type(trainer)(model=trainer.model, args=trainer.args, max_tokens=100)
    trainer.args.num_train_epochs = 2
    trainer.train_dataset = trainer.train_dataset.remove_columns(["input_ids"])
    with pytest.raises(KeyError, match="Tokenize it first"):
        trainer.get_train_dataloader()
    (tmp_path / "checkpoint-1").mkdir()
    with pytest.raises(ValueError, match="not saved by TokenBudgetTrainer, or its saving was cut short"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-1"))
    assert last_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="No valid checkpoint found in output directory"):
        trainer.train(resume_from_checkpoint=True)  # checkpoint-1 is not complete


def test_by_default_a_text_over_the_budget_stops_training_with_the_samplers_error(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """max_tokens mistaken for a batch size (20 on 200 texts): the sampler's clear error, before any step."""
    from transformers import TrainingArguments

    from tokenbatch import OversizeSampleError
    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    args = TrainingArguments(str(tmp_path), report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no")
    model = tc.tiny_model(len(minilm_tokenizer), 200)
    trainer = TokenBudgetTrainer(  # no oversize=: the default
        model=model,
        args=args,
        train_dataset=tc.tokenized(emotion_data_dir, minilm_tokenizer, count=200),
        processing_class=minilm_tokenizer,
        max_tokens=20,
    )
    before = tc.flat_params(model).clone()
    with pytest.raises(OversizeSampleError, match=r"more than the budget max_tokens=20 .*raise max_tokens"):
        trainer.train()
    assert trainer.state.global_step == 0
    assert torch.equal(tc.flat_params(model), before)


@pytest.fixture(scope="module")
def ddp_runs(
    accelerate_launch: Any, tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path
) -> dict[str, Any]:
    """Both ranks' reports of every scenario of tests/scripts/trainer_ddp.py (accelerate launch, 2 CPUs)."""
    out = tmp_path_factory.mktemp("trainer_ddp")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "ACCELERATE_USE_CPU": "1",
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
    }
    command = [
        *accelerate_launch(),
        str(SCRIPTS / "trainer_ddp.py"),
        str(emotion_data_dir),
        str(out),
    ]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=420)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the 2-process run hung: {str(error.stderr)[-3000:]}")
    assert done.returncode == 0, done.stderr[-4000:]
    return {
        name: [json.loads((out / f"{name}.rank{r}.json").read_text()) for r in range(2)]
        for name in ("split", "halve", "resumed", "evaluation", "grow")
    }


def injected_in_training(report: dict[str, Any]) -> int:
    """Errors injected in training steps: each evaluation event is one error on each rank it names."""
    return int(report["injected"]) - sum(
        report["rank"] in event["ranks"] for event in report["eval_oom_events"]
    )


@pytest.mark.slow
def test_two_processes_recover_and_resume(
    ddp_runs: dict[str, Any], emotion_data_dir: Path, minilm_tokenizer: Any
) -> None:
    """accelerate launch, 2 CPU processes: split (OOM on rank 1), halve with accumulation (rank 0), resume."""
    runs = {name: ddp_runs[name] for name in ("split", "halve", "resumed")}
    for name, (zero, one) in runs.items():
        assert (zero["world"], zero["rank"], one["rank"]) == (2, 0, 1)
        # Both ranks agree on everything: events, budgets, steps (gradients averaged), parameters.
        for key in (
            "events",
            "max_tokens",
            "sampler_max_tokens",
            "steps",
            "params",
            "global_step",
            "max_steps",
        ):
            assert zero[key] == one[key], (name, key)
        assert (
            zero["global_step"] == zero["max_steps"] == len(zero["steps"]) + zero["steps"][0]["global_step"]
        )
        logs = [log for log in zero["logs"] if "loss" in log]
        assert [log["step_samples"] for log in logs] == [len(s["samples"]) for s in zero["steps"]]
        assert {log["max_tokens"] for log in logs} == {zero["max_tokens"]}
        assert zero["eval"]["eval_loss"] > 0
    lengths = column_lengths(tc.tokenized(emotion_data_dir, minilm_tokenizer))
    plan = TokenBudgetBatchSampler(lengths, tc.MAX_TOKENS, seed=0, oversize="alone", num_replicas=2).plan
    for name, failing, where in (("split", 1, "forward"), ("halve", 0, "backward")):
        zero, one = runs[name]
        injected = (injected_in_training(zero), injected_in_training(one))
        assert injected == ((1, 0) if failing == 0 else (0, 1))
        (event,) = zero["events"]
        assert (event["ranks"], event["where"], event["mode"]) == ([failing], [where], name)
        # The failing rank's first batch (the plan's costliest step comes first; rank r gets batch r of it).
        failed = plan.batch(failing)
        expected = 0.5 * min(tc.MAX_TOKENS, len(failed) * int(lengths[failed].max()))
        assert zero["max_tokens"] == event["new_max_tokens"] == expected
        assert_every_sample_once(zero["steps"], epochs=2)
    assert runs["split"][0]["sampler_max_tokens"] == tc.MAX_TOKENS
    assert runs["halve"][0]["sampler_max_tokens"] == runs["halve"][0]["max_tokens"]
    halve, resumed = runs["halve"][0], runs["resumed"][0]
    assert resumed["injected"] == 0 and resumed["events"] == halve["events"]
    start = resumed["steps"][0]["global_step"]
    assert start == 3
    assert resumed["steps"] == [s for s in halve["steps"] if s["global_step"] >= start]
    assert resumed["params"] == halve["params"]


@pytest.mark.slow
def test_two_processes_grow_alike_in_halve_mode(ddp_runs: dict[str, Any]) -> None:
    """oom_grow=True, OOM on rank 1 only: every re-plan (halving, growth, failed try) alike on both ranks."""
    zero, one = ddp_runs["grow"]
    for key in ("events", "growth", "max_tokens", "sampler_max_tokens", "steps", "params", "global_step"):
        assert zero[key] == one[key], key
    assert injected_in_training(zero) == 0 and injected_in_training(one) >= 1
    assert zero["growth"] or any(event["growth"] for event in zero["events"]), "growth never tried"
    assert zero["max_tokens"] >= 0.9 * tc.OOM_LIMIT
    assert zero["global_step"] == zero["max_steps"] == len(zero["steps"])
    assert_every_sample_once(zero["steps"], epochs=3)


@pytest.mark.slow
def test_two_processes_score_every_example_once(
    ddp_runs: dict[str, Any], emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """evaluate (with and without compute_metrics), predict and eval_strategy="epoch" on 2 processes."""
    everyone = list(range(tc.EVAL_SIZE))
    zero, one = ddp_runs["evaluation"]
    for report in (zero, one, *ddp_runs["split"]):
        # Every compute_metrics call (evaluate, predict, with OOM, during training) saw every example once.
        assert [sorted(ids) for ids in report["eval_ids"]] == [everyone] * len(report["eval_ids"])
    assert len(zero["eval_ids"]) == 4 and len(ddp_runs["split"][0]["eval_ids"]) == 3
    epoch_logs = [log for log in ddp_runs["split"][0]["logs"] if "eval_loss" in log]
    expected = [(1.0, 48.0), (2.0, 48.0), (2.0, 48.0)]  # at the end of each epoch, then evaluate()
    assert [(log["epoch"], log["eval_examples"]) for log in epoch_logs] == expected
    assert ddp_runs["split"][1]["eval_oom_events"]  # rank 1 ran out of memory evaluating during training

    dataset = tc.tokenized(emotion_data_dir, minilm_tokenizer, "validation", tc.EVAL_SIZE)
    assert zero["label_ids"] == one["label_ids"] == [dataset["label"], everyone]  # dataset order
    single = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path, arguments={"label_names": ["labels", "idx"]}
    )
    reference = torch.as_tensor(single.predict(dataset).predictions)
    expected_loss = direct_eval_loss(single.model, dataset)
    for report in (zero, one):
        for key in ("predictions", "oom_predictions"):
            assert torch.allclose(torch.tensor(report[key], dtype=reference.dtype), reference, atol=1e-5)
        for key in ("metrics", "loss_only", "oom_metrics"):
            assert report[key]["eval_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert (zero["injected"], one["injected"] > 0) == (0, True)
    assert zero["eval_oom_events"] == one["eval_oom_events"] != []
    assert {tuple(event["ranks"]) for event in zero["eval_oom_events"]} == {(1,)}
