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
  (``tokenbatch.probe.MemoryModel.from_config``) against the fit.

Usage: ``python -m benchmarks.probe [--quick] [--out DIR]``. ``--quick`` runs
the tiny BERT only (a MiniLM probe alone takes most of a minute on CPU: every
step that lifts its forward + backward peak above the optimizer step's holds a
thousand tokens or more), skips the default-malloc ground truth, and brackets
the largest budget to 5% instead of 2%. Ground-truth trials run in forks of
one warmed-up server process per model and allocator setting (see
:func:`serve`), so each trial costs its training steps, not an interpreter
start.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
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


def serve(spec: dict[str, Any]) -> None:
    """The trial server: build and warm up the model once, then for each request on stdin (a JSON
    line ``{"cost": {...}, "budgets": [...]}``) run one trial per budget, each in a fork of this
    process, and print their results as one JSON line.

    A trial asks: do the worst-case batches of the budget train under RLIMIT_AS set to the memory
    limit (calibrated against the fork's own VmSize)? Each fork starts from the state of a fresh
    process after its warm-up, and no trial sees what an earlier one's failed allocations did to
    glibc's heap; only the server pays for importing torch and building the model.
    """
    import accelerate.utils.memory  # noqa: F401  (is_oom asks it; not to be imported under the limit)
    import torch

    from tokenbatch import CostModel, is_oom
    from tokenbatch.probe._measure import default_loss, held_bytes, synthetic_batch

    torch.set_num_threads(1)  # also: no OpenMP thread pool for the forks to inherit
    model = build(spec).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    generator = torch.Generator().manual_seed(0)

    def step(size: int, length: int) -> None:
        batch = synthetic_batch(model, size, length, generator)
        default_loss(model(**batch), batch).backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def trial(cost: CostModel, budget: float) -> dict[str, Any]:
        base = common.vm_status("VmSize")
        allowed = spec["memory_limit"] - held_bytes(model, optimizer)
        resource.setrlimit(resource.RLIMIT_AS, (base + allowed, resource.RLIM_INFINITY))
        for length in spec["lengths"]:
            size = int(budget // float(cost.sample_cost(length)))
            if size < 1:
                continue
            try:
                step(size, length)
            except Exception as error:
                resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
                if not is_oom(error):
                    raise
                return {"ok": False, "failed": [size, length]}
        return {"ok": True, "growth_over_allowed": (common.vm_status("VmPeak") - base) / allowed}

    step(1, 16)  # warm-up: optimizer state, kernels
    for line in iter(sys.stdin.readline, ""):
        request = json.loads(line)
        cost = CostModel(**request["cost"])
        children = [common.start_in_fork(functools.partial(trial, cost, b)) for b in request["budgets"]]
        results = []
        for pid, pipe in children:
            with os.fdopen(pipe) as handle:
                results.append(json.loads(handle.read()))
            os.waitpid(pid, 0)
        print(json.dumps(results), flush=True)


class TrialServer:
    """Runs :func:`serve` in a fresh interpreter with the allocator settings a trial needs.

    ``spec`` names the model (``kind``), the ``memory_limit`` and the ``lengths`` of the
    worst-case batches; the cost model comes with each request, so a server can start (and
    import torch) before the probe has fitted one.
    """

    def __init__(self, spec: dict[str, Any], default_malloc: bool) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
        env["PYTHONPATH"] = os.pathsep.join([str(common.REPO), env.get("PYTHONPATH", "")])
        if default_malloc:
            env.pop("MALLOC_MMAP_THRESHOLD_", None)
        else:
            env["MALLOC_MMAP_THRESHOLD_"] = "65536"
        # A file, not a pipe: it never fills up; closed in close().
        self.stderr = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.probe", "--child", json.dumps(spec)],
            env=env,
            cwd=common.REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            text=True,
        )

    def run(self, cost: dict[str, float], budgets: Sequence[float]) -> list[bool]:
        """Whether each budget (in units of ``cost``) trains under the limit; the trials run at once."""
        assert self.process.stdin is not None and self.process.stdout is not None
        self.process.stdin.write(json.dumps({"cost": cost, "budgets": list(budgets)}) + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        results = json.loads(line) if line else None
        if not results or any("crash" in r for r in results):
            self.stderr.seek(0)
            raise RuntimeError(f"ground-truth trial failed: {results}\n{self.stderr.read()[-3000:]}")
        return [bool(r["ok"]) for r in results]

    def close(self) -> None:
        """Stop the server: it holds nothing worth a clean exit, which takes seconds with torch loaded."""
        if self.process.stdin is not None:
            self.process.stdin.close()
        self.process.kill()
        self.process.wait(timeout=60)
        self.stderr.close()


def ground_truth(server: TrialServer, cost: dict[str, float], start: float, tolerance: float = 0.02) -> float:
    """The largest budget that trains under the limit, to ``tolerance``: bracket it (starting
    from 0.8 and 1.25 times ``start``), then split the bracket in three with two trials at a time."""
    low, high = 0.8 * start, 1.25 * start
    ok_low, ok_high = server.run(cost, [low, high])
    while not ok_low:
        high, low = low, low / 2
        (ok_low,) = server.run(cost, [low])
    while ok_high:
        low, high = high, 2 * high
        (ok_high,) = server.run(cost, [high])
    while high / low > 1 + tolerance:
        ratio = high / low
        one, two = low * ratio ** (1 / 3), low * ratio ** (2 / 3)
        ok_one, ok_two = server.run(cost, [one, two])
        if ok_two:
            low = two
        elif ok_one:
            low, high = one, two
        else:
            high = one
    return low


def server_spec(case: dict[str, Any]) -> dict[str, Any]:
    """What a :class:`TrialServer` for ``case`` needs: the worst-case lengths are the longest, the
    geometric middle and 16."""
    max_len = case["max_len"]
    lengths = [max_len, round(math.sqrt(16 * max_len)), 16]
    return {"kind": case["kind"], "memory_limit": case["memory_limit"], "lengths": lengths}


def run_case(
    case: dict[str, Any], quick: bool, servers: dict[str, TrialServer], *, tolerance: float | None = None
) -> dict[str, Any]:
    """Probe one model and measure everything the module docstring lists.

    ``servers`` may hold trial servers already started, by allocator name; the rest start here.
    ``tolerance``: how closely the largest real budget is bracketed (default 5% quick, else 2%).
    """
    import torch

    from tokenbatch.probe import MemoryModel, find_max_tokens
    from tokenbatch.probe._measure import measure_peak

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
    estimate = MemoryModel.from_config(model.config, device="cpu", attn_implementation=row["attention"])
    row["analytic_over_fit_linear"] = estimate.linear / fit.linear
    row["analytic_over_fit_quadratic"] = estimate.quadratic / fit.quadratic if fit.quadratic else None
    row["analytic_over_fit_sequence_at_max_len"] = float(
        estimate.cost_model().sample_cost(max_len) / fit.cost_model().sample_cost(max_len)
    )
    start = time.perf_counter()
    searched = find_max_tokens(model, max_len=max_len, memory_limit=limit, method="search", cost=result.cost)
    row["search_seconds"] = time.perf_counter() - start
    row["search_max_tokens"] = searched.max_tokens
    allocators = [("mmap_threshold", False)] + ([] if quick else [("default_malloc", True)])
    for name, default_malloc in allocators:
        server = servers.pop(name, None) or TrialServer(server_spec(case), default_malloc)
        try:
            largest = ground_truth(
                server, row["cost"], result.max_tokens, tolerance=tolerance or (0.05 if quick else 0.02)
            )
        finally:
            server.close()
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
            "model",
            "attention",
            "max_len",
            "memory_limit_mib",
            "probe",
            "suggested_max_tokens",
            "held-out error median / worst",
            "suggested / largest real (mmap threshold)",
            "suggested / largest real (default malloc)",
            "search",
        ],
    )
    analytic = common.markdown_table(
        rows,
        [
            "model",
            "analytic_over_fit_linear",
            "analytic_over_fit_quadratic",
            "analytic_over_fit_sequence_at_max_len",
        ],
    )
    return (
        "Probe on CPU (torch profiler memory accounting). Budgets are in the fitted cost model's "
        "token units. 'Largest real' = largest budget whose worst-case batches train in a child "
        "process under RLIMIT_AS set to the same memory limit. Other agents share this machine, "
        "so times are indicative only.\n\n"
        f"{table}\n\nAnalytic estimate (tokenbatch.probe.MemoryModel.from_config) "
        f"over the fitted terms:\n\n{analytic}\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = common.parser("probe", __doc__.splitlines()[0] if __doc__ else "probe")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        serve(json.loads(args.child))
        return 0
    cases: list[dict[str, Any]] = [
        {"name": "tiny-bert", "kind": "tiny", "max_len": 256, "memory_limit": 64 * MiB, "held_out": 8},
    ]
    if not args.quick:
        # Its steps take a second or more each on CPU, and only batches of a thousand tokens and up
        # lift the forward + backward peak clear of the optimizer step's (AdamW: 436 MiB).
        cases.append(
            {
                "name": "all-MiniLM-L6-v2",
                "kind": "minilm",
                "max_len": 256,
                "memory_limit": 1024 * MiB,
                "held_out": 6,
            }
        )
    # The first trial server imports torch and builds its model while this process does the same
    # (untimed), and usually waits idle by the time the probe is timed; the others start when their
    # turn comes, after the probe and the search they might slow down.
    first = {"mmap_threshold": TrialServer(server_spec(cases[0]), default_malloc=False)}
    rows = []
    try:
        for index, case in enumerate(cases):
            print(f"probing {case['name']} ...", file=sys.stderr, flush=True)
            if args.smoke:  # the fewest held-out shapes and bisection steps that still fill every field
                case["held_out"] = 2
            tolerance = 0.25 if args.smoke else None
            rows.append(run_case(case, args.quick, first if index == 0 else {}, tolerance=tolerance))
    finally:
        for server in first.values():  # left over only when the case failed before its ground truth
            server.close()
    common.write_results("probe", args.out, {"quick": args.quick, "rows": rows}, markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
