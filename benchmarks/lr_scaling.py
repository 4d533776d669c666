"""The seed's learning rate under token-budget batches, scaled per step, against a hand-tuned rate.

Token-budget batches are larger on average than the fixed batch a learning
rate was tuned for, so at that rate a run takes fewer, too-timid steps.
``tokenbatch.BatchScaledLR`` scales each step's rate by the step's real tokens
against the tuned-for batch (``--lr_reference`` texts of the mean length). This
benchmark asks whether that gives, with no retuning, the time to a validation
macro-F1 that a hand-tuned rate gives. Arms, on the training benchmark's task
(``benchmarks/training_workers.py``: emotion, all-MiniLM-L6-v2, CPU):

- ``hand-tuned``: token-budget batches at ``--hand_tuned_lr`` (2e-4, found by a sweep);
- ``scaled``: token-budget batches at the seed's ``--learning_rate`` (5e-5), linear
  rule, by tokens;
- ``unscaled``: the same at 5e-5 without scaling (``--unscaled_seeds``);
- ``seed``: the seed's fixed batches of 32 at 5e-5 (``--seed_epochs``; one run).

Each tokenbatch arm runs once per ``--seeds`` value; the arms of one seed train
the very same batches, so their training time per step is the same and the
ratio of their steps to the target is a time ratio that the load of other work
on the machine cannot skew. Validation runs ``--evals_per_epoch`` times an epoch
(``benchmarks/validation_points.py``), so times to the target are not rounded
up to an epoch, and its time is kept off the training clock.

    python -m benchmarks.lr_scaling --quick   # a few minutes
    python -m benchmarks.lr_scaling           # about 45 minutes on 2 cores (2 runs at a time)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.training import WORKERS, launch, worst_case_budget

NAME = "lr_scaling"


def arms(args: argparse.Namespace, budget: float) -> list[dict[str, Any]]:
    """Every run to launch: its arm, seed, and worker command line (without the shared options)."""
    reference = ["--lr_reference", str(args.batch_size * args.processes), "--lr_by", "tokens"]
    kinds = {
        "hand-tuned": (args.hand_tuned_lr, []),
        "scaled": (args.learning_rate, ["--lr_scaling", "linear", *reference]),
        "unscaled": (args.learning_rate, []),
    }
    runs = (
        []
        if not args.seed_epochs
        else [
            {
                "arm": "seed",
                "seed": args.seeds[0],
                "lr": args.learning_rate,
                "script": [*WORKERS, "seed", "--batch_size", str(args.batch_size)],
                "epochs": args.seed_epochs,
            }
        ]
    )
    for seed in args.seeds:
        for arm, (lr, extra) in kinds.items():
            if arm == "unscaled" and seed not in args.unscaled_seeds:
                continue
            script = [*WORKERS, "tokenbatch", "--max_tokens", str(budget), *extra]
            runs.append({"arm": arm, "seed": seed, "lr": lr, "script": script, "epochs": args.epochs})
    return runs


def run(args: argparse.Namespace, shared: list[str], spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """Launch one run under ``accelerate launch``; its worker's results with the run's settings."""
    stem = f"{spec['arm']}-seed{spec['seed']}"
    out = work / f"{stem}.json"
    settings = ["--learning_rate", str(spec["lr"]), "--num_epochs", str(spec["epochs"])]
    settings += ["--seed", str(spec["seed"]), "--evals_per_epoch", str(args.evals_per_epoch)]
    start = time.perf_counter()
    settings += ["--output_json", str(out)]
    launch([*spec["script"], *shared, *settings], args.processes, work / f"{stem}.log")
    result = json.loads(out.read_text())
    print(f"  {stem} done in {time.perf_counter() - start:.0f} s", flush=True)
    return {**{k: v for k, v in spec.items() if k != "script"}, **result}


def saved_run(spec: dict[str, Any], work: Path) -> dict[str, Any] | None:
    """The run ``spec`` as an earlier invocation saved it in ``work``, if it trained as many epochs."""
    path = work / f"{spec['arm']}-seed{spec['seed']}.json"
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    if len(result["epochs"]) != spec["epochs"]:
        return None
    return {**{k: v for k, v in spec.items() if k != "script"}, **result}


def first_reaching(evals: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """The first validation record at or above ``target`` macro-F1 (None: never)."""
    return next((record for record in evals if record["macro_f1"] >= target), None)


def interpolated(evals: list[dict[str, Any]], target: float, field: str) -> float | None:
    """``field`` (steps, seconds) where macro-F1 crosses ``target``, on the line between two validations.

    The first validation at the target bounds it from above; the validation before it
    from below. None: never reached. Reached at the first validation: from the start (0, F1 0).

    >>> interpolated([{"step": 10, "macro_f1": 0.5}, {"step": 20, "macro_f1": 1.0}], 0.75, "step")
    15.0
    """
    before = {field: 0.0, "macro_f1": 0.0}
    for record in evals:
        if record["macro_f1"] >= target:
            share = (target - before["macro_f1"]) / (record["macro_f1"] - before["macro_f1"])
            return float(before[field] + share * (record[field] - before[field]))
        before = record
    return None


def summarize(runs: list[dict[str, Any]], target: float) -> dict[str, Any]:
    """Per run: steps, epochs and training seconds to ``target``; per arm: medians; paired ratios.

    Runs whose validation records carry no ``train_seconds`` (Trainer's logs) get None for the times.
    """
    rows = []
    for result in runs:
        hit = first_reaching(result["evals"], target)
        timed = all("train_seconds" in record for record in result["evals"])
        seconds = interpolated(result["evals"], target, "train_seconds") if timed else None
        rows.append(
            {
                "arm": result["arm"],
                "seed": result["seed"],
                "lr": result["lr"],
                "best_macro_f1": max(e["macro_f1"] for e in result["evals"]),
                "final_macro_f1": result["evals"][-1]["macro_f1"],
                "steps_to_target": hit and hit["step"],
                "epochs_to_target": hit and hit["epoch"],
                "train_seconds_to_target": hit["train_seconds"] if hit and timed else None,
                "interpolated_steps": interpolated(result["evals"], target, "step"),
                "interpolated_seconds": seconds,
                "lr_scale_mean": statistics.mean(e.get("lr_scale_mean", 1.0) for e in result["epochs"]),
            }
        )
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row)

    def median_of(arm_rows: list[dict[str, Any]], field: str) -> float | None:
        values = [row[field] for row in arm_rows if row[field] is not None]
        return statistics.median(values) if len(values) == len(arm_rows) else None  # None: a run missed

    arms = {
        arm: {
            "runs": len(arm_rows),
            "reached": sum(row["steps_to_target"] is not None for row in arm_rows),
            "median_steps_to_target": median_of(arm_rows, "steps_to_target"),
            "median_epochs_to_target": median_of(arm_rows, "epochs_to_target"),
            "median_train_seconds_to_target": median_of(arm_rows, "train_seconds_to_target"),
            "median_interpolated_steps": median_of(arm_rows, "interpolated_steps"),
            "median_interpolated_seconds": median_of(arm_rows, "interpolated_seconds"),
            "median_best_macro_f1": statistics.median(row["best_macro_f1"] for row in arm_rows),
        }
        for arm, arm_rows in by_arm.items()
    }
    # Same seed, same batches: the scaled arm's steps over the hand-tuned arm's are its time ratio.
    hand = {row["seed"]: row for row in by_arm.get("hand-tuned", [])}

    def pairs(field: str) -> list[float]:
        return [
            row[field] / hand[row["seed"]][field]
            for row in by_arm.get("scaled", [])
            if row[field] and hand.get(row["seed"], {}).get(field)
        ]

    paired, between = pairs("steps_to_target"), pairs("interpolated_steps")
    ratios = {
        "scaled_over_hand_tuned_steps": paired,
        "median_scaled_over_hand_tuned": statistics.median(paired) if paired else None,
        "scaled_over_hand_tuned_interpolated": between,
        "median_scaled_over_hand_tuned_interpolated": statistics.median(between) if between else None,
        "pairs_where_both_reached": len(paired),
    }
    return {"rows": rows, "arms": arms, "ratios": ratios}


def markdown(args: argparse.Namespace, budget: float, summary: dict[str, Any]) -> str:
    def cells(row: dict[str, Any]) -> dict[str, Any]:
        return {k: "-" if v is None else v for k, v in row.items()}

    seed_row = summary["arms"].get("seed", {})
    lines = [
        f"Emotion, all-MiniLM-L6-v2, {args.processes} CPU process(es) x 1 thread, {args.parallel} runs at a "
        f"time; train {args.train_limit or 'all'} texts, validation {args.eval_limit or 'all'}, validated "
        f"{args.evals_per_epoch} times an epoch; tokenbatch: max_tokens {budget:.0f} (the seed's worst "
        f"batch), {args.epochs} epochs, seeds {', '.join(map(str, args.seeds))}; seed: batch "
        f"{args.batch_size}, lr {args.learning_rate:g}, {args.seed_epochs} epochs. Target: validation "
        f"macro-F1 {args.target}. Training seconds exclude validation; they drift with the machine's load.",
        common.markdown_table([cells(row) for row in summary["rows"]], list(summary["rows"][0])),
        common.markdown_table(
            [{"arm": arm, **cells(values)} for arm, values in summary["arms"].items()],
            ["arm", *next(iter(summary["arms"].values()))],
        ),
    ]
    ratios = summary["ratios"]
    ratio = ratios["median_scaled_over_hand_tuned"]
    between = ratios["median_scaled_over_hand_tuned_interpolated"]
    lines.append(
        f"Scaled at {args.learning_rate:g} over hand-tuned at {args.hand_tuned_lr:g}, steps to the target, "
        f"paired by seed (the same batches, so a time ratio), at the first validation reaching it: "
        + (", ".join(f"{r:.3f}" for r in ratios["scaled_over_hand_tuned_steps"]) or "no pair")
        + ("" if ratio is None else f" (median {ratio:.3f})")
        + "; where the line between validations crosses it: "
        + (", ".join(f"{r:.3f}" for r in ratios["scaled_over_hand_tuned_interpolated"]) or "no pair")
        + ("" if between is None else f" (median {between:.3f})")
        + (
            "."
            if not seed_row.get("median_train_seconds_to_target")
            else f". Seed: {seed_row['median_train_seconds_to_target']:.0f} training seconds to the target."
        )
    )
    return "\n\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(NAME, __doc__.split("\n\n")[0])
    add = parser.add_argument
    add("--learning_rate", type=float, default=5e-5, help="the seed's learning rate")
    add("--hand_tuned_lr", type=float, default=2e-4, help="the tokenbatch rate found by hand")
    add("--batch_size", type=int, default=32, help="the seed's batch size per process (the reference)")
    add("--seeds", default="0,1,2", help="seeds of the tokenbatch arms (comma-separated)")
    add("--unscaled_seeds", default="0", help="seeds that also run the unscaled arm ('' for none)")
    add("--epochs", type=int, help="epochs of the tokenbatch arms (default 3; 1 with --quick)")
    add("--seed_epochs", type=int, help="epochs of the seed's run (default 2; 1 with --quick; 0: no run)")
    add("--evals_per_epoch", type=int, default=4)
    add("--train_limit", type=int, help="default 4000 (240 with --quick)")
    add("--eval_limit", type=int, help="default all 2000 (200 with --quick)")
    add("--target", type=float, default=0.85, help="the validation macro-F1 to time")
    add("--processes", type=int, default=1, help="processes per run")
    add("--parallel", type=int, default=2, help="runs at a time (one per core at 1 process)")
    add("--reuse", action="store_true", help="take runs already saved in --out instead of training them")
    args = parser.parse_args(argv)
    data = common.data_dir()
    if data is None:
        raise SystemExit(f"benchmarks.{NAME} needs the emotion data: set $TOKENBATCH_DATA_DIR")
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    args.unscaled_seeds = [int(s) for s in args.unscaled_seeds.split(",") if s]
    args.epochs = args.epochs or (1 if args.quick else 3)
    args.seed_epochs = (1 if args.quick else 2) if args.seed_epochs is None else args.seed_epochs
    args.train_limit = args.train_limit or (240 if args.quick else 4000)
    args.eval_limit = args.eval_limit or (200 if args.quick else None)
    if args.quick:
        args.seeds, args.target = args.seeds[:1], min(args.target, 0.1)
    model = common.minilm_path()
    budget, longest, crossover = worst_case_budget(model, data / "emotion", args.train_limit, args.batch_size)
    shared = ["--model_name", model, "--data_dir", str(data / "emotion")]
    shared += ["--train_limit", str(args.train_limit)]
    shared += ["--eval_limit", str(args.eval_limit)] if args.eval_limit else []
    work = args.out / "lr-scaling-runs"
    work.mkdir(parents=True, exist_ok=True)
    specs = arms(args, budget)
    saved = {id(spec): saved_run(spec, work) for spec in specs} if args.reuse else {}
    todo = [spec for spec in specs if saved.get(id(spec)) is None]
    print(f"{len(specs)} runs ({len(specs) - len(todo)} saved), {args.parallel} at a time ...", flush=True)
    with ThreadPoolExecutor(args.parallel) as pool:  # threads only wait on the launched processes
        results = list(pool.map(lambda spec: run(args, shared, spec, work), todo))
    trained = {id(spec): result for spec, result in zip(todo, results, strict=True)}
    runs = [saved.get(id(spec)) or trained[id(spec)] for spec in specs]
    summary = summarize(runs, args.target)
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(max_tokens=budget, longest=longest, crossover=crossover)
    text = markdown(args, budget, summary)
    common.write_results(NAME, args.out, {"settings": settings, "runs": runs, **summary}, text)
    print(text)


if __name__ == "__main__":
    main()
