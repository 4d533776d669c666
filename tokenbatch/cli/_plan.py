"""``tokenbatch plan``: see an epoch's plan before spending GPU hours on it (and ``--plot`` it).

Examples::

    tokenbatch plan --data train.jsonl --tokenizer bert-base-cased --max-length 512 --max-tokens 16384
    tokenbatch plan --lengths lengths.txt --max-tokens 65536 --attention 512 --compare --json
    tokenbatch plan --dataset ./tokenized --split train --max-tokens 16384 --plot plan.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np

from tokenbatch import _checks, compare
from tokenbatch.cost import CostModel
from tokenbatch.plan import OVERSIZE_POLICIES, OversizeSampleError, lower_bound_steps
from tokenbatch.sampler import TokenBudgetBatchSampler

_TEXT_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}


def register(subparsers: Any) -> None:
    """Add ``plan`` to the ``tokenbatch`` command line."""
    parser = subparsers.add_parser(
        "plan",
        help="show the batches a token budget makes for your data",
        description="Plan one epoch under a token budget and print what it looks like.",
    )
    source = parser.add_argument_group("lengths (exactly one of --lengths, --dataset, --data)")
    what = source.add_mutually_exclusive_group(required=True)
    what.add_argument("--lengths", type=Path, help="a file of integers (text, one or more per line) or .npy")
    what.add_argument("--dataset", type=Path, help="a datasets dataset saved with save_to_disk")
    what.add_argument("--data", type=Path, help="a JSON Lines, CSV or Parquet file with a text column")
    source.add_argument("--split", help="split of a saved DatasetDict (default: train)")
    source.add_argument(
        "--column", help="--dataset: sequence or length column (default: length, else input_ids)"
    )
    source.add_argument("--text-column", default="text", help="--data: the text column (default: text)")
    source.add_argument("--tokenizer", help="--data: tokenizer name or path, as for AutoTokenizer")
    source.add_argument("--max-length", type=int, help="--data: truncate at this many tokens")
    plan = parser.add_argument_group("plan")
    plan.add_argument("--max-tokens", type=_budget, required=True, help="the budget, in cost units")
    plan.add_argument("--attention", type=float, metavar="CROSSOVER", help="CostModel.attention(CROSSOVER)")
    plan.add_argument("--linear", type=float, default=1.0, help="cost per padded token (default 1)")
    plan.add_argument("--quadratic", type=float, default=0.0, help="cost per token pair (default 0)")
    plan.add_argument("--per-sample", type=float, default=0.0, help="cost per sequence (default 0)")
    plan.add_argument("--pad-to-multiple-of", type=int, default=1)
    plan.add_argument("--num-replicas", type=int, default=1, help="processes (default 1)")
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument("--epoch", type=int, default=0)
    plan.add_argument("--max-batch-size", type=int)
    plan.add_argument("--batch-size-multiple", type=int, default=1)
    plan.add_argument("--oversize", choices=OVERSIZE_POLICIES, default="error")
    output = parser.add_argument_group("output")
    output.add_argument(
        "--compare", action="store_true", help="add fixed batches at the same worst-case memory"
    )
    output.add_argument("--json", action="store_true", help="print JSON instead of text")
    output.add_argument("--plot", type=Path, metavar="FILE.png", help="draw batch size against length")
    parser.set_defaults(func=run)


def _budget(text: str) -> float:
    """``--max-tokens``: a number; ``auto`` is refused, saying where a number comes from."""
    if text.strip().lower() == "auto":
        # "auto" resolves from a model (the remembered budget, else the probe); plan runs none.
        raise argparse.ArgumentTypeError(
            "auto needs a model and tokenbatch plan runs none: measure the budget with "
            "`tokenbatch probe --model NAME --max-length N` (or read the one a max_tokens='auto' "
            "training run logged) and pass that number, e.g. --max-tokens 16384"
        )
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"should be a number of cost units, but got {text!r}") from None


def read_lengths(args: argparse.Namespace) -> tuple[np.ndarray, str]:
    """The lengths the arguments point at, and a description of where they came from."""
    if args.lengths is not None:
        return _lengths_file(args.lengths), str(args.lengths)
    from tokenbatch.lengths import column_lengths, text_lengths

    if args.dataset is not None:
        dataset = _saved_dataset(args.dataset, args.split)
        column = args.column or ("length" if "length" in dataset.column_names else "input_ids")
        return column_lengths(dataset, column), f"{args.dataset} (column {column!r})"
    if args.tokenizer is None:
        raise ValueError(f"--data {args.data} needs --tokenizer NAME_OR_PATH to count tokens")
    kind = _TEXT_FORMATS.get(args.data.suffix.lower())
    if kind is None:
        raise ValueError(
            f"--data {args.data}: unknown file type {args.data.suffix!r}; use one of "
            f"{', '.join(sorted(_TEXT_FORMATS))}"
        )
    if not args.data.is_file():
        raise FileNotFoundError(f"--data {args.data}: no such file")
    import datasets
    from transformers import AutoTokenizer

    try:
        table = datasets.load_dataset(kind, data_files=str(args.data), split="train")
    except Exception as error:  # datasets wraps parser errors in several types
        raise ValueError(f"--data {args.data} could not be read as {kind}: {error}") from None
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    lengths = text_lengths(table, tokenizer, column=args.text_column, max_length=args.max_length)
    return lengths, f"{args.data} (column {args.text_column!r}, tokenizer {args.tokenizer})"


def _lengths_file(path: Path) -> np.ndarray:
    if not path.is_file():
        raise FileNotFoundError(f"--lengths {path}: no such file")
    if path.suffix == ".npy":
        return np.asarray(np.load(path))
    values = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        for word in line.replace(",", " ").split():
            try:
                values.append(int(word))
            except ValueError:
                raise ValueError(f"--lengths {path}, line {number}: {word!r} is not an integer") from None
    return np.asarray(values, dtype=np.int64)


def _saved_dataset(path: Path, split: str | None) -> Any:
    import datasets

    if not path.exists():
        raise FileNotFoundError(f"--dataset {path}: no such directory")
    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as error:
        raise ValueError(f"--dataset {path} is not a dataset saved with save_to_disk: {error}") from None
    if isinstance(loaded, datasets.DatasetDict):
        split = split or "train"
        if split not in loaded:
            raise ValueError(f"--split {split!r} is not in {path}; its splits are {', '.join(loaded)}")
        return loaded[split]
    return loaded


def cost_model(args: argparse.Namespace) -> CostModel:
    if args.attention is not None:
        return CostModel.attention(args.attention, pad_to_multiple_of=args.pad_to_multiple_of)
    return CostModel(args.linear, args.quadratic, args.per_sample, args.pad_to_multiple_of)


def describe(sampler: TokenBudgetBatchSampler) -> dict[str, Any]:
    """The numbers ``plan`` prints, as a JSON-ready dict."""
    plan, cost, lengths = sampler.plan, sampler.cost, sampler.lengths
    stats = sampler.stats()
    sizes = plan.batch_sizes()
    longest = plan.batch_longest(lengths)
    costs = plan.batch_costs(lengths, cost)
    worst = int(np.argmax(costs))
    return {
        "batches": stats.num_batches,
        "steps": stats.num_steps,
        "lower_bound_steps": lower_bound_steps(lengths, cost, sampler.max_tokens, plan.num_replicas),
        **compare.as_row(stats),
        "batch_size": _spread(sizes),
        "batch_longest": _spread(longest),
        "costliest_batch": {
            "position": worst,
            "size": int(sizes[worst]),
            "longest": int(longest[worst]),
            "cost": float(costs[worst]),
            "budget_use": float(costs[worst] / sampler.max_tokens),
        },
        "skipped": stats.num_skipped,
        "dropped": stats.num_dropped,
    }


def _spread(values: np.ndarray) -> dict[str, float]:
    low, p10, median, p90, high = np.percentile(values, [0, 10, 50, 90, 100])
    return {
        "min": float(low),
        "p10": float(p10),
        "median": float(median),
        "p90": float(p90),
        "max": float(high),
    }


def baselines(sampler: TokenBudgetBatchSampler) -> dict[str, Any]:
    """Random fixed batches and LengthGroupedSampler at the plan's worst-case memory."""
    lengths, cost, budget = sampler.lengths, sampler.cost, sampler.max_tokens
    size = compare.fixed_batch_size(lengths, cost, budget)
    rng = np.random.default_rng(sampler.seed)
    result: dict[str, Any] = {"fixed_batch_size": size}
    world = sampler.num_replicas
    fixed = compare.random_fixed_batching(len(lengths), size, rng)
    result["random_fixed"] = compare.as_row(compare.measure(fixed, lengths, cost, budget, world))
    try:
        import torch

        grouped = compare.length_grouped_batching(lengths, size, torch.Generator().manual_seed(sampler.seed))
        result["length_grouped"] = compare.as_row(compare.measure(grouped, lengths, cost, budget, world))
    except ImportError:
        result["length_grouped"] = None  # transformers is not installed
    return result


