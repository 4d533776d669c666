"""``tokenbatch probe``: measure which token budget fits a model on this device.

The model is built from its config alone (``AutoModelFor<task>.from_config``,
random weights): memory does not depend on the weights' values, and only
``config.json`` is needed, not the checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from tokenbatch.probe._model import TASKS

_UNITS = {"": 1, "b": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_TASK_CLASSES = {
    "base": "AutoModel",
    "sequence-classification": "AutoModelForSequenceClassification",
    "token-classification": "AutoModelForTokenClassification",
    "masked-lm": "AutoModelForMaskedLM",
    "causal-lm": "AutoModelForCausalLM",
}


def parse_bytes(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"16GB"``, ``"1e9"`` or ``"1000000"`` as a number of bytes.

    Example:
        >>> parse_bytes("8GiB"), parse_bytes("1.5 GB"), parse_bytes("4096")
        (8589934592, 1500000000, 4096)
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if match is None:
        raise argparse.ArgumentTypeError(
            f"--memory-limit should be a size such as 8GiB, 512MiB or 16GB, but got {text!r}"
        )
    number, unit, binary = match.groups()
    scale = 1024 ** "_kmgt".index(unit) if binary and unit else _UNITS[unit]
    value = int(float(number) * scale)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--memory-limit should be positive, but got {text!r}")
    return value


def register(subparsers: Any) -> None:
    """Add the ``probe`` subcommand."""
    parser = subparsers.add_parser(
        "probe",
        help="measure the token budget that fits a model on this device",
        description="Run real training steps on synthetic worst-case batches, fit peak memory "
        "and print the max_tokens (and cost model) to give TokenBudgetBatchSampler.",
    )
    parser.add_argument("--model", required=True, help="hub name or local directory with config.json")
    parser.add_argument("--max-length", type=int, required=True, help="longest padded sequence")
    parser.add_argument("--min-length", type=int, default=None, help="shortest sequence to check (16)")
    parser.add_argument(
        "--memory-limit", type=parse_bytes, default=None, help="e.g. 8GiB (default: free memory)"
    )
    parser.add_argument("--margin", type=float, default=0.1, help="fraction of the limit kept free (0.1)")
    parser.add_argument("--method", choices=("fit", "search"), default="fit")
    parser.add_argument("--task", choices=TASKS, default="auto", help="which head to train (auto)")
    parser.add_argument("--attn-implementation", default=None, help="eager, sdpa, flash_attention_2, ...")
    parser.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32")
    parser.add_argument("--device", default=None, help="cuda, cuda:1 or cpu (default: cuda if present)")
    parser.add_argument("--pad-to-multiple-of", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a report")
    parser.add_argument("--write-cache", action="store_true", help="store the budget in the budget cache")
    parser.add_argument("--cache", default=None, help="budget cache file (default: $TOKENBATCH_CACHE)")
    parser.add_argument("--world-size", type=int, default=None, help="world size for the cache key")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)


def _load_model(args: argparse.Namespace) -> Any:
    import torch
    import transformers

    from tokenbatch.probe._model import resolve_task

    config = transformers.AutoConfig.from_pretrained(args.model)
    task = resolve_task(config, args.task)
    factory = getattr(transformers, _TASK_CLASSES[task])
    kwargs = {} if args.attn_implementation is None else {"attn_implementation": args.attn_implementation}
    model = factory.from_config(config, **kwargs)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return model.to(device=device, dtype=getattr(torch, args.dtype)), task


def _mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f}"


def _report(result: Any, args: argparse.Namespace, model: Any, task: str) -> str:
    attn = getattr(model.config, "_attn_implementation", None)
    lines = [
        f"tokenbatch probe: {args.model} ({task}, {args.dtype}, attention {attn}) on {result.device}",
        f"memory limit {_mib(result.memory_limit)} MiB, margin {result.margin:.0%}, "
        f"{result.steps} steps in {result.seconds:.1f}s",
    ]
    fit = result.fit
    if fit is not None:
        lines.append(
            f"fitted peak bytes = {fit.constant:,.0f} + B * ({fit.linear:,.1f} * L + "
            f"{fit.quadratic:,.3f} * L^2 + {fit.per_sample:,.0f})   (optimizer step peak "
            f"{fit.step_peak:,.0f})"
        )
    cost = result.cost
    lines.append(
        f"suggested: max_tokens={result.max_tokens:,.0f} with cost=CostModel(linear={cost.linear:.6g}, "
        f"quadratic={cost.quadratic:.6g}, per_sample={cost.per_sample:.6g}, "
        f"pad_to_multiple_of={cost.pad_to_multiple_of})"
    )
    lines.append("")
    lines.append(f"{'batch':>7} {'length':>7} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7}  set")
    for row in result.table():
        error = "-" if row["error"] is None else f"{row['error']:+.1%}"
        measured = "OOM" if row["oom"] else _mib(row["measured_bytes"])
        kind = "held out" if row["held_out"] else "fit" if fit is not None else "search"
        lines.append(
            f"{row['batch_size']:>7} {row['length']:>7} {measured:>13} "
            f"{_mib(row['predicted_bytes']):>14} {error:>7}  {kind}"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the probe and print the report (or JSON); returns the exit status."""
    from tokenbatch.cost import CostModel
    from tokenbatch.probe import find_max_tokens

    model, task = _load_model(args)
    result = find_max_tokens(
        model,
        max_len=args.max_length,
        min_len=args.min_length,
        memory_limit=args.memory_limit,
        method=args.method,
        margin=args.margin,
        cost=CostModel(pad_to_multiple_of=args.pad_to_multiple_of),
        progress=not (args.no_progress or args.json),
    )
    cache_entry = None
    if args.write_cache:
        import numpy as np

        from tokenbatch.probe import BudgetCache, BudgetKey
        from tokenbatch.probe._cache import scope

        key = BudgetKey.for_device(
            args.model, device=result.device, dtype=args.dtype, world_size=args.world_size
        )
        cache = BudgetCache(args.cache)
        # The lengths it holds for: the shortest and longest the probe measured.
        measured = np.array([m.length for m in (*result.measurements, *result.checks)] + [result.max_len])
        cache.put(
            key,
            result.max_tokens,
            source="probe",
            **scope(result.cost, measured),
            max_len=args.max_length,
            task=task,
            memory_limit=result.memory_limit,
            margin=result.margin,
        )
        cache_entry = {"path": str(cache.path), "key": str(key)}
    if args.json:
        payload = {"model": args.model, "task": task, "dtype": args.dtype, **result.to_dict()}
        payload["cache"] = cache_entry
        json.dump(payload, sys.stdout, default=float)
        sys.stdout.write("\n")
    else:
        print(_report(result, args, model, task))
        if result.device == "cpu" and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
            print(
                "\nnote: on CPU the limit is on PyTorch's tensor bytes; glibc's malloc can hold much more "
                "address space unless training runs with MALLOC_MMAP_THRESHOLD_=65536 "
                "(see help(tokenbatch.probe))"
            )
        if cache_entry is not None:
            print(f"\nwrote max_tokens to {cache_entry['path']} under {cache_entry['key']!r}")
    return 0
