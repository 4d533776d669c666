"""How good is the probe? Prediction error, time taken, and its budget against the real largest one.

For a tiny BERT (eager attention) and all-MiniLM-L6-v2 (its default attention,
sdpa, which on CPU with dropout runs the math kernel) on CPU:

* the probe (``find_max_tokens``, fit method): seconds and steps it took;
* prediction error of the fitted model on held-out random shapes costing
  30-100% of the suggested budget (median and worst absolute error);
* the largest budget that really runs: a child process trains worst-case
  batches (longest, middle and shortest sequences at the budget) under
  ``RLIMIT_AS`` calibrated to the same memory limit (its own VmSize after
  warm-up, plus the limit, minus what weights and optimizer state hold) and
  bisects the budget; twice, with ``MALLOC_MMAP_THRESHOLD_=65536`` (address
  space tracks tensor bytes) and with glibc's default allocator settings;
* the search method's budget and time, and the analytic estimate
  (``tokenbatch.memory_model``) against the fit.

Usage: ``python -m benchmarks.probe [--quick] [--out DIR]``. ``--quick`` skips
MiniLM's ground truth and search runs (each MiniLM step takes seconds on CPU)
and the default-malloc ground truth, and brackets the largest budget to 5%
instead of 2%. Every ground-truth trial is a fresh interpreter, so the full
run takes about half an hour on a busy 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks import common

MiB = 2**20
TINY: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "max_position_embeddings": 512,
}


def build(spec: dict[str, Any]) -> Any:
    """The model a case names, with seed 0 (MiniLM: its real weights plus a 6-label head)."""
    import torch
    from transformers import AutoModelForSequenceClassification, BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    if spec["kind"] == "tiny":
        config = BertConfig(**TINY)
        config._attn_implementation = "eager"
        return BertForSequenceClassification(config)
    return AutoModelForSequenceClassification.from_pretrained(common.minilm_path(), num_labels=6)


def _vm(field: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One trial in a fresh process: do the worst-case batches of ``spec["budget"]`` train under
    RLIMIT_AS set to the memory limit (calibrated against this process's own VmSize)?"""
    import torch

    from tokenbatch import CostModel
    from tokenbatch._probe_step import default_loss, held_bytes, is_oom, synthetic_batch

    torch.set_num_threads(1)
    model = build(spec).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    cost = CostModel(**spec["cost"])
    generator = torch.Generator().manual_seed(0)

    def step(size: int, length: int) -> None:
        batch = synthetic_batch(model, size, length, generator)
        default_loss(model(**batch), batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step(1, 16)  # warm-up: optimizer state, kernels
    base = _vm("VmSize")
    allowed = spec["memory_limit"] - held_bytes(model, optimizer)
    resource.setrlimit(resource.RLIMIT_AS, (base + allowed, resource.RLIM_INFINITY))
    # Each trial is a fresh process: after a failed allocation under RLIMIT_AS glibc may have grown
    # its heap instead, so later trials in the same process would see less room than a new run.
    for length in spec["lengths"]:
        size = int(spec["budget"] // float(cost.sample_cost(length)))
        if size < 1:
            continue
        try:
            step(size, length)
        except Exception as error:
            if not is_oom(error):
                raise
            return {"ok": False, "failed": [size, length]}
    return {"ok": True, "growth_over_allowed": (_vm("VmPeak") - base) / allowed}


def _trial_env(default_malloc: bool) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join([str(common.REPO), env.get("PYTHONPATH", "")])
    if default_malloc:
        env.pop("MALLOC_MMAP_THRESHOLD_", None)
    else:
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    return env


def trials(spec: dict[str, Any], budgets: Sequence[float], default_malloc: bool) -> list[bool]:
    """Run :func:`child` for each budget, all at once, each in a fresh interpreter."""
    children = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.probe", "--child", json.dumps({**spec, "budget": budget})],
            env=_trial_env(default_malloc),
            cwd=common.REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for budget in budgets
    ]
    results = []
    for process in children:
        out, err = process.communicate(timeout=3600)
        if process.returncode != 0:
            raise RuntimeError(f"ground-truth child failed:\n{err[-3000:]}")
        results.append(bool(json.loads(out.strip().splitlines()[-1])["ok"]))
    return results


def ground_truth(spec: dict[str, Any], start: float, default_malloc: bool, tolerance: float = 0.02) -> float:
    """The largest budget that trains under the limit, to ``tolerance``: bracket it, then split the
    bracket in three with two trials at a time."""
    low, high = 0.5 * start, 1.5 * start
    ok_low, ok_high = trials(spec, [low, high], default_malloc)
    while not ok_low:
        high, low = low, low / 2
        (ok_low,) = trials(spec, [low], default_malloc)
    while ok_high:
        low, high = high, 2 * high
        (ok_high,) = trials(spec, [high], default_malloc)
    while high / low > 1 + tolerance:
        ratio = high / low
        one, two = low * ratio ** (1 / 3), low * ratio ** (2 / 3)
        ok_one, ok_two = trials(spec, [one, two], default_malloc)
        if ok_two:
            low = two
        elif ok_one:
            low, high = one, two
        else:
            high = one
    return low


def run_case(case: dict[str, Any], quick: bool) -> dict[str, Any]:
    """Probe one model and measure everything the module docstring lists."""
    import torch

    from tokenbatch.memory_model import estimate_memory
    from tokenbatch.probe import find_max_tokens, measure_peak

    torch.set_num_threads(1)
    model = build(case)
    limit, max_len = case["memory_limit"], case["max_len"]
    start = time.perf_counter()
    result = find_max_tokens(model, max_len=max_len, memory_limit=limit)
    probe_seconds = time.perf_counter() - start
    fit = result.fit
    assert fit is not None
    row: dict[str, Any] = {
        "model": case["name"],
        "attention": model.config._attn_implementation,
        "max_len": max_len,
        "memory_limit_mib": limit / MiB,
        "probe_seconds": probe_seconds,
        "probe_steps": result.steps,
        "suggested_max_tokens": result.max_tokens,
        "cost": {k: getattr(result.cost, k) for k in ("linear", "quadratic", "per_sample")},
        "fit": {k: getattr(fit, k) for k in ("constant", "linear", "quadratic", "per_sample", "step_peak")},
    }
    rng = np.random.default_rng(1)
    errors: list[float] = []
    shapes: list[tuple[int, int]] = []
    while len(shapes) < case["held_out"]:
        length = int(rng.integers(16, max_len + 1))
        size = int(result.max_tokens * rng.uniform(0.3, 1.0) // float(result.cost.sample_cost(length)))
        if size >= 1:
            shapes.append((size, length))
    for size, length in shapes:
        measured = measure_peak(model, size, length).peak_bytes
        errors.append(abs(fit.predict(size, length) / measured - 1))
    row["held_out_shapes"] = shapes
    row["held_out_median_error"] = statistics.median(errors)
    row["held_out_worst_error"] = max(errors)
    estimate = estimate_memory(model.config, device="cpu", attn_implementation=row["attention"])
    row["analytic_over_fit_linear"] = estimate.linear / fit.linear
    row["analytic_over_fit_quadratic"] = estimate.quadratic / fit.quadratic if fit.quadratic else None
    row["analytic_over_fit_sequence_at_max_len"] = float(
        estimate.cost_model().sample_cost(max_len) / fit.cost_model().sample_cost(max_len)
    )
    if quick and case["kind"] != "tiny":
        return row
    start = time.perf_counter()
    searched = find_max_tokens(model, max_len=max_len, memory_limit=limit, method="search", cost=result.cost)
    row["search_seconds"] = time.perf_counter() - start
    row["search_max_tokens"] = searched.max_tokens
    spec = {
        "kind": case["kind"], "cost": row["cost"], "memory_limit": limit,
        "lengths": [max_len, round(math.sqrt(16 * max_len)), 16],
    }  # fmt: skip
    allocators = [("mmap_threshold", False)] + ([] if quick else [("default_malloc", True)])
    for name, default_malloc in allocators:
        largest = ground_truth(spec, result.max_tokens, default_malloc, tolerance=0.05 if quick else 0.02)
        row[f"largest_{name}"] = largest
        row[f"fraction_{name}"] = result.max_tokens / largest
    return row


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    """The results as Markdown tables."""
    table = common.markdown_table(
        [
            {
                **row,
                "held-out error median / worst": (
                    f"{row['held_out_median_error']:.2%} / {row['held_out_worst_error']:.2%}"
                ),
                "probe": f"{row['probe_seconds']:.1f}s, {row['probe_steps']} steps",
                "suggested / largest real (mmap threshold)": row.get("fraction_mmap_threshold", "-"),
                "suggested / largest real (default malloc)": row.get("fraction_default_malloc", "-"),
                "search": (
                    f"{row['search_max_tokens']:,.0f} in {row['search_seconds']:.1f}s"
                    if "search_seconds" in row
                    else "-"
                ),
            }
            for row in rows
        ],
        [
            "model", "attention", "max_len", "memory_limit_mib", "probe", "suggested_max_tokens",
            "held-out error median / worst", "suggested / largest real (mmap threshold)",
            "suggested / largest real (default malloc)", "search",
        ],
    )  # fmt: skip
    analytic = common.markdown_table(
        rows,
        [
            "model", "analytic_over_fit_linear", "analytic_over_fit_quadratic",
            "analytic_over_fit_sequence_at_max_len",
        ],
    )  # fmt: skip
    return (
        "Probe on CPU (torch profiler memory accounting). Budgets are in the fitted cost model's "
        "token units. 'Largest real' = largest budget whose worst-case batches train in a child "
        "process under RLIMIT_AS set to the same memory limit. Other agents share this machine, "
        "so times are indicative only.\n\n"
        f"{table}\n\nAnalytic estimate (tokenbatch.memory_model) over the fitted terms:\n\n{analytic}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = common.parser("probe", __doc__.splitlines()[0] if __doc__ else "probe")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return 0
    cases: list[dict[str, Any]] = [
        {"name": "tiny-bert", "kind": "tiny", "max_len": 256, "memory_limit": 64 * MiB, "held_out": 8},
        {
            "name": "all-MiniLM-L6-v2", "kind": "minilm", "max_len": 128 if args.quick else 256,
            "memory_limit": (768 if args.quick else 1024) * MiB, "held_out": 3 if args.quick else 6,
        },
    ]  # fmt: skip
    rows = []
    for case in cases:
        print(f"probing {case['name']} ...", file=sys.stderr, flush=True)
        rows.append(run_case(case, args.quick))
    common.write_results("probe", args.out, {"quick": args.quick, "rows": rows}, markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
