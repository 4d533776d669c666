"""The ``torchrun`` fixture fails a run that hangs, with its stderr, and leaves no worker behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.conftest import Torchrun

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    return stat.exists() and stat.read_text().split()[2] != "Z"


def test_a_hung_run_fails_and_its_workers_are_gone(torchrun: Torchrun, tmp_path: Path) -> None:
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"hung \(no result in 8 s\).*about to hang"):
        torchrun(SCRIPTS / "hang.py", tmp_path, timeout=8)
    assert time.monotonic() - start < 45  # not the scripts' 600 s sleep
    pids = [int(path.read_text()) for path in tmp_path.glob("pid*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 10
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(map(alive, pids)), "a worker of the hung run is still running"
