"""The sampler under two real processes: accelerate's prepare and a plain DDP loop, and resumes."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch.utils.data import DataLoader

from tokenbatch import TokenBudgetBatchSampler

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "sampler_distributed.py"


def launch_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    env.update({"ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    return env


@pytest.mark.slow
def test_two_processes_see_every_sample_once(tmp_path: Path, accelerate_launch: Any) -> None:
    out = tmp_path / "seen.json"
    command = [
        *accelerate_launch(),
        str(SCRIPT),
        str(out),
    ]
    result = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["world"] == 2

    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from sampler_distributed import LENGTHS, SETTINGS
    finally:
        sys.path.pop(0)
    reference = TokenBudgetBatchSampler(LENGTHS, **SETTINGS, num_replicas=2)
    for epoch, ranks in enumerate(report["epochs"]):
        reference.set_epoch(epoch)
        expected = list(reference)
        for mode in ("accelerate", "ddp"):
            per_rank = [rank[mode]["batches"] for rank in ranks]
            assert [rank[mode]["len"] for rank in ranks] == [len(b) for b in per_rank]
            assert len(per_rank[0]) == len(per_rank[1]) == len(expected) // 2
            for rank, batches in enumerate(per_rank):
                assert batches == expected[rank::2]
            indices = sorted(i for batches in per_rank for batch in batches for i in batch)
            assert indices == list(range(len(LENGTHS)))
    first = [b for rank in report["epochs"][0] for b in rank["accelerate"]["batches"]]
    second = [b for rank in report["epochs"][1] for b in rank["accelerate"]["batches"]]
    assert first != second  # shuffled per epoch, on both ranks alike


@pytest.mark.slow
def test_two_processes_resume_checkpoints_of_one_and_three_processes(
    tmp_path: Path, accelerate_launch: Any
) -> None:
    """Every sample once: the steps trained before (1 or 3 processes), then what 2 real ranks get."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from sampler_distributed import LENGTHS, SETTINGS
    finally:
        sys.path.pop(0)
    states, trained = {}, {}
    for before, steps in ((1, 7), (3, 4)):
        sampler = TokenBudgetBatchSampler(LENGTHS, **SETTINGS, num_replicas=before)
        loader = DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler)
        taken = [batch.tolist() for batch in itertools.islice(iter(loader), steps * before)]
        states[before] = sampler.state_dict()  # what a loop without workers saves
        assert states[before]["steps_done"] == steps
        trained[before] = taken
    (tmp_path / "states.json").write_text(json.dumps(states))
    out = tmp_path / "resumed.json"
    command = [
        *accelerate_launch(),
        str(SCRIPT.parent / "sampler_resume.py"),
        str(tmp_path / "states.json"),
        str(out),
    ]
    result = subprocess.run(command, env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["world"] == 2
    for before, ranks in report["resumed"].items():
        steps = states[int(before)]["steps_done"]
        assert [rank["start_step"] for rank in ranks] == [steps, steps]
        for mode in ("accelerate", "ddp"):
            per_rank = [rank[mode]["batches"] for rank in ranks]
            assert [rank[mode]["len"] for rank in ranks] == [len(b) for b in per_rank]
            assert len(per_rank[0]) == len(per_rank[1]) > 0  # each rank the same number of batches
            ids = [i for batches in [trained[int(before)], *per_rank] for batch in batches for i in batch]
            assert sorted(ids) == list(range(len(LENGTHS)))  # every sample exactly once
        assert [rank["accelerate"]["batches"] for rank in ranks] == [rank["ddp"]["batches"] for rank in ranks]


@pytest.mark.slow
def test_guarded_plain_ddp_without_rank_is_refused_on_every_rank(tmp_path: Path, torchrun: Any) -> None:
    """The global plan read as it is on 2 processes would train every sample twice: the guard refuses."""
    script = REPO / "tests" / "scripts" / "unsharded_ddp.py"
    torchrun(script, tmp_path, timeout=120, env={"ACCELERATE_USE_CPU": "1"})
    for rank in range(2):
        errors = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for loop in ("guarded",):  # a loop through OOMFallback.iterate, which is handed the DataLoader
            assert errors[loop]["type"] == "ValueError", (rank, loop)
            message = errors[loop]["message"]
            assert "but got rank=None" in message and "on 2 processes" in message
            assert "every rank would train every sample" in message
