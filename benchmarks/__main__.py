"""Run the benchmark suite: ``python -m benchmarks [--quick | --smoke] [--out DIR] [--only NAME ...]``.

Each benchmark runs in its own subprocess (a crash or a leaked thread
setting in one cannot skew the next), with the repository on ``PYTHONPATH``.
Modules not written yet are skipped with a note. Afterwards
``benchmarks.report`` draws the plots and assembles ``RESULTS.md``: into
``benchmarks/RESULTS.md`` for the default ``--out``, else into ``DIR``.
``--quick`` defaults to ``--out benchmarks/results-quick``, so that it never
overwrites the committed results; pass ``--out`` to choose. ``--smoke`` (for
``tests/test_benchmarks_smoke.py``) is ``--quick`` cut to the fewest steps that
still write every field: it checks that the suite runs, not what it measures.
The exit status is 1 if any benchmark failed.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks import common, report

MODULES = ("padding", "planning", "training", "oom_recovery", "probe", "gpu", "streaming", "packing")
HERE = Path(__file__).resolve().parent


def run_module(name: str, quick: bool, out: Path, smoke: bool = False) -> tuple[str, float]:
    """Run ``benchmarks.<name>`` in a subprocess; returns its status and seconds."""
    if not (HERE / f"{name}.py").exists():
        print(f"[benchmarks] {name}: not written yet (no benchmarks/{name}.py), skipped", flush=True)
        return "missing", 0.0
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
    env.setdefault("HF_HUB_OFFLINE", "1")  # everything needed ships in packages or ../shared
    size = ["--smoke"] if smoke else ["--quick"] if quick else []
    command = [sys.executable, "-m", f"benchmarks.{name}", *size]
    if out != common.output_folder(None, quick).resolve():  # implicit defaults keep commands portable
        command += ["--out", str(out)]
    print(f"[benchmarks] {name}: {' '.join(command[1:])}", flush=True)
    start = time.perf_counter()
    returncode = subprocess.run(command, env=env, cwd=common.REPO, check=False).returncode
    seconds = time.perf_counter() - start
    status = "ok" if returncode == 0 else f"failed (exit {returncode})"
    print(f"[benchmarks] {name}: {status} in {seconds:.1f} s", flush=True)
    return status, seconds


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the quick version of every benchmark")
    parser.add_argument(
        "--smoke", action="store_true", help="for the tests: the fewest steps that write every field"
    )
    parser.add_argument(
        "--out", type=Path, help="where results go (default benchmarks/results; results-quick with --quick)"
    )
    parser.add_argument(
        "--only", action="append", choices=MODULES, metavar="NAME", help=f"run only NAME, one of {MODULES}"
    )
    parser.add_argument("--no-report", action="store_true", help="do not draw plots or write RESULTS.md")
    args = parser.parse_args(argv)
    quick = args.quick or args.smoke
    out = common.output_folder(args.out, quick).resolve()
    statuses = {name: run_module(name, quick, out, args.smoke) for name in (args.only or MODULES)}
    print("[benchmarks] summary:")
    for name, (status, seconds) in statuses.items():
        print(f"  {name:<13} {status:<22} {seconds:6.1f} s")
    if not args.no_report:
        output = HERE / "RESULTS.md" if out == common.RESULTS.resolve() else out / "RESULTS.md"
        report.main(["--results", str(out), "--output", str(output)])
    return int(any(status.startswith("failed") for status, _ in statuses.values()))


if __name__ == "__main__":
    sys.exit(main())
