from __future__ import annotations

import json
import logging
import math
import multiprocessing
import pkgutil
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from cache_writer import write_budgets
from oom_common import collate, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler, TokenBudgetStream
from tokenbatch.probe import BudgetCache, BudgetKey, remember_budget
from tokenbatch.probe._cache import default_path, scope
from tokenbatch.testing import inject_oom

quiet()


def test_put_then_get_keeps_entries_per_key(tmp_path: Path) -> None:
    cache = BudgetCache(tmp_path / "sub" / "budgets.json")
    one = BudgetKey("bert-base-cased", "NVIDIA A6000", 48 * 2**30, "float16", 2)
    two = BudgetKey("bert-base-cased", "NVIDIA A6000", 48 * 2**30, "float16", 1)
    cache.put(one, 65536, source="oom", step=12)
    cache.put(two, 131072, source="probe")
    assert cache.get(one) is not None and cache.get(one)["max_tokens"] == 65536.0  # type: ignore[index]
    assert cache.get(one)["step"] == 12  # type: ignore[index]
    assert cache.get(two)["source"] == "probe"  # type: ignore[index]
    cache.put(one, 32768, source="oom")
    assert cache.get(one)["max_tokens"] == 32768.0  # type: ignore[index]
    assert len(json.loads(cache.path.read_text())) == 2


def test_key_for_cpu_device_reads_the_machine() -> None:
    key = BudgetKey.for_device("tiny", device="cpu", dtype="torch.bfloat16", world_size=3)
    assert key.device.startswith("cpu:")
    assert key.memory_bytes > 2**30
    assert key.dtype == "bfloat16"
    assert "x3" in str(key)


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '{"a": {"max_tokens": 5}'])
def test_unreadable_cache_is_a_warning_and_the_next_write_replaces_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    path = tmp_path / "budgets.json"
    path.write_text(text)
    cache, key = BudgetCache(path), BudgetKey("m", "d", 1, "float32", 1)
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        assert cache.get(key) is None
    [message] = caplog.messages
    assert str(path) in message and "ignoring it" in message
    cache.put(key, 64, source="oom")
    assert list(json.loads(path.read_text())) == [str(key)]
    assert not list(tmp_path.glob("*.tmp"))


def test_bad_budget_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens should be a positive finite number"):
        BudgetCache(tmp_path / "b.json").put(BudgetKey("m", "d", 1, "float32", 1), 0, source="oom")


def test_cache_path_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "x.json"))
    assert default_path() == tmp_path / "x.json"
    assert BudgetCache().path == tmp_path / "x.json"


def test_the_cache_lives_in_the_probe_only() -> None:
    import tokenbatch
    from tokenbatch import probe

    # Nothing was released, so there is no compatibility module: tokenbatch.probe is the one place.
    assert "budget_cache" not in {module.name for module in pkgutil.iter_modules(tokenbatch.__path__)}
    for name in ("BudgetCache", "BudgetKey", "remember_budget"):
        assert name in probe.__all__
        assert not hasattr(tokenbatch, name) and name not in tokenbatch.__all__


def test_a_truncated_cache_does_not_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # A real run: a tiny BERT under the guard, out of memory above 200 padded tokens.
    cache, key = (
        BudgetCache(tmp_path / "budgets.json"),
        BudgetKey("tiny-bert", "cpu:test", 2**30, "float32", 1),
    )
    cache.put(key, 128, source="oom")
    cache.path.write_text(cache.path.read_text()[:40])  # cut short, as by a full disk or a crash
    rows = make_rows(32)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], 256, seed=0)
    model = tiny_bert(0)
    fallback = OOMFallback(sampler, model, mode="halve", grow=False)  # the budget in force is what trained
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        remember_budget(fallback, key, cache=cache)
        assert fallback.max_tokens == 256
        trained: list[int] = []
        injector = inject_oom(model, 200)
        for batch in fallback.iterate(DataLoader(rows, batch_sampler=sampler, collate_fn=collate)):
            if fallback.backward(batch, loss_fn(model)) is not None:
                trained += batch["idx"].tolist()
        injector.remove()
    assert sorted(trained) == list(range(32)) and fallback.max_tokens < 256
    assert any(str(cache.path) in m and "ignoring it" in m for m in caplog.messages)
    entry = cache.get(key)  # the budget that fitted replaced the broken file
    assert entry is not None and entry["max_tokens"] == fallback.max_tokens


