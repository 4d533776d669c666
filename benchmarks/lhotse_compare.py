"""Against lhotse: tokenbatch beside lhotse's ``DynamicBucketingSampler``, on the same data and cost.

lhotse (https://github.com/lhotse-speech/lhotse) batches by a duration budget;
with ``quadratic_duration=c`` a batch of ``B`` cuts whose longest lasts ``L``
costs ``B * L * (1 + L / c)`` (its ``TimeConstraint``), which is
``CostModel.attention(crossover=c)``. So each length here becomes a
``MonoCut`` of that many seconds, ``max_duration`` is the budget, and both
libraries are measured by the one :func:`tokenbatch.plan.batch_stats`.

For emotion and IMDB (all-MiniLM-L6-v2 token lengths of the train sets,
shuffled once: IMDB's rows are sorted by label) and lognormal lengths, it runs:

- map-style: :class:`tokenbatch.TokenBudgetBatchSampler` (shuffle on)
  against ``DynamicBucketingSampler`` holding the whole data set
  (``buffer_size`` and ``num_cuts_for_bins_estimate`` = N: its best case);
- streaming at buffer 10k: :class:`tokenbatch.TokenBudgetStream` against
  ``DynamicBucketingSampler(buffer_size=10_000)``, both reading the cuts in
  the same order;

each on 1 and 2 ranks (tokenbatch's stream ranks in threads, agreeing
through a barrier; lhotse's ranks are two samplers, ``world_size=2``,
``rank=0`` and ``1``, which is how lhotse shards), lhotse with its defaults
otherwise (10 buckets, ``shuffle=True``, ``sync_buckets=True``, seed 0). Measured:

- steps / lower bound, padding efficiency (real / padded tokens), the
  costliest batch over the budget (lhotse adds a cut, then checks whether
  one more of the longest would overflow, so a long cut after short ones
  lands in a batch past the budget), the share of batches over it, step
  balance on 2 ranks, and how many examples an epoch yields exactly once;
- on 1 rank: map-style, the time of an epoch (``set_epoch`` and every
  batch); streaming, examples per second over the ``MonoCut`` objects
  (tokenbatch reads each length with ``length=lambda cut: int(cut.duration)``),
  and the peak memory of one pass (``tracemalloc``) on top of the cuts.

Batch statistics are from epoch 0; times are medians of repeats (epochs 1,
2, ...), the two libraries interleaved, ratios taken per repeat (a repeat of
tokenbatch's map-style epoch, milliseconds, is the median of 5 in a row).

Needs lhotse: ``pip install 'lhotse>=1.33' urllib3`` (both in the
``benchmarks`` extra; lhotse 1.33 imports urllib3 without declaring it).

Run: ``python -m benchmarks.lhotse_compare [--quick]``.
"""

from __future__ import annotations

import gc
import math
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import common
from benchmarks.streaming import as_plan, peak_bytes, stream_ranks
from tokenbatch import CostModel, TokenBudgetBatchSampler, TokenBudgetStream
from tokenbatch.plan import Plan, batch_stats

CROSSOVER = 1024  # lhotse's quadratic_duration
COST = CostModel.attention(crossover=CROSSOVER)
BUFFER = 10_000
METHODS = ("tokenbatch", "lhotse")
INSTALL = (
    "benchmarks.lhotse_compare needs lhotse: pip install 'lhotse>=1.33' urllib3 "
    "(or pip install -e '.[benchmarks]'); lhotse 1.33 imports urllib3 without declaring it"
)


def lhotse_missing() -> str | None:
    """What to install, if lhotse cannot be imported; else None."""
    try:
        import lhotse  # noqa: F401
    except ImportError as error:
        return f"{INSTALL} (import failed: {type(error).__name__}: {error})"
    return None


@dataclass
class Dataset:
    name: str
    lengths: np.ndarray
    source: str
    budget: float


def _real(name: str, limit: int | None) -> tuple[np.ndarray, str] | None:
    root = common.data_dir()
    if root is None:
        return None
    rows = common.read_jsonl(root / name / "train.jsonl")
    order = np.random.default_rng(0).permutation(len(rows))[:limit]  # IMDB rows are sorted by label
    lengths = common.token_lengths([rows[i]["text"] for i in order], 512)
    subset = "" if len(order) == len(rows) else f", random subset of {len(order)}"
    return lengths, f"{name} train set, all-MiniLM-L6-v2 tokens (max 512), shuffled once{subset}"


