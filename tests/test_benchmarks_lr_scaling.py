"""The learning-rate benchmark's clock and arithmetic: validation points, times to a target, paired ratios."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks.lr_scaling import first_reaching, summarize  # noqa: E402
from benchmarks.validation_points import ValidationPoints, steps_to_validate  # noqa: E402


@given(st.integers(1, 500), st.integers(1, 12))
def test_validation_points_are_spread_over_the_epoch_and_end_it(steps: int, per_epoch: int) -> None:
    points = steps_to_validate(steps, per_epoch)
    assert points[-1] == steps and all(1 <= p <= steps for p in points)
    assert len(points) == min(steps, per_epoch) == len(set(points))
    gaps = [b - a for a, b in zip([0, *points], points, strict=False)]
    assert max(gaps) <= -(-steps // per_epoch)  # no gap longer than an even share, rounded up


def test_validation_time_stays_off_the_training_clock() -> None:
    calls = []

    def validate() -> tuple[float, int]:
        time.sleep(0.2)  # a slow validation: it must not count as training
        calls.append(1)
        return 0.5 + 0.1 * len(calls), 10

    points = ValidationPoints(per_epoch=2, steps_per_epoch=4, validate=validate)
    for epoch in range(2):
        for _ in range(4):
            points.after_step(epoch, tokens=3)
        assert points.end_epoch() == (points.records[-1]["macro_f1"], 10)  # the last step validated
    assert len(calls) == 4  # steps 2 and 4 of each epoch, end_epoch added none
    assert [r["step"] for r in points.records] == [2, 4, 6, 8]
    assert [r["epoch"] for r in points.records] == [0.5, 1.0, 1.5, 2.0]
    assert [r["tokens_trained"] for r in points.records] == [6, 12, 18, 24]
    assert points.records[-1]["train_seconds"] < 0.2 <= points.validation_seconds / 4
    seconds = [r["train_seconds"] for r in points.records]
    assert seconds == sorted(seconds)


def test_an_epoch_that_ends_off_its_points_is_validated_at_its_end() -> None:
    points = ValidationPoints(per_epoch=1, steps_per_epoch=4, validate=lambda: (0.7, 5))
    for _ in range(3):  # a re-planned epoch may end before (or after) the planned last step
        points.after_step(0, tokens=1)
    assert points.records == []
    assert points.end_epoch() == (0.7, 5) and points.records[-1]["step"] == 3


def run(arm: str, seed: int, scores: list[float]) -> dict[str, object]:
    """A run validated every 10 steps (7 training seconds), a quarter epoch apart, scoring ``scores``."""
    evals = [
        {"step": 10 * i, "epoch": i / 4, "train_seconds": 7.0 * i, "macro_f1": f}
        for i, f in enumerate(scores, start=1)
    ]
    return {"arm": arm, "seed": seed, "lr": 1e-4, "evals": evals, "epochs": [{"lr_scale_mean": 2.0}]}


def test_times_to_the_target_and_the_paired_ratio() -> None:
    runs = [
        run("hand-tuned", 0, [0.5, 0.86, 0.9]),
        run("scaled", 0, [0.4, 0.84, 0.851]),
        run("hand-tuned", 1, [0.85, 0.9]),
        run("scaled", 1, [0.6, 0.7, 0.8, 0.86]),
        run("unscaled", 0, [0.2, 0.3]),
    ]
    assert first_reaching(runs[0]["evals"], 0.85)["step"] == 20  # type: ignore[arg-type,index]
    summary = summarize(runs, 0.85)
    assert [r["steps_to_target"] for r in summary["rows"]] == [20, 30, 10, 40, None]
    assert summary["ratios"]["scaled_over_hand_tuned_steps"] == [1.5, 4.0]
    assert summary["ratios"]["median_scaled_over_hand_tuned"] == 2.75
    assert summary["arms"]["hand-tuned"]["median_steps_to_target"] == 15
    assert summary["arms"]["scaled"]["median_train_seconds_to_target"] == (21.0 + 28.0) / 2
    # Between validations: seed 0 scaled crosses 0.85 at 20 + 10 * 0.01 / 0.011 steps, hand-tuned at
    # 10 + 10 * 0.35 / 0.36; seed 1 hand-tuned at its first validation, on the line from (0, 0).
    assert summary["rows"][0]["interpolated_steps"] == pytest.approx(10 + 10 * (0.85 - 0.5) / (0.86 - 0.5))
    assert summary["rows"][2]["interpolated_steps"] == 10.0
    assert summary["rows"][2]["interpolated_seconds"] == 7.0
    between = summary["ratios"]["scaled_over_hand_tuned_interpolated"]
    assert between[0] == pytest.approx((20 + 10 * (0.85 - 0.84) / (0.851 - 0.84)) / (10 + 10 * 0.35 / 0.36))
    unscaled = summary["arms"]["unscaled"]
    assert unscaled["reached"] == 0 and unscaled["median_steps_to_target"] is None  # a miss is no median


def test_runs_without_training_times_are_compared_by_steps_alone() -> None:
    runs = [run("hand-tuned", 0, [0.5, 0.86]), run("scaled", 0, [0.4, 0.9])]
    for result in runs:  # as Trainer's log history gives them: steps, no seconds
        for record in result["evals"]:  # type: ignore[attr-defined]
            del record["train_seconds"]
    summary = summarize(runs, 0.85)
    assert [r["steps_to_target"] for r in summary["rows"]] == [20, 20]
    assert [r["train_seconds_to_target"] for r in summary["rows"]] == [None, None]
    assert [r["interpolated_seconds"] for r in summary["rows"]] == [None, None]
    assert summary["ratios"]["scaled_over_hand_tuned_steps"] == [1.0]
