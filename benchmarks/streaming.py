"""Streaming benchmark: ``TokenBudgetStream`` against the map-style sampler on the same data and budget.

For emotion and IMDB (all-MiniLM-L6-v2 token lengths of the train sets) and
1M lognormal lengths, at buffer sizes 1k, 10k and 100k, it measures:

- padding efficiency and steps / lower bound (:func:`tokenbatch.plan.batch_stats`,
  the numbers ``tokenbatch plan`` prints) of the stream and of
  :class:`tokenbatch.TokenBudgetBatchSampler` (shuffle on), medians over epochs;
- peak memory per sample (``tracemalloc``; numpy reports its buffers to it):
  the sampler's plan of an epoch, and one pass of the stream over examples
  that already exist (what each holds on top of the data);
- the stream's throughput in examples per second on lengths alone (the
  examples are Python ints, ``length=int``), median of repeats; the goal is
  at least 1M examples/s at buffer 10k, so it is never the bottleneck;
- step balance across 2 and 4 ranks (simulated in threads, the ranks' agreement a
  barrier): ``sum of batch costs / (ranks * sum over steps of the costliest)``,
  against the sampler's on the same world size;
- packs (``CostModel(packing="varlen")``, a pack costing its tokens) of emotion
  and IMDB: the budget each pack uses (goal: a mean of at least 0.97 at buffer
  10k) and steps against the sampler's packs. The throughput goal is the padded
  stream's: packs are planned by first fit decreasing, a Python loop per example.

Run: ``python -m benchmarks.streaming [--quick]``.
"""

from __future__ import annotations

import gc
import math
import random
import statistics
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import common
from tokenbatch import CostModel, TokenBudgetBatchSampler, TokenBudgetStream
from tokenbatch.plan import Plan, batch_stats

BUFFERS = (1_000, 10_000, 100_000)
THROUGHPUT_GOAL = 1_000_000  # examples/s at buffer 10k (issue 27; 500k in issue 12)
EFFICIENCY_GAP_GOAL = 0.01  # within 1 point of map-style efficiency at buffer 10k (issue 27; 2 in issue 12)
FILL_GOAL = 0.97  # packs: mean budget use at buffer 10k (issue 26)
WORLDS = (2, 4)


@dataclass
class Dataset:
    name: str
    lengths: np.ndarray
    source: str
    cost_name: str
    cost: CostModel
    budget: float


def _real(name: str, limit: int | None) -> tuple[np.ndarray, str] | None:
    root = common.data_dir()
    if root is None:
        return None
    rows = common.read_jsonl(root / name / "train.jsonl")
    if limit is not None and limit < len(rows):
        rows = random.Random(0).sample(rows, limit)  # IMDB rows are sorted by label
    lengths = common.token_lengths([row["text"] for row in rows], 512)
    subset = "" if limit is None or limit >= len(rows) else f", random subset of {len(rows)}"
    # The stream reads in file order; shuffle once so IMDB's label order does not skew a buffer.
    lengths = lengths[np.random.default_rng(0).permutation(len(lengths))]
    return lengths, f"{name} train set, all-MiniLM-L6-v2 tokens (max 512), shuffled once{subset}"


def _lognormal(n: int, seed: int = 2) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(math.log(300), 1.0, n)), 8, 4096).astype(np.int64)


