"""Padding benchmark: how much of each batch is real, against what people use today.

For real and synthetic length distributions, several budgets, a linear and a
quadratic cost, and one or two processes, it plans epochs with:

- ``tokenbatch``: :class:`tokenbatch.TokenBudgetBatchSampler` (shuffle on);
- ``random_fixed``: random batches of a fixed size ``b``, the largest with
  ``cost(b, longest sample) <= budget`` (the seed's design: same worst-case memory);
- ``length_grouped``: ``transformers.trainer_pt_utils.LengthGroupedSampler``
  with that same ``b`` (it puts the longest sample first in a full batch, so
  ``b`` is also the largest size whose own worst batch fits; checked per row);
- ``sorted_greedy``: every sample sorted by length and packed greedily under
  the budget, no randomness (fairseq's ``batch_by_size`` style): the reference
  for how little padding a budget allows.

Run: ``python -m benchmarks.padding [--quick]``.
"""

from __future__ import annotations

import itertools
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from benchmarks import common
from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.compare import (
    Batching,
    as_row,
    batch_costs,
    fixed_batch_size,
    length_grouped_batching,
    measure,
    random_fixed_batching,
    repetition,
)

COSTS = {"linear": CostModel(), "quadratic": CostModel(quadratic=1 / 1024)}
METHODS = ("tokenbatch", "random_fixed", "length_grouped", "sorted_greedy")
# Issue 2's figures to reach: (dataset, cost, budget, min efficiency, max steps / lower bound).
TARGETS = (("emotion", "linear", 16384, 0.95, 1.10), ("lognormal", "quadratic", 131072, 0.97, 1.05))


@dataclass
class Dataset:
    """One set of lengths and the budgets to try on it."""

    name: str
    lengths: np.ndarray
    source: str
    budgets: Sequence[int]


def _lognormal(n: int, median: float, sigma: float, low: int, high: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), low, high).astype(np.int64)


