"""TokenBudgetStream on 2 and 3 real processes (torchrun, gloo): no hang, equal steps, exactly once."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tokenbatch import TokenBudgetStream

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from stream_common import ids, run_readers
from stream_distributed import PACKED, SETTINGS, N, examples

sys.path.pop(0)

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "stream_distributed.py"


def launch(torchrun: Any, world: int, out: Path) -> list[dict[str, Any]]:
    torchrun(SCRIPT, out, nproc=world, timeout=240, env={"ACCELERATE_USE_CPU": "1"})
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(world)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_real_processes_end_together_and_train_each_example_once(
    world: int, tmp_path: Path, torchrun: Any
) -> None:
    reports = launch(torchrun, world, tmp_path)
    assert [r["rank"] for r in reports] == list(range(world))

    # Parts of N examples (+-1 between ranks), two epochs: the very batches the
    # one-process simulation of the same ranks yields, every example once.
    def make(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        return TokenBudgetStream(examples(), **SETTINGS, num_replicas=world, rank=rank, agree=agree)

    for epoch in range(2):
        per_rank = [r["epochs"][epoch] for r in reports]
        assert len({len(batches) for batches in per_rank}) == 1
        assert sorted(i for batches in per_rank for b in batches for i in b) == list(range(N))
    simulated, _ = run_readers(make, world)
    assert [r["epochs"][0] for r in reports] == [ids(lanes[0]) for lanes in simulated]
    assert reports[0]["epochs"][0] != reports[0]["epochs"][1]

    # Shards of very different sizes: the ranks still end at the same step; what the
    # ranks read is trained once or counted; the rest of a longer part is not read.
    uneven = [r["uneven"] for r in reports]
    assert len({len(batches) for batches in uneven}) == 1
    seen = [i for batches in uneven for b in batches for i in b]
    assert len(seen) == len(set(seen))
    counts = [r["uneven_counts"] for r in reports]
    assert sum(c["read"] for c in counts) == len(seen) + sum(c["left_out"] for c in counts)
    assert any(c["exhausted"] for c in counts) and not all(c["exhausted"] for c in counts)

    # A resume after 7 steps on every rank: exactly the uninterrupted epoch.
    assert [r["resumed"] for r in reports] == [r["epochs"][0] for r in reports]

    # Packs: equal steps, every example once, the simulation's packs; a resume yields the rest.
    packed = [r["packed"] for r in reports]
    assert len({len(packs) for packs in packed}) == 1
    assert sorted(i for packs in packed for p in packs for i in p) == list(range(N))

    def make_packed(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        settings = {**SETTINGS, "cost": PACKED}
        return TokenBudgetStream(examples(), **settings, num_replicas=world, rank=rank, agree=agree)

    simulated, _ = run_readers(make_packed, world)
    assert packed == [ids(lanes[0]) for lanes in simulated]
    assert [r["packed_resumed"] for r in reports] == packed

    # Under accelerate (model and optimizer prepared, the stream's DataLoader not): DDP
    # steps interleave with the stream's agreement; a per-rank state file resumes exactly.
    for report in reports:
        assert report["accelerate"]["batches"] == report["accelerate"]["full"] == report["epochs"][0]
    errors = [r["accelerate"]["registered_error"] for r in reports]
    assert errors[0] is None  # the main process loads its own state
    for error in errors[1:]:
        assert "each rank resumes from its own state" in error
