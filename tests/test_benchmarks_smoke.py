"""The benchmark suite runs end to end (``python -m benchmarks --smoke``), and its metrics are right."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks import common, padding  # noqa: E402
from tokenbatch import CostModel, TokenBudgetBatchSampler  # noqa: E402
from tokenbatch.compare import (  # noqa: E402
    as_row,
    fixed_batch_size,
    from_batches,
    measure,
    repetition,
)
from tokenbatch.plan import lower_bound_steps  # noqa: E402

MODULES = ("padding", "planning", "training", "oom_recovery", "probe", "gpu", "streaming")
# A bound against a hang only: the smoke run takes about 5 minutes of CPU time (one core), so a machine
# busy with other work takes several times as long, and this must not fail it (issue 29).
HANG_SECONDS = 1800


def run_smoke_suite(out: Path) -> None:
    """``python -m benchmarks --smoke --out OUT``: each benchmark in the fewest steps that write every field.

    Its own bound, ``HANG_SECONDS``, is far above what the run takes, and says so when it expires:
    a loaded machine only makes this slower, not wrong. On any exit of this function, the run and
    the benchmarks it started are stopped, so that they do not keep the cores busy.
    """
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    command = [sys.executable, "-m", "benchmarks", "--smoke", "--out", str(out)]
    child = subprocess.Popen(
        command,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = child.communicate(timeout=HANG_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
        pytest.fail(
            f"python -m benchmarks --smoke gave no result in {HANG_SECONDS} s, a bound against a hang "
            f"only (the run takes about 5 minutes of CPU time); its output ends: {output[-4000:]}"
        )
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    assert child.returncode == 0, output[-8000:]


@pytest.mark.slow
@pytest.mark.timeout(0)  # not the suite's per-test limit: HANG_SECONDS, far above the run, bounds it
def test_the_suite_runs_and_its_results_are_sane(tmp_path: Path) -> None:
    """One run for every check: a module-scoped fixture would be set up on each xdist worker using it."""
    committed = [REPO / "benchmarks" / "RESULTS.md", *common.RESULTS.glob("*.*")]
    before = {path: path.read_bytes() for path in committed}
    run_smoke_suite(tmp_path)
    assert {path: path.read_bytes() for path in committed} == before, "a smoke run rewrote committed results"
    check_every_benchmark_leaves_results(tmp_path)
    check_padding(json.loads((tmp_path / "padding.json").read_text()))
    check_planning(json.loads((tmp_path / "planning.json").read_text()))
    assert json.loads((tmp_path / "gpu.json").read_text())["skipped"] is (not torch.cuda.is_available())
    check_training(json.loads((tmp_path / "training.json").read_text()))


def check_every_benchmark_leaves_results(out: Path) -> None:
    for name in MODULES:
        data = json.loads((out / f"{name}.json").read_text())
        assert data["benchmark"] == name
        assert (out / f"{name}.md").read_text().startswith("Command: `python -m benchmarks."), name
    page = (out / "RESULTS.md").read_text()
    assert "## Padding and steps" in page and "## Planning speed" in page
    for png in ("padding_efficiency.png", "padding_steps.png", "planning_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in page


def check_padding(data: dict[str, Any]) -> None:
    rows = data["rows"]
    assert {r["method"] for r in rows} >= set(padding.METHODS)
    assert {r["processes"] for r in rows} == {1, 2}
    for row in rows:
        assert 0 < row["efficiency"] <= 1 + 1e-12, row
        assert row["steps_over_lower_bound"] >= 1 - 1e-9, row  # it is a lower bound
        assert 0 <= row["repetition"] <= 1, row
        if row["method"] in ("tokenbatch", "sorted_greedy"):
            assert row["max_budget_use"] <= 1 + 1e-12, row
        if row["method"] == "sorted_greedy":
            assert row["repetition"] == 1.0
    greedy = {
        (r["dataset"], r["cost"], r["budget"]): r["steps"] for r in rows if r["method"] == "sorted_greedy"
    }
    for row in rows:
        if row["method"] == "tokenbatch" and row["processes"] == 1:
            # The sorted greedy pass uses the fewest batches any batching can.
            assert row["steps"] >= greedy[(row["dataset"], row["cost"], row["budget"])]
            random_row = next(
                r
                for r in rows
                if r["method"] == "random_fixed"
                and (r["dataset"], r["cost"], r["budget"], r["processes"])
                == (row["dataset"], row["cost"], row["budget"], 1)
            )
            assert row["steps"] <= random_row["steps"]
    assert [t["target"] for t in data["targets"]] == [
        "emotion, linear, max_tokens=16384",
        "lognormal, quadratic, max_tokens=131072",
    ]


def check_planning(planning: dict[str, Any]) -> None:
    assert [r["n"] for r in planning["rows"]] == [10**4, 10**5, 10**6]
    for row in planning["rows"]:
        for key in ("argsort_s", "first_plan_s", "epoch_plan_s", "first_over_argsort", "epoch_over_argsort"):
            assert row[key] > 0, (key, row)
        assert row["first_plan_peak_bytes_per_sample"] > row["input_bytes_per_sample"]


def check_training(data: dict[str, Any]) -> None:
    settings, arms = data["settings"], data["arms"]
    assert set(arms) == {"seed lr=5e-05", "tokenbatch lr=5e-05"}
    tokens = {e["real_tokens"] for arm in arms.values() for e in arm["epochs"]}
    assert len(tokens) == 1 and tokens.pop() > 0  # both batchings trained the same texts, each once
    for label, arm in arms.items():
        assert arm["world_size"] == settings["processes"] == 2
        assert [e["epoch"] for e in arm["epochs"]] == list(range(1, settings["epochs"] + 1))
        for record in arm["epochs"]:
            assert record["eval_samples"] == settings["eval_limit"], label  # each validation text once
            assert 0 <= record["macro_f1"] <= 1 and record["loss"] > 0 and record["optimizer_steps"] >= 1
    tokenbatch = arms["tokenbatch lr=5e-05"]
    assert tokenbatch["oom_events"] == [] and tokenbatch["crossover"] == settings["crossover"]
    assert tokenbatch["epochs"][-1]["sampler_max_tokens"] == pytest.approx(settings["max_tokens"])
    assert {c["arm"] for c in data["throughput"]["chunks"]} == {"seed", "tokenbatch"}


# -- the metrics, checked against brute force -------------------------------------------


def _random_batching(rng: np.random.Generator, n: int) -> list[list[int]]:
    order = rng.permutation(n).tolist()
    cuts = sorted(rng.choice(np.arange(1, n), size=rng.integers(0, n - 1), replace=False).tolist())
    return [order[a:b] for a, b in itertools.pairwise([0, *cuts, n])]


def test_repetition_matches_pairwise_count() -> None:
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(2, 30))
        first, second = _random_batching(rng, n), _random_batching(rng, n)
        mates_first = {i: set(b) - {i} for b in first for i in b}
        mates_second = {i: set(b) - {i} for b in second for i in b}
        shares = [len(m & mates_second[i]) / len(m) for i, m in mates_first.items() if m]
        expected = float(np.mean(shares)) if shares else 0.0
        assert repetition(from_batches(first), from_batches(second), n) == pytest.approx(expected)


def test_measure_agrees_with_the_sampler_stats() -> None:
    lengths = np.random.default_rng(1).integers(1, 300, 2000)
    cost = CostModel(quadratic=1 / 1024)
    sampler = TokenBudgetBatchSampler(lengths, 8192, cost=cost, seed=3)
    stats = sampler.stats()
    ours = measure((sampler.plan.order, sampler.plan.offsets), lengths, cost, 8192)
    assert ours == stats  # one stats function: the same numbers, to the last bit
    row = as_row(ours)
    assert list(row) == [
        "efficiency",
        "token_efficiency",
        "steps",
        "steps_over_lower_bound",
        "mean_budget_use",
        "max_budget_use",
        "mean_batch_size",
        "step_balance",
    ]
    assert row["efficiency"] == stats.cost_efficiency and row["token_efficiency"] == stats.padding_efficiency
    assert row["steps"] == stats.num_steps
    expected_bound = float(cost.sample_cost(lengths).sum()) / 8192
    assert row["steps_over_lower_bound"] == pytest.approx(stats.num_steps / expected_bound)
    assert lower_bound_steps(lengths, cost, 8192, 2) == pytest.approx(expected_bound / 2)


def _fewest_batches(lengths: list[int], cost: CostModel, budget: float) -> int:
    """Brute force over every set partition."""

    def partitions(items: list[int]) -> list[list[list[int]]]:
        if not items:
            return [[]]
        first, rest = items[0], items[1:]
        result = []
        for smaller in partitions(rest):
            result.append([[first], *smaller])
            for k in range(len(smaller)):
                result.append([*smaller[:k], [first, *smaller[k]], *smaller[k + 1 :]])
        return result

    fits = [p for p in partitions(lengths) if all(cost.cost(len(b), max(b)) <= budget for b in p)]
    return min(len(p) for p in fits)


def test_sorted_greedy_uses_the_fewest_batches() -> None:
    rng = np.random.default_rng(2)
    cost = CostModel(quadratic=1 / 16)
    for _ in range(30):
        lengths = rng.integers(1, 20, int(rng.integers(1, 8)))
        budget = float(cost.sample_cost(int(lengths.max()))) * float(rng.uniform(1, 4))
        _, offsets = padding.sorted_greedy(lengths, cost, budget)
        assert len(offsets) - 1 == _fewest_batches(lengths.tolist(), cost, budget)


def test_fixed_batch_size_is_the_largest_that_fits() -> None:
    lengths = np.array([10, 87, 3])
    size = fixed_batch_size(lengths, CostModel(), 16384)
    assert CostModel().cost(size, 87) <= 16384 < CostModel().cost(size + 1, 87)
    with pytest.raises(ValueError, match="raise max_tokens to at least 87"):
        fixed_batch_size(lengths, CostModel(), 50)


def test_synthetic_fallback_without_data(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "data_dir", lambda: None)
    sets = {d.name: d for d in padding.datasets(quick=True)}
    assert sets["emotion"].source.startswith("SYNTHETIC") and sets["imdb"].source.startswith("SYNTHETIC")
    assert sets["emotion"].lengths.max() <= 87 and sets["imdb"].lengths.max() <= 512


def test_report_shows_a_variant_run_in_its_benchmarks_section(tmp_path: Path) -> None:
    from benchmarks import report

    for name, variant in (("probe", None), ("probe", "small")):
        common.write_results(name, tmp_path, {"rows": []}, f"# {variant or 'main'} run\n\ntext", variant)
    page, _ = report.assemble(tmp_path, tmp_path / "RESULTS.md")
    section = page.split("## Budget probe", 1)[1]
    assert section.index("## main run") < section.index("## small run")  # headings demoted, main first
    assert page.count("python -m benchmarks.probe") >= 4  # both commands: in the header and in each part