def run(args: argparse.Namespace) -> int:
    lengths, source = read_lengths(args)
    try:
        sampler = TokenBudgetBatchSampler(
            lengths,
            args.max_tokens,
            cost=cost_model(args),
            seed=args.seed,
            max_batch_size=args.max_batch_size,
            batch_size_multiple=args.batch_size_multiple,
            oversize=args.oversize,
            num_replicas=args.num_replicas,
        )
    except OversizeSampleError as error:
        raise OversizeSampleError(command_line_fix(str(error))) from None
    sampler.set_epoch(args.epoch)
    report: dict[str, Any] = {
        "source": source,
        "lengths": {"count": len(lengths), **_spread(lengths)},
        "settings": {
            "max_tokens": args.max_tokens,
            **sampler.state_dict()["settings"],
            "num_replicas": sampler.num_replicas,
            "epoch": args.epoch,
        },
        "cost": repr(sampler.cost),
        "plan": describe(sampler),
    }
    if args.compare:
        report["compare"] = baselines(sampler)
    if args.plot is not None:
        plot_plan(sampler, args.plot, report.get("compare", {}).get("fixed_batch_size"))
        report["plot"] = str(args.plot)
    print(json.dumps(report, indent=2) if args.json else as_text(report))
    return 0


def command_line_fix(message: str) -> str:
    """The sampler's oversize error in this command's words: ``--oversize alone``, not ``oversize='alone'``.

    Example:
        >>> command_line_fix("raise max_tokens to at least 200, or pass oversize='alone' or oversize='skip'")
        'raise --max-tokens to at least 200, or pass --oversize alone or --oversize skip'
    """
    for policy in OVERSIZE_POLICIES:
        message = message.replace(f"oversize='{policy}'", f"--oversize {policy}")
    message = message.replace("the budget max_tokens=", "the budget --max-tokens ")
    return message.replace("raise max_tokens to", "raise --max-tokens to")


