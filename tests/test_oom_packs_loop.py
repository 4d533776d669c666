"""The plain accelerate loop on packs under OOMFallback, on 1 and 2 real processes (torchrun, gloo).

``tests/scripts/pack_loop.py`` trains a tiny Llama on packs collated by
``DataCollatorWithFlattening``; what each step trained is read from the
gradients (each example's marker token), not from tokenbatch's counters.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

SCRIPT = Path(__file__).resolve().parent / "scripts" / "pack_loop.py"
sys.path.insert(0, str(SCRIPT.parent))

from pack_loop import NUM_EXAMPLES  # noqa: E402

EVERY = list(range(NUM_EXAMPLES))
OOM = ("split-forward", "split-backward", "halve-forward", "halve-backward")


@pytest.fixture(scope="module", params=[1, 2], ids=["1 process", "2 processes"])
def ranks(
    request: pytest.FixtureRequest, torchrun: Any, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    world = int(request.param)
    out = tmp_path_factory.mktemp(f"packs{world}")
    torchrun(SCRIPT, out, nproc=world, env={"ACCELERATE_USE_CPU": "1"})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


def flat(steps: list[list[int]]) -> list[int]:
    return sorted(i for step in steps for i in step)


@pytest.mark.slow
def test_each_example_trains_exactly_once_per_epoch_in_every_scenario(ranks: list[dict[str, Any]]) -> None:
    assert [r["world"] for r in ranks] == [len(ranks)] * len(ranks)
    for name in ("packed", "padded", *OOM):
        epochs = [e["steps"] for e in ranks[0][name]["epochs"]]
        assert len(epochs) == (1 if name in ("packed", "padded") else 2)
        for steps in epochs:
            assert flat(steps) == EVERY, name
        # The gradients were averaged over the ranks: every rank saw every step's examples.
        assert all([e["steps"] for e in r[name]["epochs"]] == epochs for r in ranks)


@pytest.mark.slow
def test_packed_and_padded_training_of_the_same_examples_have_the_same_losses(
    ranks: list[dict[str, Any]],
) -> None:
    for report in ranks:
        packed, padded = report["packed"]["epochs"][0], report["padded"]["epochs"][0]
        assert packed["steps"] == padded["steps"]
        assert len(packed["losses"]) == len(padded["losses"]) >= 4
        assert max(abs(a - b) for a, b in zip(packed["losses"], padded["losses"], strict=True)) < 1e-5
        assert report["packed"]["checksum"] == pytest.approx(report["padded"]["checksum"], abs=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_mode_keeps_every_pack_and_step_and_its_loss(ranks: list[dict[str, Any]], where: str) -> None:
    assert sum(r[f"split-{where}"]["injected"] for r in ranks) > 0
    for report in ranks:
        run, reference = report[f"split-{where}"], report["packed"]
        assert run["events"]
        assert all(f"({where})" in event and "micro-batches" in event for event in run["events"])
        first = run["epochs"][0]
        assert first["steps"] == reference["epochs"][0]["steps"]  # the plan is kept, pack by pack
        # The micro-batches' losses, weighted by labelled tokens, are the whole pack's.
        diffs = [abs(a - b) for a, b in zip(first["losses"], reference["epochs"][0]["losses"], strict=True)]
        assert max(diffs) < 1e-5
    if len(ranks) == 2 and where == "forward":  # only rank 1 ran out of memory; both ranks recovered
        assert all("on rank 1 " in event for event in ranks[0]["split-forward"]["events"])


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_halve_mode_replans_the_packs_and_drops_no_example(ranks: list[dict[str, Any]], where: str) -> None:
    run = ranks[0][f"halve-{where}"]
    assert sum(r[f"halve-{where}"]["injected"] for r in ranks) > 0 and run["events"]
    assert "re-planned the epoch" in run["events"][0] and f"({where})" in run["events"][0]
    assert len(run["epochs"][0]["steps"]) > len(ranks[0]["packed"]["epochs"][0]["steps"])  # smaller packs
    assert all(r[f"halve-{where}"]["events"] == run["events"] for r in ranks)


@pytest.mark.slow
def test_a_resume_mid_epoch_trains_the_rest_as_the_uninterrupted_run(ranks: list[dict[str, Any]]) -> None:
    for report in ranks:
        resume = report["resume"]
        assert resume["saved_replans"] >= 1  # the checkpoint holds the OOM's re-plan
        whole, first, resumed = resume["whole"], resume["first"], resume["resumed"]
        assert first["steps"] + resumed["steps"] == whole["steps"]
        assert flat(first["steps"] + resumed["steps"]) == EVERY
        losses = first["losses"] + resumed["losses"]
        assert max(abs(a - b) for a, b in zip(losses, whole["losses"], strict=True)) < 1e-6
        assert resume["resumed_events"] == resume["whole_events"]
        assert resume["resumed_checksum"] == pytest.approx(resume["whole_checksum"], abs=1e-6)