def datasets(quick: bool, smoke: bool = False) -> list[Dataset]:
    linear, quadratic, packed = CostModel(), CostModel(quadratic=1 / 1024), CostModel(packing="varlen")
    emotion = _real("emotion", None) or (
        np.clip(np.rint(np.random.default_rng(0).lognormal(math.log(20), 0.5, 16000)), 3, 87).astype(
            np.int64
        ),
        "SYNTHETIC emotion-like (no data dir found): lognormal median 20, 3..87",
    )
    imdb = _real("imdb", 2000 if quick else None) or (
        np.clip(np.rint(np.random.default_rng(1).lognormal(math.log(230), 0.75, 25000)), 10, 512).astype(
            np.int64
        ),
        "SYNTHETIC IMDB-like (no data dir found): lognormal median 230, 10..512",
    )
    n = 20_000 if smoke else 200_000 if quick else 1_000_000
    big = (_lognormal(n), f"synthetic: {n} lognormal lengths, median 300, sigma 1, clipped to 8..4096")
    result = [
        Dataset("emotion", *emotion, "linear", linear, 4096),
        Dataset("emotion", *emotion, "linear", linear, 16384),
        Dataset("imdb", *imdb, "linear", linear, 32768),
        Dataset("lognormal", *big, "quadratic", quadratic, 131072),
        Dataset("emotion", *emotion, "packed varlen", packed, 4096),
        Dataset("imdb", *imdb, "packed varlen", packed, 16384),
    ]
    return result[1:] if quick else result


# -- one pass --------------------------------------------------------------------------


def stream_plan(data: Dataset, buffer: int, epoch: int) -> Plan:
    """One epoch of the stream over indices, as a Plan (so batch_stats measures it like the sampler)."""
    lengths = data.lengths.tolist()
    stream = TokenBudgetStream(
        range(len(lengths)), data.budget, cost=data.cost, length=lengths.__getitem__, buffer_size=buffer
    )
    stream.set_epoch(epoch)
    return as_plan([list(batch) for batch in stream], 1)


def as_plan(batches: list[list[int]], world: int) -> Plan:
    sizes = [len(b) for b in batches]
    order = np.fromiter((i for b in batches for i in b), np.int64, sum(sizes))
    return Plan(order, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), world)


def _row(plan: Plan, data: Dataset) -> dict[str, float]:
    stats = batch_stats(plan, data.lengths, data.cost, data.budget)
    return {
        "efficiency": stats.padding_efficiency,
        "steps": float(stats.num_steps),
        "steps_over_lower_bound": stats.steps_over_lower_bound,
        "mean_budget_use": stats.mean_budget_use,
        "max_budget_use": stats.max_budget_use,
        "step_balance": stats.step_balance,
    }


def _medians(rows: list[dict[str, float]]) -> dict[str, float]:
    return {key: float(statistics.median(r[key] for r in rows)) for key in rows[0]}


def throughput(data: Dataset, buffer: int, repeats: int) -> float:
    """Median examples/s of a pass over the lengths themselves (Python ints, ``length=int``)."""
    lengths = data.lengths.tolist()
    rates = []
    for epoch in range(repeats):
        stream = TokenBudgetStream(lengths, data.budget, cost=data.cost, length=int, buffer_size=buffer)
        stream.set_epoch(epoch)
        gc.collect()
        start = time.perf_counter()
        for _ in stream:
            pass
        rates.append(len(lengths) / (time.perf_counter() - start))
    return float(statistics.median(rates))


def peak_bytes(fn: Callable[[], Any]) -> int:
    gc.collect()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def stream_peak(data: Dataset, buffer: int) -> int:
    lengths = data.lengths.tolist()  # the data exists before the pass, as a dataset would

    def one_pass() -> None:
        for _ in TokenBudgetStream(lengths, data.budget, cost=data.cost, length=int, buffer_size=buffer):
            pass

    return peak_bytes(one_pass)


def sampler_peak(data: Dataset) -> int:
    return peak_bytes(lambda: TokenBudgetBatchSampler(data.lengths, data.budget, cost=data.cost).plan)


# -- ranks -------------------------------------------------------------------------------


