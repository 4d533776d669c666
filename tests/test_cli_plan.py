"""``tokenbatch plan`` on every kind of input, its numbers, and its errors."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tokenbatch import CostModel, OversizeSampleError, TokenBudgetBatchSampler
from tokenbatch.cli import main


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:  # type: ignore[type-arg]
    assert main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)  # type: ignore[no-any-return]


def fail(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as exited:
        main(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


@pytest.fixture
def lengths_file(tmp_path: Path) -> tuple[Path, np.ndarray]:
    lengths = np.clip(np.random.default_rng(1).lognormal(np.log(40), 0.8, 2000).round(), 2, 400).astype(int)
    path = tmp_path / "lengths.txt"
    # A mix of separators: one per line, and several on a line with commas.
    path.write_text(
        "\n".join(str(x) for x in lengths[:1000]) + "\n" + ", ".join(str(x) for x in lengths[1000:])
    )
    return path, lengths


def test_plan_numbers_match_the_sampler(
    capsys: pytest.CaptureFixture[str], lengths_file: tuple[Path, np.ndarray]
) -> None:
    path, lengths = lengths_file
    report = run_json(
        capsys,
        "plan",
        "--lengths",
        str(path),
        "--max-tokens",
        "4096",
        "--attention",
        "256",
        "--num-replicas",
        "2",
        "--seed",
        "3",
        "--epoch",
        "1",
    )
    sampler = TokenBudgetBatchSampler(lengths, 4096, cost=CostModel.attention(256), seed=3, num_replicas=2)
    sampler.set_epoch(1)
    stats = sampler.stats()
    plan = report["plan"]
    assert report["lengths"]["count"] == 2000
    assert plan["batches"] == stats.num_batches and plan["steps"] == stats.num_steps
    assert plan["token_efficiency"] == pytest.approx(stats.padding_efficiency)
    assert plan["efficiency"] == pytest.approx(stats.cost_efficiency)
    assert plan["batch_size"]["max"] == stats.max_batch_size
    assert plan["costliest_batch"]["position"] == 0  # the costliest batch goes first
    assert plan["costliest_batch"]["budget_use"] == pytest.approx(stats.max_budget_use)


def test_compare_against_fixed_batches(
    capsys: pytest.CaptureFixture[str], lengths_file: tuple[Path, np.ndarray]
) -> None:
    path, lengths = lengths_file
    report = run_json(capsys, "plan", "--lengths", str(path), "--max-tokens", "8000", "--compare")
    compared = report["compare"]
    assert compared["fixed_batch_size"] == 8000 // lengths.max()
    for name in ("random_fixed", "length_grouped"):
        assert compared[name]["steps"] == -(-2000 // compared["fixed_batch_size"])
        assert compared[name]["max_budget_use"] <= 1.0
    # The whole point: fewer steps and less padding than random fixed batches at the same memory.
    assert report["plan"]["steps"] < compared["random_fixed"]["steps"]
    assert report["plan"]["token_efficiency"] > compared["random_fixed"]["token_efficiency"]
    text_out = main(["plan", "--lengths", str(path), "--max-tokens", "8000", "--compare"])
    assert text_out == 0
    text = capsys.readouterr().out
    assert "LengthGroupedSampler" in text and "random fixed" in text


def test_plan_tokenizes_a_jsonl_text_column(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, minilm_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    texts = ["i feel happy today", "so sad " * 40, "ok", "what a surprise that was"] * 25
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps({"sentence": t, "label": 1}) for t in texts))
    path = minilm_tokenizer.name_or_path
    report = run_json(
        capsys,
        "plan",
        "--data",
        str(data),
        "--tokenizer",
        path,
        "--text-column",
        "sentence",
        "--max-length",
        "32",
        "--max-tokens",
        "512",
    )
    expected = [len(minilm_tokenizer(t, truncation=True, max_length=32)["input_ids"]) for t in texts]
    assert report["lengths"]["count"] == 100
    assert report["lengths"]["max"] == max(expected) == 32
    assert report["lengths"]["min"] == min(expected)
    error = fail(capsys, "plan", "--data", str(data), "--tokenizer", path, "--max-tokens", "512")
    assert "column='text' is not in the dataset" in error and "'sentence'" in error


def test_plan_reads_a_saved_dataset_and_draws_a_plot(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    import datasets

    ids = [[1] * n for n in (5, 9, 3, 12, 7, 7)]
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"input_ids": ids})}).save_to_disk(
        tmp_path / "ds"
    )
    picture = tmp_path / "plan.png"
    report = run_json(
        capsys, "plan", "--dataset", str(tmp_path / "ds"), "--max-tokens", "24", "--plot", str(picture)
    )
    assert report["lengths"]["count"] == 6 and report["lengths"]["max"] == 12
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "'nope'" in fail(
        capsys, "plan", "--dataset", str(tmp_path / "ds"), "--split", "nope", "--max-tokens", "24"
    )


def test_plan_errors_name_the_problem(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert "no such file" in fail(
        capsys, "plan", "--lengths", str(tmp_path / "missing.txt"), "--max-tokens", "9"
    )
    bad = tmp_path / "bad.txt"
    bad.write_text("5\n7 x\n")
    assert "line 2: 'x' is not an integer" in fail(capsys, "plan", "--lengths", str(bad), "--max-tokens", "9")
    good = tmp_path / "good.txt"
    good.write_text("5 7 300")
    error = fail(capsys, "plan", "--lengths", str(good), "--max-tokens", "100")
    assert "sample 2 (padded length 300)" in error and "raise --max-tokens to at least 300" in error
    # The fix in this command's words; Python callers keep the sampler's oversize='alone'.
    assert "--oversize alone" in error and "--oversize skip" in error and "oversize='" not in error
    with pytest.raises(OversizeSampleError, match="oversize='alone'"):
        TokenBudgetBatchSampler([5, 7, 300], 100)
    unreadable = tmp_path / "broken.jsonl"
    unreadable.write_text('{"text": "a"\nnot json at all\n')
    error = fail(capsys, "plan", "--data", str(unreadable), "--tokenizer", "x", "--max-tokens", "9")
    assert "could not be read as json" in error
    assert "--tokenizer" in fail(capsys, "plan", "--data", str(unreadable), "--max-tokens", "9")


@pytest.mark.timeout(60)
def test_plan_with_a_huge_budget_finishes(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Issue 11 item 6: ``tokenbatch plan --max-tokens 1e30`` hung in the count loop."""
    path = tmp_path / "lengths.txt"
    path.write_text("5 7 300 12 40 41 2")
    report = run_json(capsys, "plan", "--lengths", str(path), "--max-tokens", "1e30", "--compare")
    assert report["plan"]["batches"] == 1 and report["plan"]["batch_size"]["max"] == 7
    assert report["compare"]["fixed_batch_size"] >= 7
    assert report["compare"]["random_fixed"]["steps"] == report["compare"]["length_grouped"]["steps"] == 1


