"""benchmarks/gpu.py runs blind: it skips what it cannot measure, with the reason, and always writes a report.

There is no GPU here: these tests run its skip paths, its time cap and its
report writing, and (slow) every section end to end on the CPU with tiny
models and a simulated memory limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
HANG_SECONDS = 1800  # a bound against a hang only: the run takes about 90 s on a quiet 2-core machine
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks import gpu  # noqa: E402


def test_without_cuda_it_exits_0_with_a_report_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu.main(["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["skipped"] is True and "CUDA is not available" in data["reason"]
    assert "Skipped: CUDA is not available" in (tmp_path / "gpu.md").read_text()


def test_a_failing_section_is_skipped_with_its_reason_and_the_next_one_runs() -> None:
    sections = gpu.Sections(60, torch.device("cpu"))

    def broken() -> dict[str, object]:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    assert sections.run("broken", broken, needs_s=0) is None
    assert sections.run("fine", lambda: {"rows": [{"method": "x", "real_tokens_per_s": 1.0}]}, needs_s=0)
    broken_done, fine_done = sections.done
    assert broken_done["status"] == "skipped"
    assert broken_done["reason"] == "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB"
    assert "Traceback" in broken_done["traceback"]
    assert fine_done["status"] == "ok" and fine_done["rows"][0]["method"] == "x"
    page = gpu.markdown("header", sections.done)
    assert "### broken\n\nSkipped: OutOfMemoryError" in page and "| x |" in page


def test_the_time_cap_skips_what_would_not_fit_and_stops_what_runs_over() -> None:
    sections = gpu.Sections(1.0, torch.device("cpu"))
    assert sections.run("too long to start", lambda: {"rows": []}, needs_s=5) is None
    started = time.monotonic()
    assert sections.run("runs over", lambda: time.sleep(30) or {"rows": []}, needs_s=0) is None
    assert time.monotonic() - started < 5  # the alarm stopped it at the cap
    assert [s["reason"] for s in sections.done] == [
        "the 1 s cap: 1 s left, it needs about 5 s",
        "the 1 s cap was reached during it",
    ]


@pytest.mark.slow
@pytest.mark.timeout(0)  # not the suite's per-test limit: 90 s quiet, 5+ min on a busy machine
def test_every_section_runs_or_says_why_on_the_cpu(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUDA_VISIBLE_DEVICES="")
    command = [sys.executable, "-m", "benchmarks.gpu", "--device", "cpu", "--tiny", "--out", str(tmp_path)]
    try:
        done = subprocess.run(
            command, cwd=REPO, env=env, capture_output=True, text=True, timeout=HANG_SECONDS
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"benchmarks.gpu --tiny gave no result in {HANG_SECONDS} s, a bound against a hang only")
    assert done.returncode == 0, done.stderr[-3000:]
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["skipped"] is False and data["tiny"] is True
    by_name = {s["name"].split(",")[0]: s for s in data["sections"]}
    for section in data["sections"]:
        assert section["status"] == "ok" or section["reason"], section["name"]
    seed = by_name["seed: find_executable_batch_size from 256"]
    assert seed["status"] == "ok", seed.get("reason")
    row = seed["rows"][0]  # 256 rows of 16 tokens against a simulated 1024-token limit: 0.9x per restart
    assert row["settled_batch_size"] * 16 <= 1024 < row["tried"][-2] * 16 and row["restarts"] > 5
    ddp = by_name["DDP: guard vs plain DDP"]
    assert ddp["reason"] == "RuntimeError: needs 2 or more CUDA devices, found 0"
    trained = [s for s in data["sections"] if s["name"].startswith("precision") and s["status"] == "ok"]
    assert trained and all(s["rows"][0]["real_tokens_per_s"] > 0 for s in trained)
    assert all(s["rows"][0]["events"] for s in trained if "recovery_s" in s["rows"][0])
    packing = by_name["packing: padded"]
    assert packing["status"] == "ok", packing.get("reason")
    methods = {r["method"]: r for r in packing["rows"]}
    assert set(methods) == {"trl_padding_free", "tokenbatch_padded", "tokenbatch_packed"}
    assert all(r["real_tokens_per_s"] > 0 and r["attention"] == "sdpa" for r in methods.values())
    page = (tmp_path / "gpu.md").read_text()
    assert page.startswith("Command: `python -m benchmarks.gpu") and "TINY models" in page