def plot_plan(sampler: TokenBudgetBatchSampler, path: Path, fixed_batch_size: int | None = None) -> None:
    """Draw each planned batch as a point, the budget as a curve, and a fixed batch size as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    plan = sampler.plan
    longest = plan.batch_longest(sampler.lengths)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.scatter(longest, plan.batch_sizes(), s=12, alpha=0.7, label="tokenbatch batches")
    grid = np.unique(np.linspace(1, sampler.lengths.max(), 400).astype(int))
    axes.plot(grid, sampler.max_tokens / sampler.cost.sample_cost(grid), "k--", lw=1, label="budget limit")
    if fixed_batch_size is not None:
        axes.axhline(fixed_batch_size, color="tab:red", lw=1, label=f"fixed batch size {fixed_batch_size}")
    axes.set(xlabel="longest sequence in the batch (tokens)", ylabel="sequences in the batch", yscale="log")
    axes.set_title(f"{plan.num_batches} batches under max_tokens={_checks.budget(sampler.max_tokens)}")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def as_text(report: dict[str, Any]) -> str:
    plan, settings, spread = report["plan"], report["settings"], report["lengths"]
    worst = plan["costliest_batch"]
    lines = [
        f"lengths     {spread['count']} from {report['source']}: min {spread['min']:g}, "
        f"median {spread['median']:g}, p90 {spread['p90']:g}, max {spread['max']:g}",
        f"plan        max_tokens={_checks.budget(settings['max_tokens'])}, {report['cost']}, "
        f"{settings['num_replicas']} process(es), seed {settings['seed']}, epoch {settings['epoch']}",
        f"batches     {plan['batches']} per epoch = {plan['steps']} steps "
        f"(lower bound {plan['lower_bound_steps']:.1f}: {plan['steps_over_lower_bound']:.3f}x)",
        f"padding     {plan['token_efficiency']:.1%} of padded tokens are real; "
        f"{plan['efficiency']:.1%} of the cost is real",
        f"budget use  mean {plan['mean_budget_use']:.1%}, max {plan['max_budget_use']:.1%}",
        "batch size  " + _spread_text(plan["batch_size"]),
        "longest     " + _spread_text(plan["batch_longest"]) + " (tokens, per batch)",
        f"costliest   batch {worst['position']}: {worst['size']} x {worst['longest']} tokens, "
        f"cost {worst['cost']:g} ({worst['budget_use']:.1%} of the budget)",
    ]
    if plan["skipped"] or plan["dropped"]:
        lines.append(
            f"left out    {plan['skipped']} skipped (oversize), {plan['dropped']} dropped (drop_last)"
        )
    if "compare" in report:
        compared = report["compare"]
        lines += [
            "",
            f"compared at the same worst-case memory (fixed batch size {compared['fixed_batch_size']}):",
        ]
        rows = [("tokenbatch", plan), ("random fixed", compared["random_fixed"])]
        if compared["length_grouped"] is not None:
            rows.append(("LengthGroupedSampler", compared["length_grouped"]))
        lines.append(
            f"  {'method':<22}{'steps':>7}{'x lower bound':>15}{'padding eff.':>14}{'budget use':>12}"
        )
        for name, row in rows:
            lines.append(
                f"  {name:<22}{row['steps']:>7}{row['steps_over_lower_bound']:>15.3f}"
                f"{row['token_efficiency']:>14.1%}{row['mean_budget_use']:>12.1%}"
            )
    if "plot" in report:
        lines.append(f"\nplot written to {report['plot']}")
    return "\n".join(lines)


def _spread_text(spread: dict[str, float]) -> str:
    return (
        f"min {spread['min']:g}, p10 {spread['p10']:g}, median {spread['median']:g}, "
        f"p90 {spread['p90']:g}, max {spread['max']:g}"
    )
