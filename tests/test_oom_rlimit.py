"""Recovery from the real CPU allocator failing under a lowered RLIMIT_AS (a subprocess)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "oom_rlimit.py"


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="RLIMIT_AS and /proc/self/status are Linux's")
def test_training_recovers_from_the_real_allocator_error(tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        # A fixed mmap threshold: freed activations go back to the system, so the limit bites repeatably.
        "MALLOC_MMAP_THRESHOLD_": "131072",
    }
    done = subprocess.run(
        [sys.executable, str(SCRIPT), str(out)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert result["full_bytes"] > 1.5 * result["half_bytes"] > 0
    assert "DefaultCPUAllocator: can't allocate memory" in result["full_batch_error"]
    for mode in ("split", "halve"):
        run = result[mode]
        assert sorted(run["trained"]) == list(range(run["num_samples"])), mode
        assert len(run["events"]) >= 1 and run["events"][0]["step"] == 0
        assert run["max_tokens"] <= 0.5 * 16 * 512
        errors = run["forward_errors"] + [line for line in result["log"] if line.startswith("rank 0:")]
        assert any("DefaultCPUAllocator" in e for e in errors), errors
        assert all(e.split("|")[1] == "True" for e in run["forward_errors"])  # is_oom saw each one
    for mode in ("split", "halve"):  # growth after the real allocator failure (issue 13)
        run = result[f"{mode}_grow"]
        assert sorted(run["trained"]) == sorted(list(range(run["num_samples"])) * run["epochs"]), mode
        assert run["events"][0]["step"] == 0 and not run["events"][0]["growth"]
        tries = [e for e in run["events"] if e["growth"]]
        grown = run["growth_events"]
        assert grown and len(tries) <= 3, mode  # a larger budget trained after the real failure
        assert all(g["old_max_tokens"] < g["new_max_tokens"] for g in grown)
        # In order, no try (failed or not) at or above a budget that ran out of memory before it.
        marks = [
            ((e["epoch"], e["step"], 0, i), e["growth"], e["old_max_tokens"])
            for i, e in enumerate(run["events"])
        ]
        marks += [((g["epoch"], g["step"], 1, i), True, g["new_max_tokens"]) for i, g in enumerate(grown)]
        failed = float("inf")
        for when, is_try, budget in sorted(marks):
            assert not is_try or budget < failed, (mode, when, budget, failed)
            if when[2] == 0:
                failed = min(failed, budget)
        assert all(e.split("|")[1] == "True" for e in run["forward_errors"])
