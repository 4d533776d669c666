"""The guard under FSDP2 (docs/restarts.md, FSDP): in place where it can, else a stop for a restart.

Two real jobs of ``tests/scripts/fsdp_restart.py`` under ``torchrun --max-restarts`` (2 CPU
processes, gloo, ``fully_shard``), each through injected out-of-memory errors, and what they
logged: the samples each step trained, the checkpoints, the budget each attempt started from,
and the final model's per-sample markers, whose gradients count how many times the model kept
each sample. The rest runs on one process.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings

from tests.conftest import Torchrun
from tokenbatch import CostModel
from tokenbatch.oom._fsdp import EXIT_CODE
from tokenbatch.oom._split import BatchShape, plan_micro_batches

SCRIPT = Path(__file__).resolve().parent / "scripts" / "fsdp_restart.py"
sys.path.insert(0, str(SCRIPT.parent))
try:
    from fsdp_restart import EPOCHS, LENGTHS, LIMITS, MAX_TOKENS
finally:
    sys.path.pop(0)
# A store of its own for each start (pytorch/pytorch#135712; docs/restarts.md says so).
ENV = {"ACCELERATE_USE_CPU": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
TIMEOUT = 300  # no hang: the whole job, every start of it, or the test fails


def run_job(torchrun: Torchrun, out: Path, mode: str, restarts: int) -> dict[str, Any]:
    """Run the job to its end; what each rank logged, torchrun's stderr and the budgets stored."""
    cache = out / "cache.json"
    env = {**ENV, "TOKENBATCH_CACHE": str(cache)}
    done = torchrun(SCRIPT, out, mode, options=["--max-restarts", str(restarts)], env=env, timeout=TIMEOUT)
    logs = {
        rank: [json.loads(line) for line in (out / f"rank{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    }
    records = [{**r, "rank": rank} for rank, lines in logs.items() for r in lines]
    stored = {"beside the checkpoints": out / "checkpoints" / "budget.json", "in the budget cache": cache}
    return {
        "stderr": done.stderr,
        "records": records,
        "starts": {(r["attempt"], r["rank"]): r for r in records if r["event"] == "start"},
        "steps": [r for r in records if r["event"] == "step"],
        "saved": [r for r in records if r["event"] == "saved"],
        "marker": next(r["marker"] for r in records if r["event"] == "done"),
        "stored": {where: json.loads(path.read_text()) for where, path in stored.items()},
    }


@pytest.fixture(scope="module")
def halve(torchrun: Torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Halve mode, ``--max-restarts 2``: rank 0 out of memory in forward, then rank 1 in backward."""
    return run_job(torchrun, tmp_path_factory.mktemp("fsdp-halve"), "halve", restarts=2)


@pytest.fixture(scope="module")
def split(torchrun: Torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Split mode, ``--max-restarts 1``: one stop, then two errors recovered from in place."""
    return run_job(torchrun, tmp_path_factory.mktemp("fsdp-split"), "split", restarts=1)


def stops(job: dict[str, Any]) -> list[tuple[int, str, float, float]]:
    """Each stop for a restart the failing rank logged: (rank, where, old budget, new budget)."""
    pattern = re.compile(
        r"on rank (\d) \((forward|backward)\), longest sequence \d+ tokens: max_tokens ([\d.]+) -> ([\d.]+) "
        r"\([^)]*\)\. Under FSDP on 2 processes"
    )
    return [(int(r), w, float(a), float(b)) for r, w, a, b in pattern.findall(job["stderr"])]


def saved_before(job: dict[str, Any], attempt: int) -> dict[str, Any]:
    """The last checkpoint an attempt completed (rank 0 logs each, once complete)."""
    return [s for s in job["saved"] if s["attempt"] == attempt][-1]


@pytest.mark.slow
def test_out_of_memory_in_forward_then_in_backward_restarts_the_job_and_it_finishes(
    halve: dict[str, Any],
) -> None:
    assert sorted(halve["starts"]) == [(a, r) for a in range(3) for r in range(2)]  # restarted twice
    # Rank 0 ran out of memory in a forward pass, then (after the restart) rank 1 in a backward pass;
    # each exited with EXIT_CODE.
    assert [(rank, where) for rank, where, *_ in stops(halve)] == [(0, "forward"), (1, "backward")]
    exits = set(re.findall(r"failed \(exitcode: (\d+)\) local_rank: (\d)", halve["stderr"]))
    # torchrun reports the first process of an attempt to end: the rank that stopped (EXIT_CODE), or,
    # in a race with it, its peer, whose collective failed on the closed connection first (exit 1).
    for rank, *_ in stops(halve):
        assert (str(EXIT_CODE), str(rank)) in exits or ("1", str(1 - rank)) in exits, exits
    assert (str(EXIT_CODE), "0") in exits or (str(EXIT_CODE), "1") in exits
    # The other rank ended too, its collective failed by the closed connections, or by torchrun's
    # SIGTERM, whichever came first (benchmarks/fsdp_stop.py times it): the job went on by itself.


@pytest.mark.slow
def test_each_restart_resumes_from_the_last_complete_checkpoint(halve: dict[str, Any]) -> None:
    for attempt in (1, 2):
        checkpoint = saved_before(halve, attempt - 1)
        for rank in (0, 1):
            start = halve["starts"][(attempt, rank)]
            assert start["resumed"] == checkpoint["name"]
            assert (start["epoch"], start["step"]) == (checkpoint["epoch"], checkpoint["step"])
    # The steps trained after that checkpoint were lost with their attempt and trained again.
    lost = [
        s
        for s in halve["steps"]
        if s["attempt"] == 0 and (s["epoch"], s["step"] + 1) > (0, saved_before(halve, 0)["step"])
    ]
    assert lost, "the first stop should come some steps after the last checkpoint"


@pytest.mark.slow
def test_the_budget_is_lowered_across_each_restart_and_stored_beside_the_checkpoints(
    halve: dict[str, Any],
) -> None:
    (_, _, first_old, first_new), (_, _, second_old, second_new) = stops(halve)
    assert first_old == MAX_TOKENS and first_new < LIMITS[0]
    assert second_old == first_new and second_new < LIMITS[1]  # less memory after the restart
    budgets = [halve["starts"][(attempt, rank)]["max_tokens"] for attempt in range(3) for rank in (0, 1)]
    assert budgets == [MAX_TOKENS] * 2 + [first_new] * 2 + [second_new] * 2
    for where, stored in halve["stored"].items():
        (entry,) = stored.values()
        assert entry["max_tokens"] == second_new, where
    # Every step trained under the budget in force, which the re-plans respected.
    for step in halve["steps"]:
        assert len(step["lengths"]) * max(step["lengths"]) <= step["max_tokens"]


@pytest.mark.slow
def test_the_final_model_trained_every_sample_once_per_epoch(halve: dict[str, Any]) -> None:
    # Counted from the gradients: each time a step was kept, each of its samples lowered its marker
    # by exactly 1. Steps lost with a stopped attempt were trained again, and were not kept twice.
    assert np.allclose(halve["marker"], -EPOCHS, atol=1e-5), halve["marker"]
    assert len(halve["marker"]) == len(LENGTHS)


@pytest.mark.slow
def test_auto_takes_the_estimate_for_the_shard_group_on_every_rank(split: dict[str, Any]) -> None:
    from transformers import LlamaConfig

    from tokenbatch.probe import MemoryModel
    from tokenbatch.probe._auto import budget_in_units

    config = LlamaConfig(vocab_size=8000, hidden_size=64, intermediate_size=168, num_hidden_layers=2)
    estimate = MemoryModel.from_config(config, device="cpu", task="sequence-classification", shards=2)
    expected = budget_in_units(estimate, CostModel(), np.array(LENGTHS), 2**30, 0.1)
    autos = [r for r in split["records"] if r["event"] == "auto"]
    assert len(autos) == 2 and {r["source"] for r in autos} == {"estimate"}  # no probe on 2 processes
    assert all(r["max_tokens"] == pytest.approx(expected) for r in autos)
    assert all("[FSDP, 2 shards]" in r["chose"] for r in autos)  # the key names the sharding
    assert "the probe cannot measure a model that FSDP shards over 2 processes" in split["stderr"]


@pytest.mark.slow
def test_split_mode_runs_as_many_passes_on_every_rank_and_trains_every_sample_once(
    split: dict[str, Any],
) -> None:
    assert sorted(split["starts"]) == [(a, r) for a in range(2) for r in range(2)]
    assert [(rank, where) for rank, where, *_ in stops(split)] == [(0, "forward")]
    resumed = split["starts"][(1, 0)]
    passes: dict[tuple[int, int], dict[int, tuple[int, int]]] = {}
    for step in split["steps"]:
        if step["attempt"] == 1:
            rows, width = len(step["lengths"]), max(step["lengths"])  # no padding to read: every row is full
            shape = BatchShape(rows, width, np.full(rows, width), True)
            own = len(plan_micro_batches(shape, CostModel(), step["max_tokens"]))
            passes.setdefault((step["epoch"], step["step"]), {})[step["rank"]] = (step["passes"], own)
    # Every step of the restarted attempt: the same number of passes on both ranks, micro-batches.
    assert all(len(ranks) == 2 and len({p for p, _ in ranks.values()}) == 1 for ranks in passes.values())
    assert resumed["max_tokens"] < MAX_TOKENS and all(p > 1 for r in passes.values() for p, _ in r.values())
    # Where one rank's batch needed fewer than the other's, it ran the agreed number all the same.
    assert any(own < p for ranks in passes.values() for p, own in ranks.values())
    assert np.allclose(split["marker"], -EPOCHS, atol=1e-5), split["marker"]


@pytest.mark.slow
def test_out_of_memory_before_any_collective_of_the_step_is_recovered_in_place(split: dict[str, Any]) -> None:
    # Attempt 1, rank 1: the micro-batch split ran out of memory once (before the step's agreement),
    # and optimizer.step() once. Both ranks recorded the same event and went on: no restart.
    events = {
        r["rank"]: r["events"] for r in split["records"] if r["event"] == "events" and r["attempt"] == 1
    }
    assert events[0] == events[1]
    (event,) = events[0]
    assert (event["ranks"], event["where"], event["mode"]) == ([1], ["forward"], "split")
    assert event["old_max_tokens"] == split["starts"][(1, 0)]["max_tokens"]
    assert "FlakyOptimizer.step() ran out of memory on rank(s) [1]" in split["stderr"]
    assert "trying once more" in split["stderr"]
    after = [
        s["max_tokens"]
        for s in split["steps"]
        if s["attempt"] == 1 and (s["epoch"], s["step"]) > (0, event["step"])
    ]
    assert after and set(after) == {event["new_max_tokens"]}


# -- one process, and what needs no process group ------------------------------------------------


@pytest.mark.slow
def test_on_one_process_fsdp2_recovers_in_place_and_fsdp1_is_refused(
    torchrun: Torchrun, tmp_path: Path
) -> None:
    torchrun(Path(__file__).resolve().parent / "scripts" / "fsdp_one.py", tmp_path, nproc=1, timeout=TIMEOUT)
    report = json.loads((tmp_path / "one.json").read_text())
    assert (report["lockstep"], report["shards"]) == (False, 1)
    # Out of memory in forward, then in backward (under FSDP2's hook), both recovered from in place.
    assert [event["where"] for event in report["events"]] == [["forward"], ["backward"]]
    assert report["trained"] == report["batches"] == report["steps"]
    assert "model should be sharded with FSDP2" in report["fsdp1"]
    assert "switch to fsdp_version=2" in report["fsdp1"]


def test_deepspeed_is_refused_with_the_reason() -> None:
    from accelerate.utils import DistributedType

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler

    class DeepSpeedAccelerator:  # what OOMFallback reads of an accelerator: its distributed type
        distributed_type = DistributedType.DEEPSPEED

    sampler = TokenBudgetBatchSampler([3, 4] * 4, max_tokens=16)
    with pytest.raises(ValueError, match="got a DeepSpeed engine: its backward and step are the engine's"):
        OOMFallback(sampler, torch.nn.Linear(4, 1), accelerator=DeepSpeedAccelerator())


@pytest.mark.parametrize(
    "sharded, message",
    [
        (
            "DeepSpeed",
            "oom_mode should be None under DeepSpeed, but got oom_mode='split': DeepSpeed's engine",
        ),
        ("FSDP", "oom_mode should be None under the Trainer's FSDP, but got oom_mode='split'"),
    ],
)
def test_the_trainer_refuses_its_guard_under_deepspeed_and_fsdp(
    tmp_path: Path, sharded: str, message: str
) -> None:
    from transformers import TrainingArguments

    from tokenbatch.integrations.transformers._step import check_supported

    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=re.escape(message)):
        check_supported(args, "split", sharded=sharded)
    check_supported(args, None, sharded=sharded)  # without the guard the sampler works unchanged


def test_shards_divide_weights_gradients_and_state_and_add_what_fsdp_gathers() -> None:
    from transformers import LlamaConfig

    from tokenbatch.probe import MemoryModel

    config = LlamaConfig(
        vocab_size=8000, hidden_size=64, intermediate_size=168, num_hidden_layers=2, num_attention_heads=4
    )
    whole = MemoryModel.from_config(config, device="cpu", task="causal-lm")
    halves = MemoryModel.from_config(config, device="cpu", task="causal-lm", shards=2)
    assert (halves.linear, halves.quadratic, halves.per_sample) == (whole.linear, whole.quadratic, 0.0)
    gathered = 4 * 8000 * 64  # one fp32 copy of the largest parameter, the embedding (or LM head)
    assert halves.constant == pytest.approx(whole.constant / 2 + gathered)
    grads_state = halves.constant - gathered + (whole.step_peak - whole.constant) / 2  # no temporaries
    assert halves.step_peak >= grads_state
    assert MemoryModel.from_config(config, shards=1) == MemoryModel.from_config(config)
    with pytest.raises(ValueError, match="shards should be"):
        MemoryModel.from_config(config, shards=0)


@pytest.mark.slow
def test_the_sharded_estimate_is_within_15_percent_of_the_measured_peak() -> None:
    """``benchmarks/fsdp_memory.py``'s small Llama on 2 processes: each shape's larger rank."""
    from benchmarks import fsdp_memory
    from tokenbatch.probe import MemoryModel

    estimate = MemoryModel.from_config(fsdp_memory.config("small"), device="cpu", task="causal-lm", shards=2)
    _, shapes = fsdp_memory.measure("small")
    for (batch_size, length), measured in zip(fsdp_memory.SHAPES, shapes, strict=True):
        peak = max(measured["forward_backward"], measured["optimizer_step"])
        assert estimate.predict(batch_size, length) == pytest.approx(peak, rel=0.15), measured["shape"]


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 40), min_size=1, max_size=30),
    budget=st.integers(1, 400),
    at_least=st.integers(1, 40),
)
def test_micro_batches_cut_into_at_least_that_many_still_fit(
    lengths: list[int], budget: int, at_least: int
) -> None:
    shape = BatchShape(len(lengths), max(lengths), np.array(lengths), True)
    fewest = plan_micro_batches(shape, CostModel(), budget)
    groups = plan_micro_batches(shape, CostModel(), budget, at_least=at_least)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))  # each row once
    assert len(groups) == max(len(fewest), min(at_least, len(lengths)))
    for rows in groups:  # within the budget, or a row alone
        assert len(rows) == 1 or len(rows) * max(lengths[i] for i in rows) <= budget
