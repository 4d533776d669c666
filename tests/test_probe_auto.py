"""``max_tokens="auto"``: the unresolved sampler, and ``auto_budget`` from a cache file, the probe
(also under a real RLIMIT_AS), the config's estimate, on 2 processes, in the Trainer and the example."""

from __future__ import annotations

import json
import logging
import os
import re
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from tokenbatch import (
    CostModel,
    OOMFallback,
    OversizeSampleError,
    TokenBudgetBatchSampler,
    auto_budget,
)
from tokenbatch._checks import budget
from tokenbatch.probe import BudgetCache, BudgetKey, MemoryModel, parse_memory
from tokenbatch.probe._auto import model_name
from tokenbatch.probe._cache import scope

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
TINY: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "max_position_embeddings": 512,
}
LIMIT = 64 * 2**20
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(8, 129, 200)]
FOUND_ON = {"version": 2, **scope(CostModel(), np.array(LENGTHS))}  # an entry's record of its data


@pytest.fixture
def tiny() -> Any:
    config = BertConfig(**TINY)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return BertForSequenceClassification(config)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "budgets.json"))
    monkeypatch.delenv("TOKENBATCH_MEMORY_LIMIT", raising=False)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update({"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **extra})
    return env


# -- the sampler before it has a budget ----------------------------------------------------


def test_an_unresolved_sampler_says_how_to_resolve_it(tiny: Any) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    assert not sampler.resolved
    for use in (
        lambda: len(sampler),
        lambda: iter(sampler),
        lambda: sampler.max_tokens,
        lambda: sampler.plan,
        lambda: sampler.stats(),
        lambda: sampler.state_dict(),
        lambda: sampler.replan(10, steps_done=0),
        lambda: OOMFallback(sampler, tiny),
    ):
        with pytest.raises(RuntimeError, match=r"max_tokens='auto' and no budget yet: .*auto_budget"):
            use()
    sampler.set_epoch(2)  # allowed: an epoch needs no budget
    sampler.resolve(500)
    assert sampler.resolved and sampler.max_tokens == 500.0 and sampler.epoch == 2
    reference = TokenBudgetBatchSampler(LENGTHS, max_tokens=500)
    reference.set_epoch(2)
    assert list(sampler) == list(reference)
    with pytest.raises(ValueError, match=r"has max_tokens=500 already; change it with replan"):
        sampler.resolve(400)
    with pytest.raises(ValueError, match=r"auto_budget resolves a sampler made with max_tokens='auto'"):
        auto_budget(tiny, sampler, memory_limit=LIMIT)


def test_bad_budgets_are_named() -> None:
    with pytest.raises(TypeError, match=r"positive number or 'auto', but got max_tokens='aut'"):
        TokenBudgetBatchSampler(LENGTHS, max_tokens="aut")
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="AUTO")
    with pytest.raises(
        ValueError, match=r"max_tokens should be a positive finite number, but got max_tokens=0"
    ):
        sampler.resolve(0)
    with pytest.raises(OversizeSampleError):  # oversize is judged against the resolved budget
        sampler.resolve(50)
    assert not sampler.resolved


# -- where the budget comes from -------------------------------------------------------


@pytest.mark.skipif(
    resource.getrlimit(resource.RLIMIT_AS)[0] != resource.RLIM_INFINITY, reason="this run has a limit"
)
def test_cpu_without_a_memory_limit_says_what_to_pass(tiny: Any) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(ValueError) as error:
        auto_budget(tiny, sampler)
    message = str(error.value)
    assert "max_tokens='auto' on CPU needs a memory limit" in message
    assert "memory_limit=" in message and "TOKENBATCH_MEMORY_LIMIT" in message and "RLIMIT_AS" in message
    assert not sampler.resolved


def test_the_estimate_fits_the_plans_worst_batch(tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENBATCH_MEMORY_LIMIT", "64MiB")
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, measure=False)
    assert (result.source, result.memory_limit, result.probe) == ("estimate", LIMIT, None)
    assert sampler.max_tokens == result.max_tokens == result.estimate
    analytic = MemoryModel.from_config(tiny.config, device="cpu")
    target = 0.9 * LIMIT
    plan = sampler.plan
    peaks = [
        analytic.predict(len(plan.batch(i)), int(max(LENGTHS[j] for j in plan.batch(i))))
        for i in range(plan.num_batches)
    ]
    assert max(peaks) <= target
    # Tight at the longest length: one more sequence there would not fit.
    longest = max(LENGTHS)
    size = int(result.max_tokens // longest)
    assert analytic.predict(size, longest) <= target < analytic.predict(size + 1, longest)


def test_measure_false_without_a_config_says_what_to_pass() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(
        ValueError, match=r"needs a transformers config .* Linear has no .config: pass config="
    ):
        auto_budget(torch.nn.Linear(4, 2), sampler, memory_limit=LIMIT, measure=False)


def test_a_cache_file_is_used_when_its_cost_is_the_samplers(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key = BudgetKey.for_device(model_name(tiny), device="cpu", world_size=1)
    key = BudgetKey(key.model, key.device, LIMIT, key.dtype, 1)
    path = tmp_path / "budgets.json"  # TOKENBATCH_CACHE
    found_on = scope(CostModel(), np.array(LENGTHS))
    path.write_text(json.dumps({str(key): {"version": 2, "max_tokens": 777, "source": "oom", **found_on}}))
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT)  # no probe runs
    assert (result.source, result.max_tokens, sampler.max_tokens, result.probe) == ("cache", 777, 777, None)

    other = {"version": 2, "max_tokens": 999, **found_on}
    other["cost"] = {"linear": 1.0, "quadratic": 0.01, "per_sample": 0.0}  # another cost model: other units
    path.write_text(json.dumps({str(key): other}))
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT, measure=False)
    assert result.source == "estimate" and result.max_tokens != 999
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "in the units of another cost model" in warning and str(path) in warning


def test_an_entry_of_an_older_tokenbatch_is_measured_again_with_a_warning(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Written before entries recorded their cost model and lengths: nothing says what data it holds for.
    key, path = cpu_key(tiny), tmp_path / "budgets.json"
    path.write_text(json.dumps({str(key): {"max_tokens": 777, "source": "oom"}}))
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT, measure=False)
    assert result.source == "estimate" and sampler.max_tokens == result.estimate != 777
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and str(key) in warning and "max_tokens=777" in warning
    assert "written by an older tokenbatch" in warning and "taking the config's estimate instead" in warning
    entry = BudgetCache(path).get(key)  # replaced by one that says what it was found on
    assert entry is not None and entry["version"] == 2 and entry["lengths"] == [min(LENGTHS), max(LENGTHS)]


def test_a_budget_found_on_short_sequences_is_not_reused_for_longer_ones(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Found on lengths up to 128 and remembered, it was handed to data up to 512 tokens long, where
    # every token costs more memory (attention grows with the square of the length).
    short = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    found = auto_budget(tiny, short, memory_limit=LIMIT, measure=False)
    longer = [4 * n for n in LENGTHS]  # 32..512
    sampler = TokenBudgetBatchSampler(longer, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT, measure=False)
    assert result.source == "estimate" and sampler.max_tokens == result.estimate < found.max_tokens
    analytic, longest = MemoryModel.from_config(tiny.config, device="cpu"), max(longer)
    # The budget found at 128 tokens allows a batch of 512-token sequences that does not fit.
    assert analytic.predict(int(found.max_tokens // longest), longest) > 0.9 * LIMIT
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"max_tokens={budget(found.max_tokens)}" in warning and str(found.key) in warning
    assert f"found on padded lengths {min(LENGTHS)}..{max(LENGTHS)}, and this data's reach 32..512" in warning
    # Data within the lengths the (new) entry was found on takes it.
    within = TokenBudgetBatchSampler([n for n in longer if n >= 64], max_tokens="auto")
    again = auto_budget(tiny, within, memory_limit=LIMIT, measure=False)
    assert (again.source, again.max_tokens) == ("cache", result.max_tokens)


def cpu_key(model: Any) -> BudgetKey:
    key = BudgetKey.for_device(model_name(model), device="cpu", world_size=1)
    return BudgetKey(key.model, key.device, LIMIT, key.dtype, 1)


def test_a_cached_budget_far_above_the_estimate_is_not_trusted(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1e30 was used without a word: one batch of every sample.
    path, key = tmp_path / "budgets.json", cpu_key(tiny)
    path.write_text(json.dumps({str(key): {"max_tokens": 1e30, "source": "oom", **FOUND_ON}}))
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT)
    assert result.source == "probe" and result.estimate is not None
    assert sampler.max_tokens == result.max_tokens and 0.7 < result.max_tokens / result.estimate < 1.3
    assert len(sampler) > 1  # not one batch of every sample
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and str(key) in warning
    assert "max_tokens=1e+30" in warning and "more than 4x the config's estimate" in warning
    assert BudgetCache(path).get(key)["max_tokens"] == result.max_tokens  # the probe's replaces it


def test_a_cached_budget_below_one_sample_is_not_trusted(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # 1e-3 stopped the run with OversizeSampleError, without a word of the cache.
    path, key = tmp_path / "budgets.json", cpu_key(tiny)
    path.write_text(json.dumps({str(key): {"max_tokens": 1e-3, "source": "oom", **FOUND_ON}}))
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT, measure=False)
    assert (result.source, sampler.max_tokens) == ("estimate", result.estimate)
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert str(path) in warning and str(key) in warning
    assert "max_tokens=0.001" in warning and f"one sample of the longest length ({max(LENGTHS)})" in warning


def test_a_budget_under_one_sample_says_where_it_came_from(tiny: Any) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(
        OversizeSampleError,
        match=r"raise max_tokens to at least 128.*; max_tokens='auto' gave max_tokens=\S+ from the config's "
        r"estimate \(.*1.43051MiB.*\): raise memory_limit, or pass max_tokens=<number>",
    ):
        auto_budget(tiny, sampler, memory_limit=1_500_000, measure=False)


def test_the_probe_resolves_logs_and_is_remembered(
    tiny: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tokenbatch.probe._auto")
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(tiny, sampler, memory_limit=LIMIT)
    assert result.source == "probe" and result.probe is not None and result.probe.fit is not None
    assert sampler.max_tokens == result.max_tokens
    assert 0.7 < result.max_tokens / result.estimate < 1.3  # the analytic estimate is close on this BERT
    assert f"resolved to max_tokens={budget(result.max_tokens)} from the probe" in caplog.text
    entry = BudgetCache(tmp_path / "budgets.json").get(result.key)
    assert entry is not None and entry["source"] == "probe" and entry["max_tokens"] == result.max_tokens
    again = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    assert auto_budget(tiny, again, memory_limit=LIMIT).source == "cache"
    assert again.max_tokens == result.max_tokens


def test_parse_memory() -> None:
    assert parse_memory("64MiB") == LIMIT and parse_memory("2GB") == 2 * 10**9 and parse_memory("123") == 123
    with pytest.raises(ValueError, match=r"TOKENBATCH_MEMORY_LIMIT should be a size such as 8GiB"):
        parse_memory("lots")


# -- real limits and real processes -----------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status for VmSize")
def test_auto_under_rlimit_as_trains_and_twice_it_runs_out(tmp_path: Path) -> None:
    lengths = [int(n) for n in np.random.default_rng(0).integers(8, 257, 300)] + [256] * 30
    spec = {
        "config": TINY,
        "lengths": lengths,
        "room": 192 * 2**20,
        "max_steps": 4,
        "cache": str(tmp_path / "budgets.json"),
    }
    child = subprocess.run(
        [sys.executable, str(SCRIPTS / "auto_limited.py"), json.dumps(spec)],
        env=child_env(MALLOC_MMAP_THRESHOLD_="65536"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert report["source"] == "probe"
    assert report["key_memory"] == report["rlimit"]  # no memory_limit argument: RLIMIT_AS gave it
    # The room after the probe, which keeps its one-time mappings: less than the 192 MiB given.
    assert 0 < report["memory_limit"] < 192 * 2**20
    assert report["at_budget"] == {"steps": 4, "oom": False, "error": None}
    assert report["at_double"]["oom"] and "can't allocate memory" in report["at_double"]["error"]
    # The next run starts without the probe's mappings: it remembers the budget for the room before it.
    (entry,) = json.loads((tmp_path / "budgets.json").read_text()).values()
    assert entry["source"] == "probe" and entry["max_tokens"] > 1.05 * report["max_tokens"]


@pytest.mark.slow
def test_two_processes_agree_on_one_budget(tmp_path: Path, torchrun: Any) -> None:
    torchrun(SCRIPTS / "auto_ddp.py", tmp_path, timeout=300, env={"OPENBLAS_NUM_THREADS": "1"})
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    mine = [r["probe"]["mine"] for r in ranks]
    assert mine[1] < 0.9 * mine[0]  # rank 1 probed under a smaller limit
    assert ranks[0]["probe"]["agreed"] == ranks[1]["probe"]["agreed"] == min(mine)
    assert ranks[0]["probe"]["len"] == ranks[1]["probe"]["len"]
    # Rank 0's file remembers its own (larger) budget, rank 1 has none: rank 1 probes, and both take
    # the smaller, rank 1's (both took rank 0's "from the cache").
    second = [r["cache_then_probe"] for r in ranks]
    assert [s["probed"] for s in second] == [False, True]
    rank1 = second[1]["mine"]
    assert rank1 < 0.9 * mine[0] and rank1 == pytest.approx(mine[1], rel=0.05)
    assert [(s["agreed"], s["source"]) for s in second] == [(rank1, "probe")] * 2
    assert second[0]["len"] == second[1]["len"]
    assert [s["remembered"] for s in second] == [mine[0], rank1]  # rank 1 remembers what was agreed
    # Each rank's file remembers the agreed budget under that rank's own key.
    assert [r["remembered"] for r in ranks] == [min(mine)] * 2
    # A rank that fails stops every rank, with its reason, rather than leave one waiting.
    assert ranks[1]["refused"].startswith("ValueError: memory_limit=65,536 bytes")
    assert ranks[0]["refused"].startswith("RuntimeError: max_tokens='auto': rank 1 could not find its budget")
    assert ranks[1]["refused"].removeprefix("ValueError: ") in ranks[0]["refused"]


# -- the Trainer and the example ------------------------------------------------------------


def test_trainer_with_auto_resolves_once_and_trains_every_sample(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    sys.path.insert(0, str(SCRIPTS))
    try:
        import trainer_common as tc
    finally:
        sys.path.pop(0)
    trainer = tc.make_trainer(
        emotion_data_dir, minilm_tokenizer, tmp_path / "out", epochs=1, max_tokens="auto", memory_limit=LIMIT
    )
    assert trainer.max_tokens == "auto"
    trainer.train()
    budget = trainer.train_sampler.max_tokens
    assert trainer.max_tokens == trainer.eval_max_tokens == budget
    assert trainer.oom_fallback is not None and trainer.oom_fallback.max_tokens == budget
    seen = sorted(i for step in trainer.recorder.steps for i in step["samples"])
    assert seen == list(range(tc.TRAIN_SIZE))
    assert BudgetCache(tmp_path / "budgets.json").get(trainer_key(trainer)) is not None
    assert trainer.evaluate()["eval_loss"] > 0  # evaluation under the same resolved budget


def trainer_key(trainer: Any) -> BudgetKey:
    key = BudgetKey.for_device(model_name(trainer.model), device="cpu")
    return BudgetKey(key.model, key.device, LIMIT, key.dtype, key.world_size)


@pytest.mark.slow
def test_example_with_auto_probes_then_remembers(
    emotion_slice: Callable[[int, int], Path], minilm_path: str, tmp_path: Path
) -> None:
    out = tmp_path / "metrics.json"
    command = [
        sys.executable,
        str(SCRIPTS / "emotion_run.py"),
        str(out),
        "--data_dir",
        str(emotion_slice(120, 40)),
        "--model_name",
        minilm_path,
        "--num_epochs",
        "1",
        "--max_tokens",
        "auto",
        "--memory_limit",
        "64MiB",
    ]
    env = child_env(TOKENBATCH_CACHE=str(tmp_path / "budgets.json"), HF_DATASETS_CACHE=str(tmp_path / "hf"))
    printed = []
    for _ in range(2):
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-4000:]
        found = re.search(r"--max_tokens auto: max_tokens=(\S+) from the (probe|cache)", done.stdout)
        assert found is not None, done.stdout[-2000:]
        printed.append((float(found.group(1)), found.group(2)))
        metrics = json.loads(out.read_text())
        assert metrics["sampler_max_tokens"] == pytest.approx(printed[-1][0], abs=0.5)  # printed rounded
        assert metrics["epochs"][0]["eval_samples"] == 40
    assert [source for _, source in printed] == ["probe", "cache"]
    assert printed[0][0] == pytest.approx(printed[1][0], rel=1e-5)
