"""``max_tokens="auto"`` from nothing against hand-picked budgets, under a real memory limit (CPU).

all-MiniLM-L6-v2 (a 6-label head) fine-tunes on the first texts of the
emotion training set (an epoch subset: ``--texts``, default 600) under
``RLIMIT_AS``, one training run per fork of a warmed-up child process (see
``benchmarks/probe.py`` for why forks and why ``MALLOC_MMAP_THRESHOLD_=65536``):

* ``auto (probe)``: the sampler is made with ``max_tokens="auto"`` and
  :func:`tokenbatch.auto_budget` resolves it with no argument but the model
  and optimizer: the memory limit comes from ``RLIMIT_AS``, the budget from
  the probe (nothing is cached), then one epoch trains under
  ``OOMFallback(mode="halve")``. Its probe time is reported apart.
* ``auto (cache)``: the same in a later fork, which finds the budget the first
  one remembered (the second run of a training script).
* ``fixed``: a sweep of hand-picked budgets, each with the same guard; "best
  hand-picked" is the fastest epoch among those that had no OOM (a fixed
  budget that runs out of memory is not one a user would keep).

Every fork gets the same room (address space beyond its own VmSize when it
starts; the model, gradients and AdamW state are already inside it). Runs
go in rounds, each round one run of every setting, and epoch times are the
medians over rounds; the machine is shared, so read ratios within one run.

Usage: ``python -m benchmarks.auto [--quick] [--out DIR] [--texts N] [--room-mib M] [--rounds R]``
(about 15 minutes on a shared 2-core CPU, 4 with ``--quick``; not part of ``python -m benchmarks``,
whose quick suite must stay near a minute; ``benchmarks.report`` shows its results when present).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import common

MiB = 2**20
BUDGETS = (3072, 4096, 5120, 6144, 8192)


def child(spec: dict[str, Any]) -> None:
    """Build and warm up MiniLM once, then run every setting of every round in a fork; print JSON."""
    import accelerate.utils.memory  # noqa: F401  (is_oom asks it; not to be imported under the limit)
    import numpy as np
    import torch
    from torch.utils.data import DataLoader
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler, auto_budget
    from tokenbatch.probe import BudgetCache

    torch.set_num_threads(1)
    torch.manual_seed(0)
    path = common.minilm_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    folder = common.data_dir()
    if folder is None:
        raise SystemExit("the emotion data is not beside the checkout (../shared/data/emotion)")
    rows = common.read_jsonl(folder / "emotion" / "train.jsonl", spec["texts"])
    ids = [tokenizer(r["text"], truncation=True, max_length=512)["input_ids"] for r in rows]
    labels = torch.tensor([int(r["label"]) for r in rows])
    lengths = [len(x) for x in ids]
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=6).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)

    def collate(indices: list[int]) -> dict[str, torch.Tensor]:
        width = max(lengths[i] for i in indices)
        input_ids = torch.zeros(len(indices), width, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            input_ids[row, : lengths[i]] = torch.tensor(ids[i])
            mask[row, : lengths[i]] = 1
        return {"input_ids": input_ids, "attention_mask": mask, "labels": labels[indices]}

    def warm() -> None:
        model(**collate([0, 1])).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warm()  # optimizer state, kernels
    np.linalg.lstsq(np.ones((4, 2)), np.ones(4), rcond=None)  # OpenBLAS maps its buffers once, here
    cache = BudgetCache(spec["cache"])

    def run(max_tokens: float | str) -> dict[str, Any]:
        limit = common.vm_status("VmSize") + spec["room"]
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.RLIM_INFINITY))
        sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=0)
        start = time.perf_counter()
        chosen = (
            auto_budget(model, sampler, optimizer=optimizer, cache=cache) if max_tokens == "auto" else None
        )
        resolve_s = time.perf_counter() - start
        fallback = OOMFallback(sampler, model, mode="halve")
        start, steps = time.perf_counter(), 0
        loader = DataLoader(range(len(lengths)), batch_sampler=sampler, collate_fn=collate)
        for batch in fallback.iterate(loader):
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if loss is not None:
                fallback.step(optimizer)
                optimizer.zero_grad(set_to_none=True)
                steps += 1
        return {
            "start_max_tokens": chosen.max_tokens if chosen is not None else float(max_tokens),
            "source": chosen.source if chosen is not None else "fixed",
            "memory_limit_mib": chosen.memory_limit / MiB if chosen and chosen.memory_limit else None,
            "resolve_s": resolve_s,
            "epoch_s": time.perf_counter() - start,
            "steps": steps,
            "oom_events": len(fallback.events),
            "final_max_tokens": fallback.max_tokens,
        }

    first = common.in_fork(functools.partial(run, "auto"))
    results: dict[str, list[dict[str, Any]]] = {"auto (probe)": [first]}
    for _ in range(spec["rounds"]):
        for name, budget in [("auto (cache)", "auto")] + [(f"fixed {b}", b) for b in spec["budgets"]]:
            results.setdefault(name, []).append(common.in_fork(functools.partial(run, budget)))
    print(json.dumps(results), flush=True)


def summarise(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per setting: medians over rounds, and the ratio to the best hand-picked budget."""
    rows = []
    for name, reports in runs.items():
        crashed = [r["crash"] for r in reports if "crash" in r]
        good = [r for r in reports if "crash" not in r]
        if not good:
            rows.append({"setting": name, "crash": crashed[0]})
            continue
        rows.append(
            {
                "setting": name,
                "start_max_tokens": good[0]["start_max_tokens"],
                "final_max_tokens": good[-1]["final_max_tokens"],
                "source": good[0]["source"],
                "oom_events": max(r["oom_events"] for r in good),
                "steps": good[0]["steps"],
                "epoch_s": statistics.median(r["epoch_s"] for r in good),
                "resolve_s": statistics.median(r["resolve_s"] for r in good),
                "runs": len(good),
                "memory_limit_mib": good[0]["memory_limit_mib"],
                "crashes": len(crashed),
            }
        )
    clean = [r for r in rows if r["setting"].startswith("fixed") and r.get("oom_events") == 0]
    best = min(clean, key=lambda r: r["epoch_s"]) if clean else None
    for row in rows:
        if best is not None and "epoch_s" in row:
            row["epoch_over_best_fixed"] = row["epoch_s"] / best["epoch_s"]
            row["budget_over_best_fixed"] = row["final_max_tokens"] / best["start_max_tokens"]
        row["best_fixed"] = row is best
    return rows