def test_the_guard_starts_only_from_a_budget_found_on_lengths_like_its_own(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # A budget remembered for sequences of 4..16 tokens was the start of a run on 64-token ones.
    cache, key = BudgetCache(tmp_path / "budgets.json"), BudgetKey("m", "d", 1, "float32", 1)
    cache.put(key, 64, source="oom", **scope(CostModel(), np.array([4, 16])))

    def start(lengths: list[int], cost: CostModel | None = None) -> float:
        sampler = TokenBudgetBatchSampler(lengths, max_tokens=256, cost=cost)
        fallback = OOMFallback(sampler, torch.nn.Linear(4, 1))
        remember_budget(fallback, key, cache=cache)
        return fallback.max_tokens

    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        assert start([4] * 6 + [16] * 6) == 64  # within the lengths it was found on
        assert not caplog.messages
        assert start([4] * 6 + [64] * 6) == 256
        (message,) = caplog.messages
        assert str(cache.path) in message and str(key) in message and "max_tokens=64" in message
        assert "found on padded lengths 4..16, and this data's reach 4..64" in message
        caplog.clear()
        assert start([2] * 6 + [16] * 6) == 256  # shorter too: a per-sample cost the model does not count
        assert "and this data's reach 2..16" in caplog.messages[0]
        caplog.clear()
        assert start([4] * 6 + [16] * 6, CostModel(quadratic=1 / 16)) == 256  # other units
        assert "in the units of another cost model" in caplog.messages[0]
        caplog.clear()
        cache.path.write_text(json.dumps({str(key): {"max_tokens": 64, "source": "oom"}}))  # the old format
        assert start([4] * 6 + [16] * 6) == 256
        assert "written by an older tokenbatch" in caplog.messages[0]


def test_a_stream_is_not_given_a_budget_found_on_other_data(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache, key = BudgetCache(tmp_path / "budgets.json"), BudgetKey("m", "d", 1, "float32", 1)
    cache.put(key, 8, source="oom", **scope(CostModel(), np.array([4, 16])))
    stream = TokenBudgetStream([{"input_ids": [0] * 4}] * 8, max_tokens=16)
    fallback = OOMFallback(stream, torch.nn.Linear(4, 1))
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        remember_budget(fallback, key, cache=cache)
    assert fallback.max_tokens == 16
    assert "which a TokenBudgetStream does not know before it is read" in caplog.messages[0]


@pytest.mark.parametrize("bad", [-5, 0, math.nan, math.inf, "8192", "lots", None, True, [64]], ids=repr)
def test_an_entry_with_a_bad_budget_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, bad: object
) -> None:
    cache = BudgetCache(tmp_path / "budgets.json")
    key, other = BudgetKey("m", "d", 1, "float32", 1), BudgetKey("n", "d", 1, "float32", 1)
    cache.put(other, 8, source="probe")
    data = json.loads(cache.path.read_text())
    data[str(key)] = {"max_tokens": bad, "source": "hand"}
    cache.path.write_text(json.dumps(data))
    fallback = OOMFallback(TokenBudgetBatchSampler([4] * 12, max_tokens=16), torch.nn.Linear(4, 1))
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        assert cache.get(key) is None
        remember_budget(fallback, key, cache=cache)
    assert fallback.max_tokens == 16
    assert len(caplog.messages) == 2
    for message in caplog.messages:
        assert str(cache.path) in message and str(key) in message and "max_tokens" in message
    assert cache.get(other) is not None and cache.get(other)["max_tokens"] == 8  # type: ignore[index]


def test_an_entry_that_is_not_an_object_is_ignored_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache, key = BudgetCache(tmp_path / "budgets.json"), BudgetKey("m", "d", 1, "float32", 1)
    cache.path.write_text(json.dumps({str(key): 4096}))
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        assert cache.get(key) is None
    [message] = caplog.messages
    assert str(cache.path) in message and str(key) in message


def test_processes_writing_one_cache_at_once_keep_every_entry(tmp_path: Path) -> None:
    # Jobs sharing one home directory: without a lock around read-change-write, a
    # process renames its copy over entries the others added meanwhile (54 of 160 kept).
    path, workers, count = tmp_path / "budgets.json", 4, 40
    context = multiprocessing.get_context("spawn")
    start = context.Barrier(workers)
    processes = [
        context.Process(target=write_budgets, args=(str(path), w, count, start)) for w in range(workers)
    ]
    for process in processes:
        process.start()
    for process in processes:
        process.join(timeout=300)
        if process.is_alive():
            process.kill()
    assert [p.exitcode for p in processes] == [0] * workers
    data = json.loads(path.read_text())
    assert len(data) == workers * count
    assert all(
        BudgetCache(path).get(BudgetKey(f"model-{w}-{i}", "cpu:test", 2**30, "float32", 1))
        for w in range(workers)
        for i in range(count)
    )
    assert not list(tmp_path.glob("*.tmp"))
