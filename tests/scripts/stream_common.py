"""Helpers for the TokenBudgetStream tests: examples that know their index, and ranks simulated in threads.

Each simulated rank is a thread iterating its own stream (explicit ``rank`` and
``num_replicas``); their agreement is a barrier that returns the element-wise
maximum, as the all-reduce does between processes. A failing rank aborts the
barrier, so a test fails instead of waiting forever.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from tokenbatch import CostModel, TokenBudgetStream


def make_examples(lengths: Sequence[int]) -> list[dict[str, int]]:
    """One example per length, holding its index and its length (an integer column)."""
    return [{"i": i, "length": int(n)} for i, n in enumerate(lengths)]


def long_tailed(n: int, seed: int = 0, median: float = 40, top: int = 300) -> np.ndarray:
    values = np.random.default_rng(seed).lognormal(np.log(median), 0.9, n)
    return np.clip(np.round(values), 2, top).astype(np.int64)


def ids(batches: Sequence[Sequence[dict[str, int]]]) -> list[list[int]]:
    return [[example["i"] for example in batch] for batch in batches]


def batch_cost(batch: Sequence[dict[str, int]], cost: CostModel) -> float:
    return cost.cost(len(batch), max(example["length"] for example in batch))


class Agreement:
    """An all-reduce of maxima between ``world`` threads."""

    def __init__(self, world: int, timeout: float = 30.0) -> None:
        self.barrier = threading.Barrier(world, timeout=timeout)
        self.values: list[list[float]] = [[] for _ in range(world)]
        self.calls = [0] * world

    def for_rank(self, rank: int) -> Callable[[list[float]], list[float]]:
        def agree(values: list[float]) -> list[float]:
            self.values[rank] = list(values)
            self.calls[rank] += 1
            self.barrier.wait()
            result = [max(v[i] for v in self.values) for i in range(len(values))]
            self.barrier.wait()  # nobody overwrites values before everyone has read them
            return result

        return agree


_THREAD = threading.local()


def fake_worker_info() -> Any:
    """Stands in for ``torch.utils.data.get_worker_info`` in a simulated DataLoader worker (a thread)."""
    return getattr(_THREAD, "worker_info", None)


def run_readers(
    make: Callable[[int, int, Callable[[list[float]], list[float]]], TokenBudgetStream],
    world: int,
    workers: int = 0,
    *,
    take: int | None = None,
) -> tuple[list[list[list[Any]]], list[list[TokenBudgetStream]]]:
    """Iterate ``make(rank, worker, agree)`` for every rank and simulated worker, each on its own thread.

    Returns ``batches[rank][worker]`` (the first ``take`` of each) and the
    streams. Simulated workers need ``get_worker_info`` patched to
    :func:`fake_worker_info`; worker ``w`` of every rank agrees with worker ``w``
    of the others, as DataLoader workers would have to.
    """
    lanes = max(workers, 1)
    agreements = [Agreement(world) for _ in range(lanes)]
    streams = [
        [make(rank, lane, agreements[lane].for_rank(rank)) for lane in range(lanes)] for rank in range(world)
    ]
    results: list[list[list[Any]]] = [[[] for _ in range(lanes)] for _ in range(world)]
    errors: list[BaseException] = []

    def work(rank: int, lane: int) -> None:
        _THREAD.worker_info = SimpleNamespace(id=lane, num_workers=workers) if workers else None
        try:
            batches = iter(streams[rank][lane])
            results[rank][lane] = list(batches if take is None else itertools.islice(batches, take))
        except BaseException as error:
            errors.append(error)
            agreements[lane].barrier.abort()

    threads = [threading.Thread(target=work, args=(r, w)) for r in range(world) for w in range(lanes)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return results, streams
