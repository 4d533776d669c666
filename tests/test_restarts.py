"""Surviving restarts (docs/restarts.md): a worker killed, a checkpoint cut short, a job preempted.

Real processes and real signals: torchrun with ``--max-restarts``, ``SIGKILL`` from inside a worker,
``SIGTERM`` to torchrun itself. ``tests/scripts/restart_run.py`` logs the sample ids each rank
trained in each attempt; the counts below come from those logs. The checkpoint helpers' own
rules are checked on one process.
"""

from __future__ import annotations

import json
import random
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import Torchrun
from tokenbatch.integrations.accelerate import last_checkpoint, save_checkpoint

SCRIPT = Path(__file__).resolve().parent / "scripts" / "restart_run.py"
sys.path.insert(0, str(SCRIPT.parent))
try:
    from restart_run import EVERY, LENGTHS, MAX_TOKENS
finally:
    sys.path.pop(0)
# torchrun shares its store with the workers and keeps it across restarts: a restarted worker can read
# the last attempt's gloo addresses and fail to connect (pytorch/pytorch#135712). docs/restarts.md says so.
ENV = {"ACCELERATE_USE_CPU": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def records(out: Path, run: str) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for path in sorted(out.glob(f"{run}-rank*.jsonl"))
        for line in path.read_text().splitlines()
    ]


def where(record: dict[str, Any]) -> tuple[int, int]:
    return record["epoch"], record["step"]


