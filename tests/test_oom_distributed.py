"""OOMFallback on 2 real processes (torchrun, gloo, DDP via accelerator.prepare), OOM on rank 1 only.

One launch runs every scenario of tests/scripts/oom_ddp.py; the tests below
check its results. A hang fails the launch by its timeout instead of stalling CI.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "oom_ddp.py"
NUM_SAMPLES, EPOCHS = 96, 2

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, torchrun: Any
) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    out = tmp_path_factory.mktemp("oom_ddp")
    torchrun(SCRIPT, out, timeout=240)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {name: (ranks[0][name], ranks[1][name]) for name in ranks[0]}


def all_trained(run: tuple[dict[str, Any], dict[str, Any]]) -> list[int]:
    return sorted(run[0]["trained"] + run[1]["trained"])


TRAINING = ["split_forward", "split_backward", "halve_forward", "halve_backward", "halve_backward_plain_ddp"]


@pytest.mark.parametrize("name", TRAINING)
def test_oom_on_rank_1_is_survived_in_step_on_both_ranks(runs: dict[str, Any], name: str) -> None:
    zero, one = runs[name]
    assert (zero["injected"], one["injected"]) == (0, 1)
    assert zero["events"] == one["events"] and len(zero["events"]) == 1
    event = zero["events"][0]
    assert list(event["ranks"]) == [1] and list(event["where"]) == [name.split("_")[1]]
    assert event["step"] == 0
    assert zero["max_tokens"] == one["max_tokens"] == event["new_max_tokens"] < 128
    assert zero["sampler_max_tokens"] == one["sampler_max_tokens"]
    assert all_trained(runs[name]) == sorted(list(range(NUM_SAMPLES)) * EPOCHS)  # each once per epoch
    assert torch.equal(zero["params"], one["params"])


@pytest.mark.parametrize("name", ["split_forward", "split_backward"])
def test_split_gives_the_parameters_of_a_run_without_oom(runs: dict[str, Any], name: str) -> None:
    reference = runs["reference"][0]["params"]
    assert runs["reference"][0]["events"] == []
    assert torch.allclose(runs[name][0]["params"], reference, atol=1e-6, rtol=0)
    assert not torch.allclose(runs["halve_forward"][0]["params"], reference, atol=1e-3)


def test_guard_without_oom_trains_exactly_like_plain_ddp(runs: dict[str, Any]) -> None:
    plain, guarded = runs["unguarded"], runs["reference"]
    assert torch.allclose(plain[0]["params"], guarded[0]["params"], atol=1e-7, rtol=0)
    assert plain[0]["losses"] == pytest.approx(guarded[0]["losses"], abs=1e-6)
    assert torch.equal(guarded[0]["params"], guarded[1]["params"])


def test_halve_with_accelerate_and_plain_ddp_agree(runs: dict[str, Any]) -> None:
    # accelerate's BatchSamplerShard over the global plan and rank=r give the same batches.
    assert torch.equal(runs["halve_backward"][0]["params"], runs["halve_backward_plain_ddp"][0]["params"])


def test_other_error_raises_on_every_rank_without_hanging(runs: dict[str, Any]) -> None:
    zero, one = runs["error"]
    assert one["error"] == {"type": "ValueError", "message": "not an OOM: rank 1 at step 2"}
    assert zero["error"]["type"] == "RankFailedError"
    assert "rank 1 raised ValueError: not an OOM" in zero["error"]["message"]
    assert "step 2" in zero["error"]["message"]


def test_a_sample_too_large_stops_every_rank(runs: dict[str, Any]) -> None:
    zero, one = runs["too_large"]
    assert zero["error"] == one["error"] and zero["error"]["type"] == "SampleTooLargeError"
    assert "single sample of" in zero["error"]["message"] and "rank 1" in zero["error"]["message"]
    assert zero["trained"] == one["trained"] == []
