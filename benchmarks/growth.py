"""Growth after out-of-memory (issue 13): how close to the true limit each schedule ends, and at what cost.

A true limit is set by injected OOMs (``tokenbatch.testing.inject_oom``: a
real ``torch.OutOfMemoryError`` for every batch costing more than the limit,
in padded tokens). Training starts at 1.5x, 3x, 4x, 10x and 16x the limit, on
the emotion texts' token lengths (all-MiniLM-L6-v2 tokenizer), for three
epochs, under four schedules:

- ``grow``: ``OOMFallback(mode="halve")`` with growth (the default): halve, then bisect back;
- ``grow-split``: the same in split mode (the micro-batch budget grows);
- ``halve``: ``grow=False``, the seed's plain halving (accelerate's 0.5 schedule);
- ``factor-0.9``: ``grow=False, factor=0.9``, accelerate's newer 0.9 schedule (no restart here).

Part 1 (a model that costs nothing, so that only the schedule matters):
the largest budget that trained (what ``remember_budget`` keeps) over the
limit, and the OOM events to get there. Part 2 (a 2-layer BERT from
``BertConfig``, real training on CPU): the three epochs' time from 16x the
limit with growth, against a run started at the limit with no OOM; runs
alternate and the ratio is the median of paired runs.

Run: ``python -m benchmarks.growth [--quick]``.
"""

from __future__ import annotations

import logging
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import data_dir, markdown_table, parser, read_jsonl, token_lengths, write_results

NAME = "growth"
LIMIT = 2048.0  # padded tokens
STARTS = (1.5, 3.0, 4.0, 10.0, 16.0)
SCHEDULES: dict[str, dict[str, Any]] = {
    "grow": {"mode": "halve"},
    "grow-split": {"mode": "split"},
    "halve": {"mode": "halve", "grow": False},
    "factor-0.9": {"mode": "halve", "grow": False, "factor": 0.9},
}


def lengths(count: int) -> tuple[np.ndarray, str]:
    root = data_dir()
    rng = np.random.default_rng(0)
    if root is None:
        return np.clip(rng.lognormal(np.log(22), 0.5, count).astype(int), 3, 87), "synthetic"
    rows = read_jsonl(root / "emotion" / "train.jsonl")
    picked = rng.permutation(len(rows))[:count]
    return token_lengths([rows[i]["text"] for i in picked]), "emotion"