def _lognormal(n: int, median: float, sigma: float, low: int, high: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), low, high).astype(np.int64)


def datasets(quick: bool) -> list[Dataset]:
    """emotion, IMDB (real where ``../shared/data`` has them, else synthetic stand-ins) and lognormal."""
    emotion = _real("emotion", None) or (
        _lognormal(16000, 20, 0.5, 3, 87, 0),
        "SYNTHETIC emotion-like (no data dir found): lognormal median 20, 3..87",
    )
    imdb = _real("imdb", 5000 if quick else None) or (
        _lognormal(5000 if quick else 25000, 230, 0.75, 10, 512, 1),
        "SYNTHETIC IMDB-like (no data dir found): lognormal median 230, 10..512",
    )
    n = 30_000 if quick else 200_000
    big = (
        _lognormal(n, 300, 1.0, 8, 4096, 2),
        f"synthetic: {n} lognormal lengths, median 300, sigma 1, clipped to 8..4096",
    )
    return [
        Dataset("emotion", *emotion, 16384),
        Dataset("imdb", *imdb, 65536),
        Dataset("lognormal", *big, 131072),
    ]


def make_cuts(lengths: np.ndarray) -> list[Any]:
    """One ``MonoCut`` per length, lasting that many seconds; its id is its index."""
    from lhotse import MonoCut

    return [
        MonoCut(id=str(i), start=0.0, duration=float(n), channel=0) for i, n in enumerate(lengths.tolist())
    ]


def _cut_length(cut: Any) -> int:
    return int(cut.duration)


# -- the batchings: each returns one epoch's batches of indices, in yield order --------------


def lhotse_sampler(cuts: Sequence[Any], budget: float, buffer: int, world: int = 1, rank: int = 0) -> Any:
    """lhotse's sampler over ``cuts`` on our cost (``buffer`` = len(cuts) estimates bins from all)."""
    from lhotse.dataset import DynamicBucketingSampler

    return DynamicBucketingSampler(
        cuts,
        max_duration=budget,
        quadratic_duration=CROSSOVER,
        shuffle=True,
        buffer_size=buffer,
        num_cuts_for_bins_estimate=min(max(buffer, 10_000), len(cuts)),
        world_size=world,
        rank=rank,
        seed=0,
    )


def lhotse_batches(cuts: Sequence[Any], budget: float, buffer: int, world: int, epoch: int = 0) -> Plan:
    """One epoch of lhotse's ``world`` ranks, laid out step by step (rank 0, rank 1, ...) as a Plan."""
    per_rank = []
    for rank in range(world):
        sampler = lhotse_sampler(cuts, budget, buffer, world, rank)
        sampler.set_epoch(epoch)
        # At the end of an epoch on several ranks lhotse may repeat cuts (ids "<id>_dup<k>") to give
        # every rank a batch: counted as repeated.
        per_rank.append([[int(cut.id.split("_")[0]) for cut in batch] for batch in sampler])
    steps = {len(b) for b in per_rank}
    if len(steps) != 1:
        raise AssertionError(f"lhotse's ranks yielded different numbers of batches: {sorted(steps)}")
    return as_plan([per_rank[r][s] for s in range(steps.pop()) for r in range(world)], world)


def tokenbatch_map(data: Dataset, world: int, epoch: int = 0) -> Plan:
    sampler = TokenBudgetBatchSampler(data.lengths, data.budget, cost=COST, seed=0, num_replicas=world)
    sampler.set_epoch(epoch)
    return sampler.plan


def tokenbatch_stream(data: Dataset, buffer: int, world: int, epoch: int = 0) -> Plan:
    """One epoch of the stream on ``world`` ranks (threads), over indices, laid out step by step."""
    return stream_ranks(data.lengths.tolist(), data.budget, COST, buffer, world, epoch)


def measure(plan: Plan, data: Dataset) -> dict[str, Any]:
    """The batch figures of one epoch's plan (on ``plan.num_replicas`` ranks)."""
    stats = batch_stats(plan, data.lengths, COST, data.budget)
    costs = plan.batch_costs(data.lengths, COST)
    counts = np.bincount(plan.order, minlength=len(data.lengths))
    return {
        "steps": stats.num_steps,
        "steps_over_lower_bound": stats.steps_over_lower_bound,
        "efficiency": stats.padding_efficiency,
        "cost_efficiency": stats.cost_efficiency,
        "max_budget_use": stats.max_budget_use,
        "over_budget": float(np.mean(costs > data.budget)),
        "step_balance": stats.step_balance,
        "mean_batch_size": stats.mean_batch_size,
        "exactly_once": int(np.sum(counts == 1)),
        "missing": int(np.sum(counts == 0)),
        "repeated": int(np.sum(counts > 1)),
    }


