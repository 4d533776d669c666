"""GPU benchmark, one command, run blind: the seed's story on bert-base, precisions, and DDP on 2+ GPUs.

``python -m benchmarks.gpu`` on a CUDA machine with no network (bert-base
built from its config, the packaged all-MiniLM-L6-v2, synthetic IMDB-like
lengths up to 512 tokens) runs within ``--cap`` seconds (default 300) and
writes ``gpu.json`` and ``gpu.md``. Each section runs on its own; whatever
one cannot measure (no second GPU, out of time, an error) is recorded with
its reason and the next one runs:

1. **seed**: accelerate's ``find_executable_batch_size`` from 2048 rows at
   max_length 512 on bert-base (restarts, seconds lost, the batch size it
   settles at), then its fixed random batches trained for a while;
2. **tokenbatch**: the same model and data from the probe's budget
   (``find_max_tokens``) under ``OOMFallback``, with one injected OOM (its
   recovery time); and ``max_tokens="auto"`` where this tokenbatch has it;
3. **precision**: all-MiniLM-L6-v2 and bert-base, fp32 and bf16 (fp16 with
   a GradScaler where bf16 is missing): tokens/s, peak memory, steps/epoch,
   recovery from one injected OOM;
4. **DDP** (2+ GPUs): ``benchmarks.ddp_overlap --device cuda``, the guard's
   overlapped path and its average-after path against plain DDP;
5. **packing**: a Llama (8 layers, hidden 1024) in bf16 on padded batches,
   tokenbatch's packs and TRL's padding-free fixed count, each under the same
   budget of 16384 tokens, with flash-attention 2's varlen kernel where
   ``flash_attn`` is installed (else sdpa, and the section says so):
   ``benchmarks.packing.gpu_rows``.

Without CUDA it exits 0 with a report saying so. ``--device cpu --tiny``
runs every section with tiny models and a simulated memory limit (the
tests do; the numbers mean nothing).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks import common, packing
from benchmarks import gpu_runs as runs

SEED_START = 2048


def start_rows(setup: runs.Setup) -> int:
    """The seed's starting batch size (tiny: fewer restarts, the same search)."""
    return 256 if setup.tiny else SEED_START


class OutOfTime(Exception):
    """The section ran into the benchmark's time cap."""


class Sections:
    """Each measurement under the time cap; a failure or a missing resource becomes a skip with a reason."""

    def __init__(self, cap_s: float, device: torch.device) -> None:
        self.cap_s, self.device = cap_s, device
        self.deadline = time.monotonic() + cap_s
        self.done: list[dict[str, Any]] = []

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def skip(self, name: str, reason: str) -> None:
        print(f"[gpu] {name}: skipped: {reason}", flush=True)
        self.done.append({"name": name, "status": "skipped", "reason": reason})

    def run(
        self, name: str, fn: Callable[[], dict[str, Any]], *, needs_s: float = 10.0
    ) -> dict[str, Any] | None:
        left = self.left()
        if left < needs_s:
            self.skip(
                name, f"the {self.cap_s:.0f} s cap: {max(left, 0):.0f} s left, it needs about {needs_s:.0f} s"
            )
            return None
        timer = _alarm(left)
        started = time.perf_counter()
        try:
            result = fn()
        except (Exception, OutOfTime) as error:
            reason = (
                f"{type(error).__name__}: {str(error).strip().splitlines()[0] if str(error).strip() else ''}"
            )
            if isinstance(error, OutOfTime):
                reason = f"the {self.cap_s:.0f} s cap was reached during it"
            self.skip(name, reason[:500])
            self.done[-1]["traceback"] = traceback.format_exc()[-3000:]
            return None
        finally:
            timer()
            runs.reset_memory(self.device)
        seconds = time.perf_counter() - started
        print(f"[gpu] {name}: done in {seconds:.0f} s", flush=True)
        self.done.append({"name": name, "status": "ok", "seconds": seconds, **result})
        return result


def _alarm(seconds: float) -> Callable[[], None]:
    """Raise :class:`OutOfTime` in the main thread after ``seconds``; returns the function that disarms it."""
    if not hasattr(signal, "setitimer"):
        return lambda: None

    def expired(signum: int, frame: Any) -> None:
        raise OutOfTime()

    try:
        previous = signal.signal(signal.SIGALRM, expired)
    except ValueError:  # not the main thread: no timer, the cap is checked between sections only
        return lambda: None
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 0.01))

    def disarm() -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)

    return disarm


