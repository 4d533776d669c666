"""benchmarks/packing.py measures what it says: fixed count, fill, truncation, balance, exactly once."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks import packing  # noqa: E402


def test_the_fixed_count_is_the_largest_whose_worst_batch_fits() -> None:
    lengths = np.array([5, 87, 20, 60, 3])
    assert packing.fixed_count(lengths, 146) == 1  # 87 + 60 = 147: two of the longest do not fit
    assert packing.fixed_count(lengths, 147) == 2
    assert packing.fixed_count(lengths, 10_000) == 5


def test_measure_reads_fill_steps_balance_and_exactly_once() -> None:
    lengths = np.array([4, 4, 2, 6])
    epoch = packing.Epoch(
        [np.array([0, 1]), np.array([2, 3]), np.array([3])],
        [np.array([4, 4]), np.array([2, 6]), np.array([6])],
    )
    row = packing.measure(epoch, lengths, budget=10.0, world=2)
    assert row["fill"] == (8 + 8 + 6) / 3 / 10
    assert row["steps"] == 2 and row["once"] == 0.75  # example 3 twice
    assert row["balance_L"] == 1.0  # step 0: 8 and 8 tokens
    assert row["balance_L2"] == 40 / 36  # step 0: 32 and 40 pairs, mean 36
    padded = packing.Epoch(epoch.batches[:2], epoch.tokens[:2], padded=True)
    assert packing.work(padded)[0].tolist() == [8.0, 12.0]  # rows x longest


def test_trl_bfd_packs_once_and_counts_what_it_truncates() -> None:
    bfd = packing.TrlBfd(np.array([1500, 10, 20, 1000]), max_length=1024)
    assert bfd.truncated == 1500 - 1024
    epoch = bfd.epoch(budget=2048, epoch=0)
    assert sorted(np.concatenate(epoch.batches).tolist()) == [0, 1, 2, 3]
    assert max(int(t.sum()) for t in epoch.tokens) <= 2048