class Agreement:
    """Element-wise maxima between threads, as the all-reduce between processes."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world, timeout=600)
        self.values: list[list[float]] = [[] for _ in range(world)]

    def for_rank(self, rank: int) -> Callable[[list[float]], list[float]]:
        def agree(values: list[float]) -> list[float]:
            self.values[rank] = values
            self.barrier.wait()
            result = [max(v[i] for v in self.values) for i in range(len(values))]
            self.barrier.wait()
            return result

        return agree


def stream_ranks(
    lengths: Sequence[int], budget: float, cost: CostModel, buffer: int, world: int, epoch: int = 0
) -> Plan:
    """One epoch on ``world`` simulated ranks (threads), step by step as a Plan of ``world`` replicas."""
    lengths = list(lengths)
    agreement = Agreement(world)
    per_rank: list[list[list[int]]] = [[] for _ in range(world)]

    def work(rank: int) -> None:
        stream = TokenBudgetStream(
            range(len(lengths)),
            budget,
            cost=cost,
            length=lengths.__getitem__,
            buffer_size=buffer,
            num_replicas=world,
            rank=rank,
            agree=agreement.for_rank(rank) if world > 1 else None,
        )
        stream.set_epoch(epoch)
        per_rank[rank] = [list(batch) for batch in stream]

    threads = [threading.Thread(target=work, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    steps = {len(batches) for batches in per_rank}
    if len(steps) != 1:
        raise AssertionError(f"ranks yielded different numbers of batches: {[len(b) for b in per_rank]}")
    return as_plan([per_rank[rank][step] for step in range(steps.pop()) for rank in range(world)], world)


# -- running it --------------------------------------------------------------------------


def run_dataset(data: Dataset, buffers: Sequence[int], epochs: int, repeats: int) -> list[dict[str, Any]]:
    sampler = TokenBudgetBatchSampler(data.lengths, data.budget, cost=data.cost, seed=0)
    planned = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        planned.append(_row(sampler.plan, data))
    reference = _medians(planned)
    base = {"dataset": data.name, "cost": data.cost_name, "budget": data.budget}
    n = len(data.lengths)
    rows = [
        {
            **base,
            "method": "map-style",
            "buffer": "all",
            **reference,
            "bytes_per_sample": sampler_peak(data) / n,
        }
    ]
    for buffer in buffers:
        row = _medians([_row(stream_plan(data, buffer, epoch), data) for epoch in range(epochs)])
        row["efficiency_gap"] = reference["efficiency"] - row["efficiency"]
        peak = stream_peak(data, buffer)
        row.update(
            peak_mib=peak / 2**20, bytes_per_sample=peak / n, examples_per_s=throughput(data, buffer, repeats)
        )
        rows.append({**base, "method": "stream", "buffer": buffer, **row})
    return rows


def run_balance(data: Dataset, buffer: int) -> list[dict[str, Any]]:
    rows = []
    for world in WORLDS:
        planned = TokenBudgetBatchSampler(data.lengths, data.budget, cost=data.cost, num_replicas=world).plan
        streamed = stream_ranks(data.lengths.tolist(), data.budget, data.cost, buffer, world)
        for method, plan in (("map-style", planned), ("stream", streamed)):
            stats = batch_stats(plan, data.lengths, data.cost, data.budget)
            rows.append(
                {
                    "dataset": data.name,
                    "cost": data.cost_name,
                    "budget": data.budget,
                    "ranks": world,
                    "method": method,
                    "buffer": buffer if method == "stream" else "all",
                    "steps": stats.num_steps,
                    "step_balance": stats.step_balance,
                    "efficiency": stats.padding_efficiency,
                }
            )
    return rows


def goals(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The goals at buffer 10k: the efficiency gap to map-style, examples/s (and packs' fill)."""
    result = []
    for row in rows:
        if row["method"] == "stream" and row["buffer"] == 10_000 and row["cost"].startswith("packed"):
            result.append(
                {
                    "setting": f"{row['dataset']}, {row['cost']}, max_tokens={row['budget']:g}",
                    "mean_budget_use": row["mean_budget_use"],
                    "fill_met": bool(row["mean_budget_use"] >= FILL_GOAL),
                }
            )
        elif row["method"] == "stream" and row["buffer"] == 10_000:
            result.append(
                {
                    "setting": f"{row['dataset']}, {row['cost']}, max_tokens={row['budget']:g}",
                    "efficiency_gap": row["efficiency_gap"],
                    "gap_met": bool(row["efficiency_gap"] <= EFFICIENCY_GAP_GOAL),
                    "examples_per_s": row["examples_per_s"],
                    "throughput_met": bool(row["examples_per_s"] >= THROUGHPUT_GOAL),
                }
            )
    return result


