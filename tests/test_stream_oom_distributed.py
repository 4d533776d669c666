"""OOMFallback over a TokenBudgetStream on 2 real processes (gloo), out of memory on one rank only."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "stream_oom_ddp.py"


@pytest.mark.slow
def test_one_rank_out_of_memory_both_ranks_rebudget_and_train_each_example_once(
    tmp_path: Path, torchrun: Any
) -> None:
    torchrun(SCRIPT, tmp_path, timeout=300)
    reports = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    from stream_oom_ddp import ROWS

    sys.path.pop(0)
    for mode in ("halve", "split"):
        runs = [report[mode] for report in reports]
        # Equal steps on both ranks, the same events and budget (rank 1 alone ran out of memory).
        assert len(runs[0]["trained"]) == len(runs[1]["trained"])
        assert runs[0]["events"] == runs[1]["events"] and runs[0]["events"]
        assert runs[0]["budget"] == runs[1]["budget"] <= 150
        assert runs[0]["params"] == pytest.approx(runs[1]["params"], abs=1e-9)  # gradients averaged
        # Everything read is trained exactly once (nothing left out with these buffers).
        seen = [i for run in runs for step in run["trained"] for i in step]
        assert sorted(seen) == list(range(ROWS)) and sum(run["read"] for run in runs) == ROWS
        assert all(run["left_out"] == 0 for run in runs)
        first, new = runs[0]["events"][0]
        if mode == "halve":  # both streams form their next batches under the new budget
            assert all(run["stream_budget"] == run["budget"] for run in runs)
            assert all(max(run["costs"][first + 1 :]) <= new for run in runs)
        else:
            assert all(run["stream_budget"] == 384 for run in runs)
