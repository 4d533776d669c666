from __future__ import annotations

import json
from pathlib import Path

import pytest

from tokenbatch.probe import BudgetCache, BudgetKey, default_path


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


def test_unreadable_cache_names_the_file_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "budgets.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="delete it or point \\$TOKENBATCH_CACHE elsewhere"):
        BudgetCache(path).get(BudgetKey("m", "d", 1, "float32", 1))


def test_bad_budget_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_tokens should be a positive finite number"):
        BudgetCache(tmp_path / "b.json").put(BudgetKey("m", "d", 1, "float32", 1), 0, source="oom")


def test_cache_path_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "x.json"))
    assert default_path() == tmp_path / "x.json"
    assert BudgetCache().path == tmp_path / "x.json"


def test_the_old_module_path_still_imports() -> None:
    import tokenbatch
    from tokenbatch import budget_cache, probe

    for name in ("BudgetCache", "BudgetKey", "default_path", "remember_budget"):
        assert getattr(budget_cache, name) is getattr(probe, name)
    for name in ("BudgetCache", "BudgetKey", "remember_budget"):
        assert getattr(tokenbatch, name) is getattr(probe, name) and name in tokenbatch.__all__