def test_plan_prints_the_samplers_own_stats(
    capsys: pytest.CaptureFixture[str], lengths_file: tuple[Path, np.ndarray]
) -> None:
    """One stats function: ``plan`` reports what ``sampler.stats()`` says, padding multiple included."""
    from tokenbatch.compare import as_row

    path, lengths = lengths_file
    report = run_json(
        capsys,
        "plan",
        "--lengths",
        str(path),
        "--max-tokens",
        "4096",
        "--pad-to-multiple-of",
        "8",
        "--num-replicas",
        "3",
        "--seed",
        "5",
    )
    cost = CostModel(pad_to_multiple_of=8)
    sampler = TokenBudgetBatchSampler(lengths, 4096, cost=cost, seed=5, num_replicas=3)
    stats = sampler.stats()
    plan = report["plan"]
    assert {key: plan[key] for key in as_row(stats)} == as_row(stats)
    padded = sum(len(b) * -(-int(lengths[b].max()) // 8) * 8 for b in sampler)
    assert plan["token_efficiency"] == pytest.approx(lengths.sum() / padded)  # padded as the collator pads
    assert (plan["batches"], plan["skipped"], plan["dropped"]) == (stats.num_batches, 0, 0)


def test_plan_refuses_max_tokens_auto_saying_where_a_number_comes_from(
    capsys: pytest.CaptureFixture[str], lengths_file: tuple[Path, np.ndarray]
) -> None:
    path, _ = lengths_file
    error = fail(capsys, "plan", "--lengths", str(path), "--max-tokens", "auto")
    assert "--max-tokens: auto needs a model and tokenbatch plan runs none" in error
    assert "tokenbatch probe --model NAME --max-length N" in error
    assert "should be a number of cost units, but got 'lots'" in fail(
        capsys, "plan", "--lengths", str(path), "--max-tokens", "lots"
    )