# -- speed and memory ---------------------------------------------------------------------


def _timed(fn: Callable[[], Any]) -> float:
    gc.collect()
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _drain(batches: Iterable[Any]) -> None:
    for _ in batches:
        pass


def time_map(data: Dataset, cuts: Sequence[Any], repeats: int) -> dict[str, list[float]]:
    """Seconds of an epoch (``set_epoch`` then every batch), both samplers built beforehand.

    tokenbatch's epoch takes milliseconds, so each of its repeats is the median of 5 epochs
    in a row (one stall of a shared machine would otherwise be the whole figure).
    """
    ours = TokenBudgetBatchSampler(data.lengths, data.budget, cost=COST, seed=0)
    theirs = lhotse_sampler(cuts, data.budget, len(cuts))
    times: dict[str, list[float]] = {"tokenbatch": [], "lhotse": []}

    def epoch_of(sampler: Any, epoch: int) -> None:
        sampler.set_epoch(epoch)
        _drain(sampler)

    for repeat in range(repeats):
        inner = [_timed(lambda e=e: epoch_of(ours, e)) for e in range(1 + 5 * repeat, 6 + 5 * repeat)]
        times["tokenbatch"].append(statistics.median(inner))
        times["lhotse"].append(_timed(lambda r=repeat: epoch_of(theirs, 1 + r)))
    return times


def _stream_pass(method: str, data: Dataset, cuts: Sequence[Any], buffer: int, epoch: int) -> None:
    if method == "tokenbatch":
        stream = TokenBudgetStream(
            cuts, data.budget, cost=COST, length=_cut_length, buffer_size=buffer, num_replicas=1, rank=0
        )
        stream.set_epoch(epoch)
        _drain(stream)
    else:
        sampler = lhotse_sampler(cuts, data.budget, buffer)
        sampler.set_epoch(epoch)
        _drain(sampler)


def time_stream(data: Dataset, cuts: Sequence[Any], buffer: int, repeats: int) -> dict[str, list[float]]:
    """Seconds of a pass over the cuts, each library building its stream (sampler) as part of the pass."""
    times: dict[str, list[float]] = {"tokenbatch": [], "lhotse": []}
    for epoch in range(1, repeats + 1):
        for method in METHODS:
            times[method].append(_timed(lambda m=method, e=epoch: _stream_pass(m, data, cuts, buffer, e)))
    return times


# -- running it ---------------------------------------------------------------------------


def run_dataset(data: Dataset, buffer: int, repeats: int) -> list[dict[str, Any]]:
    """Rows for one data set: per mode (map-style, stream), ranks (1, 2) and method."""
    with warnings.catch_warnings():
        # lhotse's "buffer_size might be too low to satisfy max_duration": its guess; measured here.
        warnings.filterwarnings("ignore", "Your 'buffer_size' setting", UserWarning)
        return _run_dataset(data, buffer, repeats)


def _run_dataset(data: Dataset, buffer: int, repeats: int) -> list[dict[str, Any]]:
    cuts = make_cuts(data.lengths)
    n = len(cuts)
    base = {"dataset": data.name, "budget": data.budget, "n": n}
    plans: dict[tuple[str, int, str], Callable[[], Plan]] = {}
    for world in (1, 2):
        plans["map-style", world, "tokenbatch"] = lambda w=world: tokenbatch_map(data, w)
        plans["map-style", world, "lhotse"] = lambda w=world: lhotse_batches(cuts, data.budget, n, w)
        plans["stream", world, "tokenbatch"] = lambda w=world: tokenbatch_stream(data, buffer, w)
        plans["stream", world, "lhotse"] = lambda w=world: lhotse_batches(cuts, data.budget, buffer, w)
    rows = []
    for (mode, world, method), make in plans.items():
        row = {**base, "mode": mode, "buffer": "all" if mode == "map-style" else buffer, "ranks": world}
        rows.append({**row, "method": method, **measure(make(), data)})
    speed = {"map-style": time_map(data, cuts, repeats), "stream": time_stream(data, cuts, buffer, repeats)}
    memory = {m: peak_bytes(lambda m=m: _stream_pass(m, data, cuts, buffer, 0)) for m in METHODS}
    for row in rows:
        if row["ranks"] != 1:
            continue
        times = speed[row["mode"]]
        row["seconds"] = statistics.median(times[row["method"]])
        row["examples_per_s"] = n / row["seconds"]
        if row["method"] == "tokenbatch":  # lhotse's time over ours, per repeat
            pairs = zip(times["lhotse"], times["tokenbatch"], strict=True)
            row["lhotse_time_ratio"] = statistics.median(a / b for a, b in pairs)
        if row["mode"] == "stream":
            row["peak_mib"] = memory[row["method"]] / 2**20
    return rows