def seed(setup: runs.Setup, precision: str) -> dict[str, Any]:
    found = runs.seed_batch_size(setup, start=start_rows(setup), precision=precision)
    size = found["settled_batch_size"]
    model = runs.build_model("bert-base", tiny=setup.tiny, device=setup.device)
    trained = runs.train_timed(model, runs.fixed_loader(setup, size), setup, precision)
    row = {"method": "find_executable_batch_size", "model": "bert-base", "precision": precision}
    row.update(batch=f"{size} rows", **found, **trained)
    row["steps_per_epoch"] = math.ceil(len(setup.lengths) / size)
    return {"rows": [{**row, **runs.memory(setup.device)}]}


def budgeted(name: str, setup: runs.Setup, precision: str, *, auto: bool = False) -> dict[str, Any]:
    """``name`` trained under ``OOMFallback`` from the probe's budget (or ``max_tokens="auto"``)."""
    import tokenbatch
    from tokenbatch import OOMFallback, TokenBudgetBatchSampler

    model = runs.build_model(name, tiny=setup.tiny, device=setup.device)
    if auto:
        resolve = getattr(tokenbatch, "auto_budget", None)
        if resolve is None:
            raise NotImplementedError("this tokenbatch has no max_tokens='auto' (tokenbatch.auto_budget)")
        sampler = TokenBudgetBatchSampler(setup.lengths, "auto", seed=0)  # type: ignore[arg-type]
        started = time.perf_counter()
        limit = None if setup.device.type == "cuda" else 2**26 if setup.tiny else 2**30
        saved = os.environ.get("TOKENBATCH_CACHE")
        with tempfile.TemporaryDirectory() as cache, runs.autocast(setup.device, precision):
            os.environ["TOKENBATCH_CACHE"] = str(Path(cache) / "budgets.json")  # not the user's budgets
            try:
                resolve(model, sampler, memory_limit=limit)
            finally:
                os.environ.pop("TOKENBATCH_CACHE")
                if saved is not None:
                    os.environ["TOKENBATCH_CACHE"] = saved
        probe = {"max_tokens": sampler.max_tokens, "probe_s": time.perf_counter() - started}
    else:
        probe = runs.probe_budget(model, setup, precision)
        sampler = TokenBudgetBatchSampler(setup.lengths, probe["max_tokens"], cost=probe["cost"], seed=0)
    runs.reset_memory(setup.device)
    fallback = OOMFallback(sampler, model, mode="split")
    trained = runs.train_timed(
        model,
        runs.budget_loader(setup, sampler),
        setup,
        precision,
        fallback=fallback,
        inject_after=1 if setup.tiny else 3,
    )
    method = "tokenbatch, max_tokens='auto'" if auto else "tokenbatch, probe's budget"
    row = {
        "method": method,
        "model": name,
        "precision": precision,
        "batch": f"{probe['max_tokens']:.0f} budget",
    }
    row.update(probe_s=probe["probe_s"], steps_per_epoch=len(sampler), **trained, **runs.memory(setup.device))
    return {"rows": [row]}


def ddp(setup: runs.Setup, sections: Sections) -> dict[str, Any]:
    count = torch.cuda.device_count() if setup.device.type == "cuda" else 0
    if count < 2:
        raise RuntimeError(f"needs 2 or more CUDA devices, found {count}")
    with tempfile.TemporaryDirectory() as out:
        command = [
            sys.executable,
            "-m",
            "benchmarks.ddp_overlap",
            "--device",
            "cuda",
            "--quick",
            "--out",
            out,
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(p for p in (str(common.REPO), os.environ.get("PYTHONPATH")) if p),
        }
        subprocess.run(command, env=env, cwd=common.REPO, check=True, timeout=max(sections.left() - 5, 1))
        import json

        return {"rows": json.loads((Path(out) / "ddp_overlap.json").read_text())["rows"]}


COLUMNS = ["method", "model", "precision", "batch", "restarts", "seconds_to_settle", "probe_s"]
COLUMNS += ["steps_per_epoch"]
COLUMNS += ["real_tokens_per_s", "median_step_s", "recovery_s", "peak_memory_fraction"]
COLUMNS += ["attention", "fill"]
DDP_COLUMNS = ["model", "arm", "median step ms", "vs plain DDP"]


