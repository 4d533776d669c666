"""Plots and ``RESULTS.md`` from the per-benchmark results: ``python -m benchmarks.report``.

Reads ``<name>.json`` and ``<name>.md`` from the results folder, draws PNGs
beside them (matplotlib, Agg backend) and writes one Markdown page: a header
(machine, commands, how to reproduce), then a section per benchmark with a
short reading of its numbers, its plots and its tables.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.readings import READERS, headline

# "auto", "lr_scaling" and "trainer_lr" are run on their own, not by ``python -m benchmarks``:
# 15 minutes to over an hour each on CPU; "decoder_memory" too (3 minutes even with --quick),
# "fsdp_memory" and "fsdp_stop" (torchrun jobs, minutes each), and "lhotse_compare" (lhotse is an
# optional dependency).
MODULES = (
    "padding",
    "planning",
    "streaming",
    "lhotse_compare",
    "packing",
    "training",
    "lr_scaling",
    "trainer_lr",
    "oom_recovery",
    "growth",
    "probe",
    "auto",
    "gpu",
    "ddp_overlap",
    "decoder_memory",
    "fsdp_memory",
    "fsdp_stop",
)
# What a person wrote about a benchmark's figures (benchmarks/notes/<name>.md): kept apart from
# the generated results/<name>.md, so that rerunning a benchmark does not erase the reading.
NOTES = Path(__file__).resolve().parent / "notes"
TITLES = {
    "padding": "Padding and steps",
    "planning": "Planning speed",
    "streaming": "Streaming (TokenBudgetStream)",
    "lhotse_compare": "Against lhotse",
    "packing": "Padding-free packing: against TRL, transformers and axolotl",
    "training": "Training throughput (CPU)",
    "lr_scaling": "The seed's learning rate, scaled per step (CPU)",
    "trainer_lr": "The seed's learning rate, scaled per step, in TokenBudgetTrainer (CPU)",
    "oom_recovery": "OOM recovery",
    "growth": "Growth after OOM",
    "probe": "Budget probe",
    "auto": 'max_tokens="auto" under a memory limit',
    "gpu": "GPU",
    "ddp_overlap": "DDP step time under the guard (overlapped all-reduce)",
    "decoder_memory": "Decoder memory estimate",
    "fsdp_memory": "Memory estimate under FSDP2 (2 CPU processes)",
    "fsdp_stop": "Out of memory under FSDP2: every rank stopped, and the restart",
}
METHOD_STYLE = {
    "tokenbatch": ("tab:blue", "o"),
    "sorted_greedy": ("black", "x"),
    "random_fixed": ("tab:red", "^"),
    "length_grouped": ("tab:orange", "s"),
}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_padding(data: dict[str, Any], out: Path) -> list[str]:
    """Efficiency and steps / lower bound versus budget, one panel per data set and cost (1 process)."""
    plt = _pyplot()
    from matplotlib import ticker

    rows = [r for r in data["rows"] if r["processes"] == 1]
    panels = sorted(
        {(r["dataset"], r["cost"]) for r in rows}, key=lambda p: (list(data["datasets"]).index(p[0]), p[1])
    )
    written = []
    for metric, label, name in (
        ("efficiency", "padding efficiency (real / padded cost)", "padding_efficiency.png"),
        ("steps_over_lower_bound", "steps / lower bound (log)", "padding_steps.png"),
    ):
        columns = min(4, len(panels))
        lines = -(-len(panels) // columns)
        fig, axes = plt.subplots(lines, columns, figsize=(4 * columns, 3.3 * lines), squeeze=False)
        for ax, (dataset, cost) in zip(axes.flat, panels, strict=False):
            for method, (color, marker) in METHOD_STYLE.items():
                points = sorted(
                    (r["budget"], r[metric])
                    for r in rows
                    if (r["dataset"], r["cost"], r["method"]) == (dataset, cost, method)
                )
                if points:
                    # Dashed, so it shows where it coincides with random_fixed (same batch size).
                    style = "--" if method == "length_grouped" else "-"
                    ax.plot(*zip(*points, strict=True), style, color=color, marker=marker, label=method)
            ax.set_xscale("log", base=2)
            if metric == "steps_over_lower_bound":
                ax.set_yscale("log")
                ax.yaxis.set_major_formatter(ticker.FormatStrFormatter("%g"))
                low, high = ax.get_ylim()
                if high / low < 20:  # label minor ticks only where there are few of them
                    ax.yaxis.set_minor_formatter(ticker.FormatStrFormatter("%g"))
                    ax.tick_params(axis="y", which="minor", labelsize=7)
                else:
                    ax.yaxis.set_minor_formatter(ticker.NullFormatter())
            else:
                ax.set_ylim(0, 1.02)
            ax.set_title(f"{dataset}, {cost} cost", fontsize=10)
            ax.set_xlabel("budget (max_tokens)")
            ax.grid(alpha=0.3)
        for ax in axes.flat[len(panels) :]:
            ax.axis("off")
        axes[0][0].set_ylabel(label)
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=90)
        plt.close(fig)
        written.append(name)
    return written


def plot_planning(data: dict[str, Any], out: Path) -> list[str]:
    """Planning time versus N on log axes, with numpy.argsort beside it."""
    plt = _pyplot()
    rows = data["rows"]
    n = [r["n"] for r in rows]
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for key, label, style in (
        ("first_plan_s", "sampler built + first plan", "o-"),
        ("epoch_plan_s", "each later epoch's plan", "s-"),
        ("argsort_s", "numpy.argsort (same array)", "x--"),
    ):
        ax.plot(n, [r[key] for r in rows], style, label=label)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("number of lengths N")
    ax.set_ylabel("seconds (median)")
    ax.grid(alpha=0.3, which="both")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "planning_time.png", dpi=90)
    plt.close(fig)
    return ["planning_time.png"]


def plot_training(data: dict[str, Any], out: Path, name: str) -> list[str]:
    """Real tokens per second per method, from any rows that carry a ``*tokens_per_s`` value."""
    rows = data.get("rows")
    if not isinstance(rows, list):
        return []
    bars = []
    for row in rows:
        if not isinstance(row, dict):
            continue
        key = next((k for k in row if "tokens_per_s" in k and isinstance(row[k], int | float)), None)
        if key is None:
            continue
        label = str(row.get("method", "?"))
        if "processes" in row:
            label += f" ({row['processes']}p)"
        bars.append((label, float(row[key])))
    if not bars:
        return []
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * len(bars)), 4))
    ax.bar([b[0] for b in bars], [b[1] for b in bars], color="tab:blue")
    ax.set_ylabel("real tokens per second")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    fig.tight_layout()
    file = f"{name}_tokens_per_s.png"
    fig.savefig(out / file, dpi=90)
    plt.close(fig)
    return [file]


def plot_lhotse(data: dict[str, Any], out: Path) -> list[str]:
    """tokenbatch beside lhotse per data set and mode (1 rank): four figures, one panel each."""
    plt = _pyplot()
    rows = [r for r in data["rows"] if r["ranks"] == 1]
    groups = list(dict.fromkeys((r["dataset"], r["mode"]) for r in rows))
    pick = {(r["dataset"], r["mode"], r["method"]): r for r in rows}
    panels = (
        ("steps_over_lower_bound", "steps / lower bound", False),
        ("efficiency", "padding efficiency (real / padded tokens)", False),
        ("max_budget_use", "costliest batch / budget", False),
        ("examples_per_s", "examples per second (log)", True),
    )
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.8))
    width = 0.38
    for ax, (key, label, log) in zip(axes, panels, strict=True):
        for offset, method, color in (
            (-width / 2, "tokenbatch", "tab:blue"),
            (width / 2, "lhotse", "tab:gray"),
        ):
            values = [pick[g[0], g[1], method][key] for g in groups]
            ax.bar([i + offset for i in range(len(groups))], values, width, color=color, label=method)
        if key == "max_budget_use":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        if log:
            ax.set_yscale("log")
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([f"{d}\n{m}" for d, m in groups], fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "lhotse_compare.png", dpi=90)
    plt.close(fig)
    return ["lhotse_compare.png"]


def plot_packing(data: dict[str, Any], out: Path) -> list[str]:
    """Fill (1 rank), attention balance and real tokens/s (2 ranks) per method, a bar per data set."""
    plt = _pyplot()
    rows = [r for r in data["rows"] if "skipped" not in r]
    methods = list(dict.fromkeys(r["method"] for r in rows))
    names = list(data["datasets"])
    panels = (
        ("fill", 1, "fill: real tokens / budget (1 rank)"),
        ("balance_L2", 2, "largest / mean rank, attention work (2 ranks)"),
        ("tokens_per_s", 2, "real tokens/s, CPU (2 processes)"),
    )
    panels = tuple(p for p in panels if any(p[0] in r for r in rows))
    fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 4.2), squeeze=False)
    width = 0.8 / max(1, len(names))
    for ax, (key, ranks, title) in zip(axes[0], panels, strict=True):
        for number, name in enumerate(names):
            pick = {r["method"]: r for r in rows if r["dataset"] == name and r["processes"] == ranks}
            values = [pick[m].get(key, 0.0) if m in pick else 0.0 for m in methods]
            ax.bar([i + number * width for i in range(len(methods))], values, width, label=name)
        if key == "balance_L2":
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
        ax.set_xticks([i + width * (len(names) - 1) / 2 for i in range(len(methods))])
        ax.set_xticklabels(methods, rotation=35, ha="right", fontsize=7)
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "packing.png", dpi=90)
    plt.close(fig)
    return ["packing.png"]


PLOTTERS = {"padding": plot_padding, "planning": plot_planning, "lhotse_compare": plot_lhotse}
PLOTTERS["packing"] = plot_packing


def variants(results_dir: Path, name: str) -> list[Path]:
    """Other settings of benchmark ``name``: ``<name>-<variant>.json`` (see common.write_results)."""
    return sorted(results_dir.glob(f"{name}-*.json"))


def header(results: dict[str, dict[str, Any]], extra_commands: list[str]) -> str:
    machine = next(iter(results.values()))["machine"] if results else common.machine_info()
    commands = "\n".join(f"    {c}" for c in [*(r["command"] for r in results.values()), *extra_commands])
    return f"""# tokenbatch benchmarks