def markdown(
    sets: list[Dataset], rows: list[dict[str, Any]], balance: list[dict[str, Any]], met: list[Any]
) -> str:
    unique = {d.name: d for d in sets}
    parts = ["## Data\n"]
    parts += [
        f"- **{d.name}**: {d.source}; {len(d.lengths)} samples, median {np.median(d.lengths):g}, "
        f"max {d.lengths.max()}"
        for d in unique.values()
    ]
    parts += ["", "## Efficiency gap and speed at buffer 10k, against their targets\n"]

    goal_rows = []
    for g in (g for g in met if "efficiency_gap" in g):
        gap, rate = f"{g['efficiency_gap']:.4f}", f"{g['examples_per_s']:,.0f}"
        gap_met, rate_met = ("yes" if g[key] else "NO" for key in ("gap_met", "throughput_met"))
        goal_rows.append(
            {
                "setting": g["setting"],
                f"gap to map-style efficiency (need <= {EFFICIENCY_GAP_GOAL:g})": f"{gap} ({gap_met})",
                f"examples/s (need >= {THROUGHPUT_GOAL:,})": f"{rate} ({rate_met})",
            }
        )
    parts.append(common.markdown_table(goal_rows, list(goal_rows[0]) if goal_rows else ["setting"]))
    fills = [
        {
            "setting": g["setting"],
            "mean budget use (need >= 0.97)": f"{g['mean_budget_use']:.4f} "
            f"({'yes' if g['fill_met'] else 'NO'})",
        }
        for g in met
        if "fill_met" in g
    ]
    if fills:
        parts += ["", "## Packs at buffer 10k, against their target\n"]
        parts.append(common.markdown_table(fills, list(fills[0])))
    columns = ["dataset", "cost", "budget", "method", "buffer", "efficiency", "efficiency_gap", "steps"]
    columns += ["steps_over_lower_bound", "mean_budget_use", "bytes_per_sample", "peak_mib", "examples_per_s"]
    parts += [
        "",
        "## Padding, steps, memory and speed (medians)\n",
        common.markdown_table(rows, columns, digits=4),
    ]
    columns = ["dataset", "cost", "budget", "ranks", "method", "buffer", "steps", "step_balance"]
    columns.append("efficiency")
    parts += ["", "## Step balance across ranks\n", common.markdown_table(balance, columns, digits=4)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser("streaming", __doc__.splitlines()[0] if __doc__ else "").parse_args(argv)
    sets = datasets(args.quick, args.smoke)
    buffers = BUFFERS[:2] if args.quick else BUFFERS
    epochs, repeats = (1, 1) if args.quick else (3, 3)
    rows = [row for data in sets for row in run_dataset(data, buffers, epochs, repeats)]
    balance = [row for data in sets if data.budget != 4096 for row in run_balance(data, 10_000)]
    met = goals(rows)
    results = {
        "quick": args.quick,
        "epochs": epochs,
        "repeats": repeats,
        "datasets": {
            d.name: {"source": d.source, "num_samples": len(d.lengths), "median": float(np.median(d.lengths))}
            for d in sets
        },
        "goals": met,
        "rows": rows,
        "balance": balance,
    }
    common.write_results("streaming", args.out, results, markdown(sets, rows, balance, met))
    print(
        common.markdown_table(
            [g for g in met if "gap_met" in g],
            ["setting", "efficiency_gap", "gap_met", "examples_per_s", "throughput_met"],
        )
    )
    fills = [g for g in met if "fill_met" in g]
    print(common.markdown_table(fills, ["setting", "mean_budget_use", "fill_met"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