def markdown(rows: Sequence[dict[str, Any]], spec: dict[str, Any]) -> str:
    columns = [
        "setting",
        "source",
        "start_max_tokens",
        "final_max_tokens",
        "oom_events",
        "steps",
        "resolve_s",
        "epoch_s",
        "epoch_over_best_fixed",
        "budget_over_best_fixed",
        "runs",
    ]
    best = next((r for r in rows if r["best_fixed"]), None)
    note = (
        f"all-MiniLM-L6-v2, first {spec['texts']} emotion training texts (an epoch subset), 1 thread, "
        f"RLIMIT_AS = VmSize + {spec['room'] / MiB:.0f} MiB per fork, MALLOC_MMAP_THRESHOLD_=65536, "
        f"OOMFallback(mode='halve') everywhere (no growth after an OOM: auto alone). Epoch times are "
        f"medians over {spec['rounds']} rounds (auto (probe): one run); resolve_s is auto_budget's time "
        f"(the probe, or reading the cache). Best hand-picked: "
        + (
            f"max_tokens={best['start_max_tokens']:g}, the fastest with no OOM."
            if best
            else "none ran clean."
        )
    )
    return note + "\n\n" + common.markdown_table(rows, columns)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = common.parser("auto", __doc__.splitlines()[0] if __doc__ else "auto")
    parser.add_argument(
        "--texts", type=int, default=None, help="training texts in the epoch (600; quick 300)"
    )
    parser.add_argument("--room-mib", type=int, default=1024, help="address space beyond VmSize per fork")
    parser.add_argument("--rounds", type=int, default=None, help="rounds of the sweep (2; quick 1)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "texts": args.texts or (300 if args.quick else 600),
            "room": args.room_mib * MiB,
            "rounds": args.rounds or (1 if args.quick else 2),
            "budgets": list(BUDGETS[:3] if args.quick else BUDGETS),
            "cache": os.path.join(tmp, "budgets.json"),
        }
        env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536")
        env.setdefault("HF_HUB_OFFLINE", "1")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "benchmarks.auto", "--child", json.dumps(spec)]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        print(done.stderr[-4000:], file=sys.stderr)
        return 1
    runs = json.loads(done.stdout.strip().splitlines()[-1])
    rows = summarise(runs)
    spec.pop("cache")
    common.write_results("auto", args.out, {"spec": spec, "rows": rows, "runs": runs}, markdown(rows, spec))
    print(markdown(rows, spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