Measured side by side in one run of the suite on: {machine["cpu"]}, {machine["cores"]} cores,
Python {machine["python"]}, torch {machine["torch"]}, GPU: {machine["cuda"] or "none"}.
The machine is shared with other jobs: times are medians of repeats, and
comparisons are ratios measured side by side in the same run, never across runs.

Commands that produced these results:

{commands}

Reproduce everything (from the repository root, with the `benchmarks` extra installed):

    python -m benchmarks            # full runs, writes benchmarks/results/ and this page
    python -m benchmarks --quick    # about a minute per benchmark; the smoke test runs this
    python -m benchmarks --only padding
    python -m benchmarks.report     # redraw plots and this page from benchmarks/results/
"""


def assemble(results_dir: Path, output: Path) -> tuple[str, list[str]]:
    """The RESULTS.md text (to be written at ``output``) and the plots drawn for it."""
    results = {}
    for name in MODULES:
        path = results_dir / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    extra = {name: variants(results_dir, name) for name in results}
    extra_commands = [json.loads(p.read_text())["command"] for paths in extra.values() for p in paths]
    parts = [header(results, extra_commands), headline(results)]
    plots = []
    for name, data in results.items():
        parts.append(f"## {TITLES[name]}\n")
        reading = READERS.get(name)
        if reading is not None:
            parts.append(reading(data) + "\n")
        plotter = PLOTTERS.get(name)
        drawn = plotter(data, results_dir) if plotter else []
        if name == "training" and not data.get("skipped"):
            drawn += plot_training(data, results_dir, name)
        for file in drawn:
            parts.append(f"![{file}]({os.path.relpath(results_dir / file, output.parent)})\n")
        plots += drawn
        notes = NOTES / f"{name}.md"
        for md in [results_dir / f"{name}.md", *(p.with_suffix(".md") for p in extra[name]), notes]:
            if md.exists():
                # Demote the benchmark's own headings below this page's section heading.
                parts.append(
                    "\n".join(
                        "#" + line if line.startswith("#") else line for line in md.read_text().splitlines()
                    )
                )
                parts.append("")
    missing = [m for m in MODULES if m not in results]
    if missing:
        parts.append(f"Not in this run (module missing or not run): {', '.join(missing)}.\n")
    return "\n".join(parts), plots


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=common.RESULTS, help="folder with <name>.json/.md")
    parser.add_argument("--output", type=Path, default=common.REPO / "benchmarks" / "RESULTS.md")
    args = parser.parse_args(argv)
    text, plots = assemble(args.results.resolve(), args.output.resolve())
    args.output.write_text(text.rstrip() + "\n")
    print(f"[report] wrote {args.output} and {len(plots)} plot(s): {', '.join(plots)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