def markdown(info: str, sections: list[dict[str, Any]]) -> str:
    parts = [info]
    first = [s["rows"][0] for s in sections[:2] if s["status"] == "ok"]
    if len(first) == 2 and first[0].get("real_tokens_per_s") and first[1].get("real_tokens_per_s"):
        ratio = first[1]["real_tokens_per_s"] / first[0]["real_tokens_per_s"]
        parts.append(
            f"tokenbatch from the probe's budget / find_executable_batch_size, real tokens per second on "
            f"bert-base: **{ratio:.2f}x**; the seed's search took {first[0]['seconds_to_settle']:.0f} s "
            f"and {first[0]['restarts']} restarts, the probe {first[1]['probe_s']:.0f} s."
        )
    for section in sections:
        parts.append(f"### {section['name']}")
        if section["status"] != "ok":
            parts.append(f"Skipped: {section['reason']}")
            continue
        columns = DDP_COLUMNS if section["name"].startswith("DDP") else COLUMNS
        rows = section["rows"]
        parts.append(common.markdown_table(rows, [c for c in columns if any(c in r for r in rows)]))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.parser("gpu", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument(
        "--device", default="cuda", help="cuda (default), or cpu with --tiny to check the script"
    )
    parser.add_argument("--tiny", action="store_true", help="tiny models, simulated memory limit (for tests)")
    parser.add_argument("--cap", type=float, default=300.0, help="seconds for everything (default 300)")
    args = parser.parse_args(argv)
    try:
        cuda = torch.cuda.is_available()
    except Exception:  # a broken driver says no the same way
        cuda = False
    if args.device.startswith("cuda") and not cuda:
        reason = "CUDA is not available on this machine; the GPU benchmark was skipped"
        print(reason)
        common.write_results("gpu", args.out, {"skipped": True, "reason": reason}, f"Skipped: {reason}.")
        return 0
    device = torch.device(args.device)
    tiny = args.tiny or device.type != "cuda"
    max_length = 16 if tiny else 512
    count = 200 if tiny else (4000 if args.quick else 20000)
    setup = runs.Setup(
        device,
        runs.make_lengths(count, max_length),
        max_length,
        0.5 if tiny else 10.0,
        tiny,
        simulated_limit=1024.0 if device.type != "cuda" else None,
    )
    precision = runs.precision_for(device)
    sections = Sections(args.cap, device)
    sections.run(
        f"seed: find_executable_batch_size from {start_rows(setup)}, bert-base, {precision}",
        lambda: seed(setup, precision),
        needs_s=30,
    )
    sections.run(
        f"tokenbatch: bert-base, {precision}", lambda: budgeted("bert-base", setup, precision), needs_s=30
    )
    sections.run(
        "tokenbatch: bert-base, max_tokens='auto'",
        lambda: budgeted("bert-base", setup, precision, auto=True),
        needs_s=30,
    )
    sections.run("DDP: guard vs plain DDP, 2 GPUs", lambda: ddp(setup, sections), needs_s=40)
    sections.run(
        "packing: padded, packed and a fixed count, Llama, flash-attention varlen",
        lambda: packing.gpu_rows(setup.device, setup.lengths, 64 if tiny else 16384, tiny=tiny),
        needs_s=60,
    )
    for name, other in (("minilm", precision), ("bert-base", "fp32"), ("minilm", "fp32")):
        sections.run(f"precision: {name}, {other}", lambda n=name, o=other: budgeted(n, setup, o), needs_s=25)  # type: ignore[misc]
    info = common.machine_info()
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    note = (
        f"Device: {info['cuda'] or args.device}"
        + (f" ({total / 2**30:.0f} GiB)" if total else "")
        + f", {torch.cuda.device_count() if cuda else 0} CUDA device(s), torch {info['torch']}. "
        f"{len(setup.lengths)} synthetic IMDB-like lengths up to {max_length} tokens; each training "
        f"runs {setup.seconds:g} s; cap {args.cap:.0f} s, used {args.cap - sections.left():.0f} s."
        + (" TINY models and a SIMULATED memory limit: a check of the script, not figures." if tiny else "")
    )
    results = {
        "skipped": False,
        "device": str(device),
        "tiny": tiny,
        "cap_s": args.cap,
        "sections": sections.done,
    }
    common.write_results("gpu", args.out, results, markdown(note, sections.done))
    return 0


if __name__ == "__main__":
    sys.exit(main())
