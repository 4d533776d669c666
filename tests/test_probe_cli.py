"""``tokenbatch probe``: report, JSON, budget cache, argument errors."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import BertConfig

from tokenbatch.cli import main
from tokenbatch.cli._probe import parse_bytes
from tokenbatch.probe import BudgetCache, BudgetKey


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: a tiny model's ops are too small to split, and on a busy machine
    each op's second thread waits for a core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture()
def tiny_config_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    directory = tmp_path / "tiny-bert"
    BertConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        architectures=["BertForSequenceClassification"],
    ).save_pretrained(directory)
    return directory


def test_json_and_write_cache(
    tiny_config_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache_path = tmp_path / "budgets.json"
    status = main(
        [
            "probe",
            "--model",
            str(tiny_config_dir),
            "--max-length",
            "64",
            "--memory-limit",
            "24MiB",
            "--attn-implementation",
            "eager",
            "--json",
            "--write-cache",
            "--cache",
            str(cache_path),
            "--world-size",
            "2",
        ]
    )
    assert status == 0
    payload = json.loads(capsys.readouterr().out)
    assert payload["task"] == "sequence-classification" and payload["method"] == "fit"
    assert payload["memory_limit"] == 24 * 2**20 and payload["max_len"] == 64
    assert payload["cost"]["linear"] == 1.0 and payload["cost"]["quadratic"] > 0
    assert payload["fit"]["quadratic"] > 0
    held_out = [row for row in payload["table"] if row["held_out"]]
    assert held_out and all(abs(row["error"]) < 0.15 for row in held_out)
    key = BudgetKey.for_device(str(tiny_config_dir), device="cpu", dtype="float32", world_size=2)
    entry = BudgetCache(cache_path).get(key)
    assert entry is not None and entry["source"] == "probe"
    assert entry["max_tokens"] == pytest.approx(payload["max_tokens"])
    assert entry["cost"] == {k: payload["cost"][k] for k in ("linear", "quadratic", "per_sample")} | {
        "pad_to_multiple_of": 1
    }
    measured = [row["length"] for row in payload["table"]]
    assert entry["version"] == 2 and entry["lengths"] == [min(measured), 64]  # what it holds for
    assert payload["cache"]["path"] == str(cache_path)


def test_report_with_progress_bar(tiny_config_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status = main(
        [
            "probe",
            "--model",
            str(tiny_config_dir),
            "--max-length",
            "48",
            "--memory-limit",
            "20MiB",
            "--method",
            "search",
            "--task",
            "base",
            "--attn-implementation",
            "sdpa",
            "--pad-to-multiple-of",
            "8",
        ]
    )
    captured = capsys.readouterr()
    assert status == 0
    assert "(base, float32, attention sdpa) on cpu" in captured.out
    assert "suggested: max_tokens=" in captured.out and "pad_to_multiple_of=8" in captured.out
    assert "measured MiB" in captured.out and "search" in captured.out
    assert "tokenbatch probe:" in captured.err and "step" in captured.err  # tqdm's bar


def test_sizes_and_argument_errors(tiny_config_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512 MiB") == 512 * 2**20
    assert parse_bytes("16GB") == 16 * 10**9
    assert parse_bytes("2.5k") == 2500
    for bad in ("lots", "-1GiB", "0"):
        with pytest.raises(argparse.ArgumentTypeError, match="--memory-limit"):
            parse_bytes(bad)
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--model", str(tiny_config_dir), "--max-length", "64", "--memory-limit", "lots"])
    assert exit_info.value.code == 2
    assert "--memory-limit should be a size" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["probe", "--model", str(tiny_config_dir), "--max-length", "4096", "--memory-limit", "1GiB"])
    assert exit_info.value.code == 2
    assert "max_position_embeddings=512" in capsys.readouterr().err