def _outliers(n: int, seed: int) -> np.ndarray:
    """Lognormal lengths (median 300, at most 1024) with 0.05% outliers of 4096..8192 tokens."""
    lengths = _lognormal(n, 300, 0.7, 8, 1024, seed)
    rng = np.random.default_rng(seed + 1)
    few = max(1, n // 2000)
    lengths[rng.choice(n, few, replace=False)] = rng.integers(4096, 8193, few)
    return lengths


def _real_lengths(name: str, limit: int | None) -> tuple[np.ndarray, str] | None:
    root = common.data_dir()
    if root is None:
        return None
    rows = common.read_jsonl(root / name / "train.jsonl")
    if limit is not None and limit < len(rows):
        rows = random.Random(0).sample(rows, limit)  # IMDB rows are sorted by label
    texts = [row["text"] for row in rows]
    subset = "" if limit is None or limit >= len(texts) else f", random subset of {len(texts)}"
    return common.token_lengths(texts, 512), f"{name} train set, all-MiniLM-L6-v2 tokens{subset}"


def datasets(quick: bool) -> list[Dataset]:
    """The length sets of the benchmark; real data where ``../shared/data`` has it, else synthetic."""
    result = []
    emotion = _real_lengths("emotion", None)
    if emotion is None:
        emotion = (
            _lognormal(16000, 20, 0.5, 3, 87, 0),
            "SYNTHETIC emotion-like (no data dir found): lognormal median 20, 3..87",
        )
    imdb = _real_lengths("imdb", 2000 if quick else None)
    if imdb is None:
        imdb = (
            _lognormal(2000 if quick else 25000, 230, 0.75, 10, 512, 1),
            "SYNTHETIC IMDB-like (no data dir found): lognormal median 230, 10..512",
        )
    big = 200_000
    result.append(Dataset("emotion", *emotion, [16384] if quick else [2048, 4096, 8192, 16384, 32768]))
    result.append(Dataset("imdb", *imdb, [32768] if quick else [8192, 16384, 32768, 65536, 131072]))
    result.append(
        Dataset(
            "lognormal",
            _lognormal(big, 300, 1.0, 8, 4096, 2),
            f"synthetic: {big} lognormal lengths, median 300, sigma 1, clipped to 8..4096",
            [131072] if quick else [32768, 65536, 131072, 262144, 524288],
        )
    )
    result.append(
        Dataset(
            "outliers",
            _outliers(big, 3),
            f"synthetic: {big} lognormal lengths (median 300, sigma 0.7, 8..1024) "
            f"with {big // 2000} outliers of 4096..8192",
            [131072] if quick else [131072, 262144, 524288],
        )
    )
    return result


# -- the methods: each returns one batching per epoch ----------------------------------


def tokenbatch_epochs(
    lengths: np.ndarray, cost: CostModel, budget: float, epochs: int, num_replicas: int
) -> list[Batching]:
    sampler = TokenBudgetBatchSampler(lengths, budget, cost=cost, seed=0, num_replicas=num_replicas)
    result = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        result.append((sampler.plan.order, sampler.plan.offsets))
    return result


def random_fixed_epochs(num_samples: int, batch_size: int, epochs: int) -> list[Batching]:
    rng = np.random.default_rng(0)
    return [random_fixed_batching(num_samples, batch_size, rng) for _ in range(epochs)]


def length_grouped_epochs(lengths: np.ndarray, batch_size: int, epochs: int) -> list[Batching]:
    # One generator for the run, as Trainer does: it advances, so epochs differ.
    generator = torch.Generator().manual_seed(0)
    return [length_grouped_batching(lengths, batch_size, generator) for _ in range(epochs)]


def sorted_greedy(lengths: np.ndarray, cost: CostModel, budget: float) -> Batching:
    """Sort by length, then close a batch when the next sample would break the budget.

    A deliberately plain loop, independent of tokenbatch's packer, so the two
    check each other.
    """
    order = np.argsort(lengths, kind="stable")
    unit = cost.sample_cost(lengths[order]).tolist()
    offsets = [0]
    count = 0
    for position, sample_cost in enumerate(unit):  # nondecreasing: the newcomer is the longest
        if count and (count + 1) * sample_cost > budget:
            offsets.append(position)
            count = 0
        count += 1
    offsets.append(len(unit))
    return order, np.array(offsets, dtype=np.int64)


# -- running it ------------------------------------------------------------------------


def _worst(epochs: list[Batching], lengths: np.ndarray, cost: CostModel) -> float:
    return max(float(batch_costs(b, lengths, cost).max()) for b in epochs)


def _summarise(
    epochs: list[Batching], lengths: np.ndarray, cost: CostModel, budget: float, num_replicas: int
) -> dict[str, float]:
    """Per-epoch statistics averaged over epochs, and repetition between consecutive epochs."""
    stats = [as_row(measure(b, lengths, cost, budget, num_replicas)) for b in epochs]
    result = {key: float(np.mean([s[key] for s in stats])) for key in stats[0]}
    result["max_budget_use"] = max(s["max_budget_use"] for s in stats)
    result["repetition"] = float(
        np.mean([repetition(a, b, len(lengths)) for a, b in itertools.pairwise(epochs)])
    )
    return result


def run_config(dataset: Dataset, cost_name: str, budget: int, epochs: int) -> list[dict[str, Any]]:
    """Rows (one per method and process count) for one dataset, cost and budget."""
    lengths, cost = dataset.lengths, COSTS[cost_name]
    if float(cost.sample_cost(int(lengths.max()))) > budget:
        return []
    size = fixed_batch_size(lengths, cost, budget)
    grouped = length_grouped_epochs(lengths, size, epochs)
    # LengthGroupedSampler's own worst batch decides the largest size a user could pick for it.
    own_size = size
    while (
        own_size < len(lengths)
        and _worst(length_grouped_epochs(lengths, own_size + 1, 1), lengths, cost) <= budget
    ):
        own_size += 1
    greedy = sorted_greedy(lengths, cost, budget)
    fixed: dict[str, tuple[list[Batching], Any]] = {
        "random_fixed": (random_fixed_epochs(len(lengths), size, epochs), size),
        "length_grouped": (grouped, size),
        "sorted_greedy": ([greedy] * epochs, "budget"),
    }
    if own_size != size:
        fixed["length_grouped_own_fit"] = (length_grouped_epochs(lengths, own_size, epochs), own_size)
    rows = []
    for replicas in (1, 2):
        methods: dict[str, tuple[list[Batching], Any]] = {
            "tokenbatch": (tokenbatch_epochs(lengths, cost, budget, epochs, replicas), "budget"),
            **fixed,
        }
        for method, (batchings, batch_size) in methods.items():
            row = {
                "dataset": dataset.name,
                "cost": cost_name,
                "budget": budget,
                "processes": replicas,
                "method": method,
                "batch_size": batch_size,
                "lgs_own_fit_batch_size": own_size,
            }
            row.update(_summarise(batchings, lengths, cost, budget, replicas))
            rows.append(row)
    return rows


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 2's figures to reach, with what tokenbatch and the sorted greedy reference got."""
    result = []
    for name, cost_name, budget, min_eff, max_steps in TARGETS:
        found = {
            r["method"]: r
            for r in rows
            if (r["dataset"], r["cost"], r["budget"], r["processes"]) == (name, cost_name, budget, 1)
        }
        if "tokenbatch" not in found:
            continue
        ours, ref = found["tokenbatch"], found["sorted_greedy"]
        result.append(
            {
                "target": f"{name}, {cost_name}, max_tokens={budget}",
                "min_efficiency": min_eff,
                "tokenbatch_efficiency": ours["efficiency"],
                "sorted_greedy_efficiency": ref["efficiency"],
                "max_steps_over_lower_bound": max_steps,
                "tokenbatch_steps_over_lower_bound": ours["steps_over_lower_bound"],
                "sorted_greedy_steps_over_lower_bound": ref["steps_over_lower_bound"],
                "tokenbatch_steps": ours["steps"],
                "fewest_possible_steps": ref["steps"],
                "lower_bound_steps": ours["steps"] / ours["steps_over_lower_bound"],
                "efficiency_met": bool(ours["efficiency"] >= min_eff),
                "steps_met": bool(ours["steps_over_lower_bound"] <= max_steps),
            }
        )
    return result


def markdown(sets: list[Dataset], rows: list[dict[str, Any]], targets: list[dict[str, Any]]) -> str:
    parts = ["## Data\n"]
    parts += [
        f"- **{d.name}**: {d.source}; {len(d.lengths)} samples, median {np.median(d.lengths):g}, "
        f"max {d.lengths.max()}"
        for d in sets
    ]
    parts += ["", "## Efficiency and steps against their targets (1 process)\n", markdown_targets(targets)]
    one = ["budget", "method", "batch_size", "efficiency", "steps", "steps_over_lower_bound"]
    one += ["mean_budget_use", "max_budget_use", "mean_batch_size", "repetition"]
    two = ["budget", "method", "efficiency", "steps", "steps_over_lower_bound", "step_balance"]
    two += ["max_budget_use", "repetition"]
    for d in sets:
        for cost_name in COSTS:
            for replicas, columns in ((1, one), (2, two)):
                chosen = [
                    r
                    for r in rows
                    if (r["dataset"], r["cost"], r["processes"]) == (d.name, cost_name, replicas)
                ]
                if chosen:
                    parts += [f"\n## {d.name}, {cost_name} cost, {replicas} process(es)\n"]
                    parts.append(common.markdown_table(chosen, columns, digits=4))
    return "\n".join(parts)


def markdown_targets(targets: list[dict[str, Any]]) -> str:
    """The targets with four decimals: 1.104 must not print as 1.1."""
    rows = [
        {
            "target": t["target"],
            "efficiency (tokenbatch / sorted greedy)": f"{t['tokenbatch_efficiency']:.4f} / "
            f"{t['sorted_greedy_efficiency']:.4f} (need >= {t['min_efficiency']})",
            "steps / lower bound (tokenbatch / sorted greedy)": (
                f"{t['tokenbatch_steps_over_lower_bound']:.4f} / "
                f"{t['sorted_greedy_steps_over_lower_bound']:.4f} (need <= {t['max_steps_over_lower_bound']})"
            ),
            "steps (tokenbatch / fewest possible / lower bound)": f"{t['tokenbatch_steps']:g} / "
            f"{t['fewest_possible_steps']:g} / {t['lower_bound_steps']:.2f}",
            "met (efficiency, steps)": f"{'yes' if t['efficiency_met'] else 'NO'}, "
            f"{'yes' if t['steps_met'] else 'NO'}",
        }
        for t in targets
    ]
    return common.markdown_table(rows, list(rows[0]) if rows else ["target"])


def main(argv: Sequence[str] | None = None) -> int:
    args = common.parser("padding", __doc__.splitlines()[0] if __doc__ else "").parse_args(argv)
    sets = datasets(args.quick)
    epochs = 2 if args.quick else 3
    rows = []
    for dataset in sets:
        for cost_name in COSTS:
            for budget in dataset.budgets:
                rows += run_config(dataset, cost_name, budget, epochs)
    targets = check_targets(rows)
    results = {
        "quick": args.quick,
        "epochs": epochs,
        "datasets": {
            d.name: {
                "source": d.source,
                "synthetic": d.source.startswith(("SYNTHETIC", "synthetic")),
                "num_samples": len(d.lengths),
                "median": float(np.median(d.lengths)),
                "max": int(d.lengths.max()),
            }
            for d in sets
        },
        "targets": targets,
        "rows": rows,
    }
    common.write_results("padding", args.out, results, markdown(sets, rows, targets))
    print(markdown_targets(targets))
    return 0


if __name__ == "__main__":
    sys.exit(main())