class Cheap(torch.nn.Module):
    """A model whose step costs next to nothing: only the schedule's OOMs and re-plans are measured."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: Any = None
    ) -> torch.Tensor:
        return (self.weight * attention_mask.float().mean()).square()


def tiny_bert() -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
        num_labels=6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def batch_of(indices: list[int], sizes: np.ndarray) -> dict[str, torch.Tensor]:
    """Right-padded ids and mask for the samples ``indices`` (ids are arbitrary: cost is what matters)."""
    width = int(sizes[indices].max())
    mask = torch.zeros(len(indices), width, dtype=torch.long)
    for row, i in enumerate(indices):
        mask[row, : sizes[i]] = 1
    ids = (torch.arange(width).repeat(len(indices), 1) % 997 + 1) * mask
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor(indices) % 6}


def run(
    sizes: np.ndarray,
    start: float,
    limit: float | None,
    *,
    epochs: int,
    model: torch.nn.Module,
    **options: Any,
) -> dict[str, Any]:
    """``epochs`` epochs from ``start``; batches over ``limit`` run out of memory (None: never)."""
    from tokenbatch import OOMFallback, TokenBudgetBatchSampler
    from tokenbatch.probe import BudgetCache, BudgetKey, remember_budget
    from tokenbatch.testing import inject_oom

    sampler = TokenBudgetBatchSampler(sizes, start, seed=0)
    fallback = OOMFallback(sampler, model, **options)
    cache = BudgetCache(Path(tempfile.mkdtemp()) / "budgets.json")
    key = BudgetKey("bench", "cpu", 0, "float32", 1)
    remember_budget(fallback, key, cache=cache)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    bert = not isinstance(model, Cheap)
    trained = 0
    injector = inject_oom(model, limit) if limit is not None else None
    began = time.perf_counter()
    epoch_seconds = []
    for epoch in range(epochs):
        epoch_began = time.perf_counter()
        sampler.set_epoch(epoch)
        for indices in fallback.iterate(_Batches(sampler, sizes)):
            loss = fallback.backward(indices, lambda b: model(**b).loss if bert else model(**b))
            if loss is not None:
                trained += len(indices["input_ids"])
                optimizer.step()
                optimizer.zero_grad()
        epoch_seconds.append(time.perf_counter() - epoch_began)
    seconds = time.perf_counter() - began
    if injector is not None:
        injector.remove()
    assert trained == epochs * len(sizes), (trained, epochs * len(sizes))  # every sample once per epoch
    entry = cache.get(key)
    return {
        "seconds": seconds,
        "last_epoch_seconds": epoch_seconds[-1],
        "final": float(entry["max_tokens"]) if entry is not None else start,
        "oom_events": len(fallback.events),
        "failed_tries": sum(e.growth for e in fallback.events),
        "growths": len(fallback.growth_events),
    }


class _Batches:
    """A DataLoader-like pass over the sampler that collates in the loop (no worker processes)."""

    def __init__(self, sampler: Any, sizes: np.ndarray) -> None:
        self.sampler, self.sizes, self.batch_sampler = sampler, sizes, sampler

    def __iter__(self) -> Any:
        return (batch_of(list(indices), self.sizes) for indices in self.sampler)


def main(argv: list[str] | None = None) -> None:
    args = parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    logging.getLogger("tokenbatch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    sizes, source = lengths(1500 if args.quick else 6000)
    epochs = 1 if args.quick else 3
    starts = (1.5, 16.0) if args.quick else STARTS

    search = []
    for multiple in starts:
        for name, options in SCHEDULES.items():
            result = run(sizes, multiple * LIMIT, LIMIT, epochs=epochs, model=Cheap(), **options)
            search.append(
                {
                    "start": multiple,
                    "schedule": name,
                    "final_over_limit": result["final"] / LIMIT,
                    **{k: result[k] for k in ("oom_events", "failed_tries", "growths")},
                }
            )
            print(search[-1], flush=True)

    arms: dict[str, dict[str, Any]] = {
        "at_limit": {"start": LIMIT, "limit": None, "mode": "halve"},
        "grow_from_16x": {"start": 16 * LIMIT, "limit": LIMIT, "mode": "halve"},
        "halve_from_16x": {"start": 16 * LIMIT, "limit": LIMIT, "mode": "halve", "grow": False},
    }
    timing: dict[str, list[dict[str, float]]] = {arm: [] for arm in arms}
    bert_sizes = sizes[: 600 if args.quick else 3000]
    for _ in range(1 if args.quick else 3):  # alternate the arms, for paired ratios
        for arm, options in arms.items():
            options = dict(options)
            start, limit = options.pop("start"), options.pop("limit")
            result = run(bert_sizes, start, limit, epochs=epochs, model=tiny_bert(), **options)
            timing[arm].append({k: result[k] for k in ("seconds", "last_epoch_seconds", "oom_events")})
        print({arm: runs[-1] for arm, runs in timing.items()}, flush=True)

    def ratio(arm: str, key: str) -> float:
        pairs = zip(timing[arm], timing["at_limit"], strict=True)
        return statistics.median(a[key] / b[key] for a, b in pairs)

    ratios = {
        f"{arm}_{key}": ratio(arm, key)
        for arm in ("grow_from_16x", "halve_from_16x")
        for key in ("seconds", "last_epoch_seconds")
    }
    # What one OOM costs at least, whatever the model: the guard's gc.collect (accelerate's release).
    from tokenbatch.oom import free_memory

    free_memory_seconds = statistics.median(_timed(free_memory) for _ in range(5))
    grow16 = next(r for r in search if r["start"] == 16.0 and r["schedule"] == "grow")
    goals = {
        "final_over_limit_ge_0.9": all(
            r["final_over_limit"] >= 0.9 for r in search if r["schedule"] == "grow"
        ),
        "oom_events_from_16x_le_5": grow16["oom_events"] <= 5,
        "epoch_time_ratio_le_1.05": ratios["grow_from_16x_seconds"] <= 1.05,
    }
    results = {
        "source": source,
        "samples": len(sizes),
        "epochs": epochs,
        "limit": LIMIT,
        "search": search,
        "timing": timing,
        "time_over_at_limit": ratios,
        "free_memory_seconds": free_memory_seconds,
        "goals": goals,
    }
    columns = ["start", "schedule", "final_over_limit", "oom_events", "failed_tries", "growths"]
    markdown = (
        f"True limit {LIMIT:g} padded tokens (injected OOMs above it), {len(sizes)} {source} texts, "
        f"{epochs} epoch(s); final = the largest budget that trained (the remembered one).\n\n"
        + markdown_table(search, columns)
        + f"\n\nTraining time, 2-layer BERT on {len(bert_sizes)} texts, {epochs} epoch(s), median of "
        f"paired ratios against a run started at the limit with no OOM (whole run / last epoch): grow "
        f"from 16x {ratios['grow_from_16x_seconds']:.3f} / {ratios['grow_from_16x_last_epoch_seconds']:.3f}, "
        f"plain halving from 16x {ratios['halve_from_16x_seconds']:.3f} / "
        f"{ratios['halve_from_16x_last_epoch_seconds']:.3f}; at the limit the whole run takes "
        f"{statistics.median(t['seconds'] for t in timing['at_limit']):.2f} s, and each OOM costs at least "
        f"{free_memory_seconds:.3f} s in the guard's garbage collection.\n\nGoals: {goals}\n"
    )
    write_results(NAME, args.out, results, markdown)
    print(markdown)
    if not math.isfinite(ratios["grow_from_16x_seconds"]):
        raise SystemExit(1)


def _timed(fn: Any) -> float:
    began = time.perf_counter()
    fn()
    return time.perf_counter() - began


if __name__ == "__main__":
    main()