def counts_per_epoch(steps: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    counts: dict[int, Counter[int]] = {}
    for step in steps:
        counts.setdefault(step["epoch"], Counter()).update(step["ids"])
    return counts


@pytest.fixture(scope="module")
def job(torchrun: Torchrun, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One job through three faults, then resumed on one process; what each rank logged, and the draws.

    Under ``torchrun --max-restarts 2`` on 2 processes: attempt 0 loses a random rank at a random
    step; attempt 1 loses rank 0 in the middle of a checkpoint; attempt 2 is preempted (SIGTERM to
    torchrun after a random number of steps), and torchrun, stopping rather than restarting, exits 1
    (its SignalException) once both workers have exited cleanly. The job is then run again on 1
    process, as a scheduler would requeue it, and finishes.
    """
    out = tmp_path_factory.mktemp("restarts")
    draws = {
        "victim": random.randrange(2),
        "kill_at": random.choice([step for step in range(EVERY + 1, 4 * EVERY) if step % EVERY]),
        "signal_after": random.randrange(1, 6),
    }
    faults = "{victim}:{kill_at}:{signal_after}".format(**draws)
    torchrun(SCRIPT, out, "two", faults, options=["--max-restarts", "2"], env=ENV, returncode=1)
    torchrun(SCRIPT, out, "one", nproc=1, env=ENV)
    two, one = records(out, "two"), records(out, "one")
    return {
        **draws,
        "seen": f"(draws {draws})",
        "logs": two + one,
        "steps": [r for r in two + one if r["event"] == "step"],
        "starts": {(r["attempt"], r["rank"]): r for r in two if r["event"] == "start"},
        "saved": [r for r in two if r["event"] == "saved"],  # by rank 0, once complete
        "one": one,
        "left": sorted(p.name for p in (out / "checkpoints").iterdir()),
    }


@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_last_checkpoint(job: dict[str, Any]) -> None:
    kill_at, seen, starts = job["kill_at"], job["seen"], job["starts"]
    assert sorted(starts) == [(a, r) for a in range(3) for r in range(2)], seen  # restarted by itself
    # Attempt 0: both ranks trained epoch 0 up to the step the victim died in; the last checkpoint
    # before it is at the last multiple of EVERY.
    for rank in (0, 1):
        trained = [where(s) for s in job["steps"] if (s["attempt"], s["rank"], s["run"]) == (0, rank, "two")]
        assert trained == [(0, step) for step in range(kill_at)], seen
    before_kill = [s for s in job["saved"] if s["attempt"] == 0][-1]
    assert where(before_kill) == (0, kill_at // EVERY * EVERY), seen
    for rank in (0, 1):
        start = starts[(1, rank)]
        assert start["resumed"] == before_kill["name"], seen
        assert where(start) == where(before_kill) and start["checksum"] == before_kill["checksum"], seen


@pytest.mark.slow
def test_a_checkpoint_cut_short_is_never_resumed(job: dict[str, Any]) -> None:
    seen, starts = job["seen"], job["starts"]
    # Attempt 1 saved one checkpoint, and rank 0 was killed in the middle of the next one.
    (complete,) = [s for s in job["saved"] if s["attempt"] == 1]
    assert where(complete) == (0, where(starts[(1, 0)])[1] + EVERY), seen
    trained = [where(s) for s in job["steps"] if (s["attempt"], s["rank"], s["run"]) == (1, 0, "two")]
    assert trained[-1] == (0, complete["step"] + EVERY - 1), seen  # the cut save was the next boundary
    # Attempt 2 resumed from the complete one before it: its position and its model, not a mix. (Over
    # one folder, as docs/checkpoints.md saved, it gets the cut save's model with the older position.)
    for rank in (0, 1):
        start = starts[(2, rank)]
        assert start["resumed"] == complete["name"], seen
        assert where(start) == where(complete) and start["checksum"] == complete["checksum"], seen
    # The cut save's folder stayed partial: the model's file written, the guard's state not.
    (partial,) = starts[(2, 0)]["partial"].items()
    assert partial[0] == f".checkpoint_{int(complete['name'].split('_')[1]) + 1}.partial"
    assert "model.safetensors" in partial[1] and "custom_checkpoint_1.pkl" not in partial[1]
    assert len(job["left"]) == 2 and not [name for name in job["left"] if "partial" in name]  # keep=2


@pytest.mark.slow
def test_sigterm_stops_every_rank_at_one_boundary_and_resumes_on_one_process(job: dict[str, Any]) -> None:
    seen, logs = job["seen"], job["logs"]
    stopped = {r["rank"]: r for r in logs if r["event"] == "stopped"}
    assert sorted(stopped) == [0, 1] and {r["attempt"] for r in stopped.values()} == {2}, seen
    assert where(stopped[0]) == where(stopped[1]), seen  # one boundary for both
    assert stopped[1]["heard"] == [] and stopped[0]["heard"], seen  # rank 1 never took the signal
    # Rank 0 took it during the step it signalled after (it waits for it there): the next boundary.
    assert stopped[0]["trained"] == stopped[1]["trained"] == job["signal_after"], seen
    trained = [s for s in job["steps"] if (s["attempt"], s["run"]) == (2, "two")]
    assert len(trained) == 2 * job["signal_after"], seen
    for rank in (0, 1):
        last = [where(s) for s in trained if s["rank"] == rank][-1]
        assert last == (stopped[0]["epoch"], stopped[0]["step"] - 1), seen  # checkpointed right after it
    (saved,) = [r for r in job["saved"] if r["attempt"] == 2 and where(r) == where(stopped[0])]
    (start,) = [r for r in job["one"] if r["event"] == "start"]
    assert (start["resumed"], start["world"]) == (saved["name"], 1), seen
    assert where(start) == where(saved) and start["checksum"] == saved["checksum"], seen
    assert [r["rank"] for r in job["one"] if r["event"] == "done"] == [0]  # and it finished


@pytest.mark.slow
def test_every_sample_trained_once_but_the_steps_after_the_last_checkpoint(job: dict[str, Any]) -> None:
    seen, steps = job["seen"], job["steps"]
    resumed_at = {a: where(job["starts"][(a, 0)]) for a in (1, 2)}
    # Trained again: each killed attempt's steps from the checkpoint the next attempt resumed at to
    # the kill, 2 batches a step (one per rank). The preempted attempt's: none.
    again = [
        s
        for s in steps
        if s["run"] == "two" and s["attempt"] < 2 and where(s) >= resumed_at[s["attempt"] + 1]
    ]
    first, second = resumed_at[1][1], resumed_at[2][1]
    assert sorted({(s["attempt"], *where(s)) for s in again}) == [
        *((0, 0, step) for step in range(first, job["kill_at"])),
        *((1, 0, step) for step in range(second, second + EVERY)),
    ], seen
    assert len(again) == 2 * (job["kill_at"] - first + EVERY), seen
    # Counting per epoch: every sample exactly once, plus once for each time its step was trained again.
    counts, repeats = counts_per_epoch(steps), counts_per_epoch(again)
    assert sorted(counts) == [0, 1], seen
    for epoch, count in counts.items():
        assert count == Counter(range(len(LENGTHS))) + repeats.get(epoch, Counter()), (epoch, seen)


@pytest.mark.slow
def test_the_budget_an_oom_lowered_is_kept_through_every_restart(job: dict[str, Any]) -> None:
    # The OOM of attempt 0 (step 0, before its first checkpoint) lowered the budget; inject_oom stays
    # on in every attempt, so a budget lost would run out of memory again and add an event.
    starts = [r for r in job["logs"] if r["event"] == "start" and (r["attempt"] > 0 or r["run"] == "one")]
    assert len(starts) == 5
    assert len({r["max_tokens"] for r in starts}) == 1 and starts[0]["max_tokens"] < MAX_TOKENS
    assert {r["events"] for r in starts} == {1}
    assert [r["events"] for r in job["one"] if r["event"] == "done"] == [1]


# -- the checkpoint helpers on one process -------------------------------------------------------


@pytest.fixture
def accelerator() -> Any:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(2, 1)
    accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return accelerator


def test_checkpoints_are_numbered_on_and_the_oldest_removed(accelerator: Any, tmp_path: Path) -> None:
    root = tmp_path / "checkpoints"
    assert last_checkpoint(root) is None
    names = [save_checkpoint(accelerator, root, keep=2).name for _ in range(3)]
    assert names == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    assert last_checkpoint(root) == root / "checkpoint_2"
    assert "model.safetensors" in {p.name for p in (root / "checkpoint_2").iterdir()}


def test_a_partial_folder_is_never_the_latest_and_goes_at_the_next_save(
    accelerator: Any, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    save_checkpoint(accelerator, root)
    (root / ".checkpoint_1.partial").mkdir()  # a save that was killed
    (root / ".checkpoint_1.partial" / "model.safetensors").write_bytes(b"half")
    assert last_checkpoint(root) == root / "checkpoint_0"
    assert save_checkpoint(accelerator, root).name == "checkpoint_1"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_0", "checkpoint_1"]
    assert (root / "checkpoint_1" / "model.safetensors").read_bytes() != b"half"


@pytest.mark.parametrize("keep, error", [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_keep_should_be_a_whole_number(accelerator: Any, tmp_path: Path, keep: Any, error: type) -> None:
    with pytest.raises(error, match=rf"keep should be an integer >= 1, but got keep={keep!r}"):
        save_checkpoint(accelerator, tmp_path, keep=keep)


def test_automatic_checkpoint_naming_is_refused(accelerator: Any, tmp_path: Path) -> None:
    accelerator.project_configuration.automatic_checkpoint_naming = True
    try:
        with pytest.raises(ValueError, match="automatic_checkpoint_naming should be False"):
            save_checkpoint(accelerator, tmp_path)
    finally:
        accelerator.project_configuration.automatic_checkpoint_naming = False
    assert not list(tmp_path.iterdir())
