"""tokenbatch.integrations.accelerate: gathering uneven batches, the progress bar, the shutdown, the cost.

The gathering and the shutdown run under two real processes (accelerate launch, gloo on CPU);
the rest on one process.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.integrations.accelerate import finish, gather_samples, progress, token_cost
from tokenbatch.probe import MemoryModel
from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "accelerate_gather.py"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def two_ranks(accelerate_launch: Any, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """What each of two real processes gathered, by rank."""
    out = tmp_path_factory.mktemp("gather")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [
        *accelerate_launch(port=str(free_port())),
        str(SCRIPT),
        str(out),
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    assert "DDP model is still referenced" not in done.stderr  # finish() found nothing left behind
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]


@pytest.mark.slow
def test_uneven_token_budget_batches_score_every_example_once(two_ranks: list[dict[str, Any]]) -> None:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from accelerate_gather import LENGTHS, SETTINGS
    finally:
        sys.path.pop(0)
    plan = list(TokenBudgetBatchSampler(LENGTHS, **SETTINGS, num_replicas=2))  # step s: rank 0, rank 1
    sizes = [report["budget"]["sizes"] for report in two_ranks]
    assert sizes == [[len(b) for b in plan[0::2]], [len(b) for b in plan[1::2]]]
    assert sum(a != b for a, b in zip(*sizes, strict=True)) >= len(sizes[0]) // 2  # mostly uneven
    expected = [i for step in range(0, len(plan), 2) for i in plan[step] + plan[step + 1]]
    for report in two_ranks:
        assert report["world"] == 2
        ids = report["budget"]["ids"]
        assert ids == expected  # each step: rank 0's rows, then rank 1's, no padding left
        assert sorted(ids) == list(range(len(LENGTHS)))  # every example exactly once
        assert report["budget"]["rows"] == [[10.0 * i, 10.0 * i + 1, 10.0 * i + 2] for i in ids]


@pytest.mark.slow
def test_direct_calls_empty_ranks_and_nested_data(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        assert report["direct"] == [0, 1, 100, 101, 102]
        assert report["empty"] == [0, 1, 2]
        assert report["nested"] == {"a": [0, 1, 100, 101, 102], "b": [0.0, 0.5, 50.0, 50.5, 51.0]}


@pytest.mark.slow
def test_fixed_size_loader_drops_accelerates_repeats(two_ranks: list[dict[str, Any]]) -> None:
    for report in two_ranks:
        assert report["fixed"] == list(range(9))


@pytest.mark.slow
def test_a_mismatch_raises_on_every_rank_and_nothing_hangs(two_ranks: list[dict[str, Any]]) -> None:
    for rank, report in enumerate(two_ranks):
        errors = report["errors"]
        assert errors["width"].startswith("ValueError: data's dimensions after the first should agree")
        assert errors["type"].startswith("TypeError" if rank == 1 else "ValueError")
        assert "process(es) [1] passed something else" in errors["type"]
        assert errors["rows"].startswith("ValueError") and "process(es) [1]" in errors["rows"]
        assert report["after_errors"] == [0, 1]
        assert report["ddp"] == "DistributedDataParallel"


# -- one process -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def accelerator() -> Any:
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def test_one_process_gathers_what_it_was_given(accelerator: Any) -> None:
    ids, rows = gather_samples(accelerator, (torch.tensor([7, 3]), torch.ones(2, 4)))
    assert ids.tolist() == [7, 3] and rows.shape == (2, 4)
    assert gather_samples(accelerator, {"x": torch.arange(3)})["x"].tolist() == [0, 1, 2]


@pytest.mark.parametrize(
    "data, error, message",
    [
        ("text", TypeError, r"process\(es\) \[0\] passed something else: an object of type str"),
        (torch.tensor(3), ValueError, r"shapes \[\(\)\]"),
        ((torch.zeros(2), torch.zeros(3)), ValueError, r"shapes \[\(2,\), \(3,\)\]"),
        ((), ValueError, r"shapes \[\]"),
    ],
)
def test_what_is_not_a_batch_of_tensors_is_refused(
    accelerator: Any, data: Any, error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=r"data should be a tensor, .*" + message):
        gather_samples(accelerator, data)


def test_progress_follows_a_replan(monkeypatch: pytest.MonkeyPatch) -> None:
    bars: list[Any] = []

    class Bar:  # records what tokenbatch asks of tqdm
        def __init__(self, total: int, desc: str | None, disable: bool) -> None:
            self.total, self.n, self.desc, self.disable, self.postfix, self.closed = (
                total,
                0,
                desc,
                disable,
                {},
                False,
            )
            bars.append(self)

        def set_postfix(self, **values: Any) -> None:
            self.postfix = values

        def close(self) -> None:
            self.closed = True

    import tqdm.auto

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
    model = torch.nn.Linear(4, 1)
    fallback = OOMFallback(sampler, model, mode="halve", grow=False)  # one re-plan, not the climb back
    planned = sampler.plan.num_steps
    seen = []
    with inject_oom(model, max_tokens=8, times=1):  # the first step "runs out of memory": re-planned
        for batch in progress(fallback, sampler, desc="epoch 1", postfix=lambda: {"seen": len(seen)}):
            seen.append(batch)
            fallback.backward(torch.ones(len(batch), 4), lambda x: model(x).square().mean())
    (bar,) = bars
    assert (bar.desc, bar.disable, bar.closed) == ("epoch 1", False, True)
    assert sampler.plan.num_steps > planned  # half the budget: more steps
    assert bar.total == sampler.plan.num_steps and bar.n == fallback.steps_done == sampler.plan.num_steps
    assert (
        bar.postfix == {"budget": f"{fallback.max_tokens:g}", "seen": len(seen)} and fallback.max_tokens == 8
    )
    assert sorted(i for batch in seen[1:] for i in batch) == list(range(12))  # the failed step's again


def test_progress_closes_the_bar_when_the_loop_stops_early(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[bool] = []
    import tqdm.auto

    class Bar:
        def __init__(self, **options: Any) -> None:
            self.total, self.n = options["total"], 0

        def set_postfix(self, **values: Any) -> None:
            pass

        def close(self) -> None:
            closed.append(True)

    monkeypatch.setattr(tqdm.auto, "tqdm", Bar)
    sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
    steps = progress(OOMFallback(sampler, torch.nn.Linear(4, 1)), sampler)
    next(steps)
    steps.close()  # type: ignore[attr-defined]
    assert closed == [True]


class StubAccelerator:
    """The three calls finish() makes, recorded; ``_models`` as accelerate keeps them."""

    def __init__(self, models: list[torch.nn.Module]) -> None:
        self._models, self.calls = models, []

    def wait_for_everyone(self) -> None:
        self.calls.append("wait")

    def free_memory(self) -> None:
        self.calls.append("free")
        self._models = []

    def end_training(self) -> None:
        self.calls.append("end")


class UnwiredDDP(DistributedDataParallel):
    """Passes for a DDP model without a process group."""

    def __init__(self) -> None:
        torch.nn.Module.__init__(self)


def test_finish_frees_the_models_before_it_ends_training(caplog: pytest.LogCaptureFixture) -> None:
    stub = StubAccelerator([UnwiredDDP()])
    with caplog.at_level(logging.WARNING, logger="tokenbatch.integrations.accelerate"):
        finish(stub)  # type: ignore[arg-type]
    assert stub.calls == ["wait", "free", "end"]
    assert not caplog.records


def test_finish_warns_of_a_ddp_model_still_referenced(caplog: pytest.LogCaptureFixture) -> None:
    model = UnwiredDDP()
    stub = StubAccelerator([model])
    with caplog.at_level(logging.WARNING, logger="tokenbatch.integrations.accelerate"):
        finish(stub)  # type: ignore[arg-type]
    assert stub.calls == ["wait", "free", "end"]
    assert "a DDP model is still referenced" in caplog.text and "pytorch/pytorch#56297" in caplog.text
    del model


@pytest.mark.parametrize(
    "precision, device, dtype",
    [("no", "cpu", torch.float32), ("bf16", "cpu", torch.bfloat16), ("fp16", "cuda", torch.float16)],
)
def test_token_cost_is_from_config_for_the_run_in_token_units(
    precision: str, device: str, dtype: torch.dtype
) -> None:
    from transformers import BertConfig

    config = BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)
    run = SimpleNamespace(mixed_precision=precision, device=torch.device(device))
    cost = token_cost(run, config, task="sequence-classification", pad_to_multiple_of=8)  # type: ignore[arg-type]
    exact = MemoryModel.from_config(
        config, dtype=dtype, device=device, task="sequence-classification"
    ).cost_model()
    assert cost.linear == 1.0 and cost.pad_to_multiple_of == 8
    assert cost.quadratic == pytest.approx(exact.quadratic / exact.linear)
    assert cost.per_sample == pytest.approx(exact.per_sample / exact.linear) and cost.per_sample > 0
    assert cost.cost(3, 50) == pytest.approx(exact.cost(3, 56) / exact.linear)  # 50 padded to 56
