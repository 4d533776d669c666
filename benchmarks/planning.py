"""Planning speed: time to plan an epoch of N lengths, against ``numpy.argsort`` on the same array.

For N = 10^4 .. 10^8 lognormal lengths (median 300, clipped to 8..4096) with
the quadratic cost ``CostModel(quadratic=1/1024)`` and ``max_tokens=131072``
(the padding benchmark's long-tailed setting), it times, interleaved so machine load hits
both alike:

- ``first``: ``TokenBudgetBatchSampler(lengths, ...)`` then ``.plan``
  (argument checks, per-sample costs and the first epoch's plan);
- ``epoch``: ``set_epoch(e)`` then ``.plan`` (what every later epoch costs);
- ``argsort``: ``numpy.argsort(lengths)`` (default kind, int64 lengths).

Ratios are taken per repeat, side by side, then the median. Peak memory is
measured separately with ``tracemalloc`` (numpy reports its buffers to it),
as bytes above the input array (an int64 array, which the sampler keeps as
it is), per sample. The goals, at the largest N: planning at most 3x one
argsort, and at most 16 bytes a sample.

Run: ``python -m benchmarks.planning [--quick]``.
"""

from __future__ import annotations

import gc
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from benchmarks import common
from tokenbatch import CostModel, TokenBudgetBatchSampler

COST = CostModel(quadratic=1 / 1024)
BUDGET = 131072
TARGET_RATIO = 3.0  # planning at most 3x numpy.argsort of the same lengths
TARGET_BYTES = 16.0  # and at most 16 bytes a sample, at the largest size measured


def lognormal_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(np.log(300), 1.0, n)), 8, 4096).astype(np.int64)


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def time_one(n: int, repeats: int) -> dict[str, Any]:
    """Median times and side-by-side ratios for ``n`` lengths."""
    lengths = lognormal_lengths(n)
    sampler = TokenBudgetBatchSampler(lengths, BUDGET, cost=COST, seed=0)
    epoch = iter(range(1, 10**9))

    def first() -> None:
        TokenBudgetBatchSampler(lengths, BUDGET, cost=COST, seed=0).plan  # noqa: B018

    def next_epoch() -> None:
        sampler.set_epoch(next(epoch))
        sampler.plan  # noqa: B018

    times: dict[str, list[float]] = {"argsort": [], "first": [], "epoch": []}
    for _ in range(repeats):
        times["argsort"].append(_timed(lambda: np.argsort(lengths)))
        times["first"].append(_timed(first))
        times["epoch"].append(_timed(next_epoch))
    argsort = times["argsort"]
    return {
        "n": n,
        "repeats": repeats,
        "argsort_s": statistics.median(argsort),
        "first_plan_s": statistics.median(times["first"]),
        "epoch_plan_s": statistics.median(times["epoch"]),
        "first_over_argsort": statistics.median(f / a for f, a in zip(times["first"], argsort, strict=True)),
        "epoch_over_argsort": statistics.median(e / a for e, a in zip(times["epoch"], argsort, strict=True)),
        "samples_per_s": n / statistics.median(times["epoch"]),
        "num_batches": sampler.plan.num_batches,
    }


def peak_memory(n: int) -> dict[str, float]:
    """Peak bytes traced while building the sampler and planning, and while argsorting."""
    lengths = lognormal_lengths(n)
    result = {}
    for name, fn in (
        ("argsort", lambda: np.argsort(lengths)),
        ("first_plan", lambda: TokenBudgetBatchSampler(lengths, BUDGET, cost=COST, seed=0).plan),
    ):
        gc.collect()
        tracemalloc.start()
        kept = fn()
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        del kept
        result[f"{name}_peak_bytes_per_sample"] = peak / n
    result["input_bytes_per_sample"] = lengths.itemsize
    return result


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser("planning", __doc__.splitlines()[0] if __doc__ else "").parse_args(argv)
    sizes = [10**4, 10**5, 10**6] if args.quick else [10**4, 10**5, 10**6, 10**7, 10**8]
    rows = []
    for n in sizes:
        repeats = 1 if args.smoke else 3 if args.quick or n >= 10**8 else (5 if n >= 10**7 else 9)
        row = time_one(n, repeats)
        row.update(peak_memory(n))
        rows.append(row)
        print(f"n={n:>9,}: plan {row['epoch_plan_s']:.4f} s, {row['epoch_over_argsort']:.2f}x argsort")
    largest = rows[-1]
    target = {
        "n": largest["n"],
        "max_ratio": TARGET_RATIO,
        "epoch_over_argsort": largest["epoch_over_argsort"],
        "first_over_argsort": largest["first_over_argsort"],
        "met": bool(largest["first_over_argsort"] <= TARGET_RATIO),
        "max_bytes_per_sample": TARGET_BYTES,
        "bytes_per_sample": largest["first_plan_peak_bytes_per_sample"],
        "bytes_met": bool(largest["first_plan_peak_bytes_per_sample"] <= TARGET_BYTES),
    }
    columns = ["n", "repeats", "argsort_s", "first_plan_s", "epoch_plan_s", "first_over_argsort"]
    columns += ["epoch_over_argsort", "first_plan_peak_bytes_per_sample", "argsort_peak_bytes_per_sample"]
    md = (
        f"Lognormal lengths (median 300, 8..4096), CostModel(quadratic=1/1024), max_tokens={BUDGET}; "
        f"medians of interleaved repeats on a shared machine.\n\n"
        f"Goal: planning {largest['n']:,} lengths in at most {TARGET_RATIO:g}x one numpy.argsort: "
        f"first plan {largest['first_over_argsort']:.2f}x, each later epoch "
        f"{largest['epoch_over_argsort']:.2f}x ({'met' if target['met'] else 'NOT met'}); and in at most "
        f"{TARGET_BYTES:g} bytes a sample: {largest['first_plan_peak_bytes_per_sample']:.1f} "
        f"({'met' if target['bytes_met'] else 'NOT met'}).\n\n" + common.markdown_table(rows, columns)
    )
    common.write_results("planning", args.out, {"quick": args.quick, "target": target, "rows": rows}, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