def summary(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per data set and mode: tokenbatch / lhotse side by side."""
    result = []
    for key in dict.fromkeys((r["dataset"], r["mode"]) for r in rows):
        pick = {(r["ranks"], r["method"]): r for r in rows if (r["dataset"], r["mode"]) == key}
        ours, theirs = pick[1, "tokenbatch"], pick[1, "lhotse"]

        def pair(key: str, spec: str = ".3f", ours: Any = ours, theirs: Any = theirs) -> str:
            return f"{ours[key]:{spec}} / {theirs[key]:{spec}}"

        line = {
            "dataset": key[0],
            "mode": key[1] if key[1] == "map-style" else f"stream {ours['buffer']:,}",
            "steps / lower bound": pair("steps_over_lower_bound"),
            "padding efficiency (tokens)": pair("efficiency"),
            "cost efficiency": pair("cost_efficiency"),
            "max batch cost / budget": pair("max_budget_use"),
            "batches over budget": pair("over_budget", ".1%"),
            "step balance, 2 ranks": f"{pick[2, 'tokenbatch']['step_balance']:.3f} / "
            f"{pick[2, 'lhotse']['step_balance']:.3f}",
            "lhotse time / ours": f"{ours['lhotse_time_ratio']:.1f}x",
        }
        if key[1] == "stream":
            line["buffer peak MiB"] = pair("peak_mib", ".2f")
        result.append(line)
    return result


def markdown(sets: list[Dataset], rows: list[dict[str, Any]], repeats: int) -> str:
    parts = ["## Data\n"]
    parts += [
        f"- **{d.name}**: {d.source}; {len(d.lengths)} samples, median {np.median(d.lengths):g}, "
        f"max {d.lengths.max()}; max_tokens = max_duration = {d.budget:g}"
        for d in sets
    ]
    parts += [
        "",
        f"Cost B * L * (1 + L / {CROSSOVER}) in both (lhotse: quadratic_duration={CROSSOVER}). "
        f"Batch figures from epoch 0; times medians of {repeats} repeat(s), lhotse's over ours per repeat.",
        "",
        "## Side by side (tokenbatch / lhotse, 1 rank unless said)\n",
    ]
    lines = summary(rows)
    columns = list(dict.fromkeys(c for line in lines for c in line))
    parts.append(common.markdown_table(lines, columns))
    columns = ["dataset", "mode", "buffer", "ranks", "method", "steps", "steps_over_lower_bound"]
    columns += [
        "efficiency",
        "cost_efficiency",
        "max_budget_use",
        "over_budget",
        "step_balance",
        "mean_batch_size",
    ]
    columns += ["exactly_once", "missing", "repeated", "seconds", "examples_per_s", "peak_mib"]
    parts += ["", "## Every row\n", common.markdown_table(rows, columns, digits=4)]
    return "\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser("lhotse_compare", __doc__.splitlines()[0] if __doc__ else "").parse_args(argv)
    missing = lhotse_missing()
    if missing is not None:
        print(missing, file=sys.stderr)
        return 2
    import lhotse

    sets = datasets(args.quick)
    repeats = 1 if args.quick else 3
    rows = []
    for data in sets:
        rows += run_dataset(data, BUFFER, repeats)
        print(f"[lhotse_compare] {data.name}: done", flush=True)
    results = {
        "quick": args.quick,
        "lhotse": lhotse.__version__,
        "crossover": CROSSOVER,
        "buffer": BUFFER,
        "repeats": repeats,
        "datasets": {
            d.name: {"source": d.source, "num_samples": len(d.lengths), "budget": d.budget} for d in sets
        },
        "rows": rows,
    }
    common.write_results("lhotse_compare", args.out, results, markdown(sets, rows, repeats))
    lines = summary(rows)
    print(common.markdown_table(lines, list(dict.fromkeys(c for line in lines for c in line))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
