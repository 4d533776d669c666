"""Emotion fine-tuning on CPU, 2 processes: tokenbatch versus the seed's fixed batches.

Both arms train all-MiniLM-L6-v2 with a [CLS] linear head (the example's
model, tokenization and validation) at the same worst-case padded memory:

- ``seed``: the blog post's design, random batches of a fixed ``--batch_size``
  per process inside accelerate's ``find_executable_batch_size`` (which only
  matters after an OOM; there is none on CPU, so it runs once);
- ``tokenbatch``: the example's loop (``examples/emotion/train.py``: token-budget
  batches under ``OOMFallback``) with ``--max_tokens`` equal to the cost of the
  seed's worst batch, ``batch_size`` copies of the longest training text
  (quadratic attention cost, crossover ``34 * hidden / (5 * heads)``).

Both arms run in ``benchmarks/training_workers.py``, one ``accelerate launch`` each.

Per epoch: wall time, real tokens per second, optimizer steps, validation
macro-F1; the wall time until validation macro-F1 first reaches ``--target``,
and until it reaches the best F1 that both the arm and the seed reach. Larger
token-budget batches take fewer steps per epoch, so ``--tokenbatch_lrs`` adds
arms with larger learning rates, and ``--lr_scaling`` arms at the seed's
learning rate scaled per step by ``tokenbatch.BatchScaledLR`` (the step's
samples against the seed's batch on all processes; ``--lr_by tokens``: its
real tokens against that many texts of the mean length). Last, an interleaved check
trains both batchings in alternating chunks of one run, for a tokens/s ratio
that the load of other processes on the machine cannot skew (``--rounds 0``
skips it).

    python -m benchmarks.training --quick     # a few minutes, mostly process start-up
    python -m benchmarks.training             # the whole training set, 3 epochs: hours on 2 shared cores
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks import common

NAME = "training"
WORKERS = ["-m", "benchmarks.training_workers"]  # one process of a run under accelerate launch


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def launch(script: list[str], processes: int, log: Path) -> None:
    """Run ``script`` under ``accelerate launch`` on CPU with ``processes`` processes, 1 thread each."""
    env = dict(os.environ)
    env.update(
        PYTHONPATH=os.pathsep.join([str(common.REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        ACCELERATE_USE_CPU="1",
    )
    command = [sys.executable, "-m", "accelerate.commands.launch", "--num_machines", "1"]
    command += ["--mixed_precision", "no", "--dynamo_backend", "no", "--num_processes", str(processes)]
    command += ["--multi_gpu", "--main_process_port", str(free_port())] if processes > 1 else []
    with open(log, "w") as handle:
        done = subprocess.run(
            [*command, *script], env=env, cwd=common.REPO, stdout=handle, stderr=subprocess.STDOUT
        )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(script[:3])} failed (exit {done.returncode}); see {log}")


def worst_case_budget(
    model: str, data_dir: Path, limit: int | None, batch_size: int
) -> tuple[float, int, float]:
    """The cost of ``batch_size`` copies of the longest training text: the seed's worst batch."""
    from transformers import AutoConfig, AutoTokenizer

    from benchmarks.training_workers import attention_crossover
    from tokenbatch import CostModel, text_lengths

    texts = [row["text"] for row in common.read_jsonl(data_dir / "train.jsonl", limit)]
    longest = int(text_lengths(texts, AutoTokenizer.from_pretrained(model), max_length=512).max())
    crossover = attention_crossover(AutoConfig.from_pretrained(model))
    return CostModel.attention(crossover).cost(batch_size, longest), longest, crossover


def time_to(epochs: list[dict[str, Any]], target: float) -> float | None:
    """Wall time (training and validation) until validation macro-F1 first reaches ``target``."""
    elapsed = 0.0
    for record in epochs:
        elapsed += float(record["epoch_seconds"])
        if record["macro_f1"] >= target:
            return elapsed
    return None


def run_arms(args: argparse.Namespace, shared: list[str], budget: float, work: Path) -> dict[str, Any]:
    """Train every arm in turn under ``accelerate launch``; their per-epoch records by label."""
    arms: dict[str, Any] = {}
    runs = [("seed", args.learning_rate, args.epochs, "")]
    lrs = [float(lr) for lr in args.tokenbatch_lrs.split(",") if lr]
    runs += [("tokenbatch", lr, args.tokenbatch_epochs, "") for lr in lrs]
    rules = [rule for rule in (args.lr_scaling or "").split(",") if rule]
    runs += [("tokenbatch", args.learning_rate, args.tokenbatch_epochs, rule) for rule in rules]
    for kind, lr, epochs, rule in runs:
        by = "" if not rule or args.lr_by == "samples" else f" by {args.lr_by}"
        label = f"{kind} lr={lr:g}" + (f" {rule}-scaled{by}" if rule else "")
        stem = f"{kind}-lr{lr:g}" + (f"-{rule}{by.replace(' ', '-')}" if rule else "")
        out = work / f"{stem}.json"
        settings = ["--learning_rate", str(lr), "--num_epochs", str(epochs), "--output_json", str(out)]
        if kind == "seed":
            script = [*WORKERS, "seed", "--batch_size", str(args.batch_size)]
        else:
            script = [*WORKERS, "tokenbatch", "--max_tokens", str(budget)]
        if rule:  # the reference: the seed's batch over all processes, in samples
            script += ["--lr_scaling", rule, "--lr_reference", str(args.batch_size * args.processes)]
            script += ["--lr_by", args.lr_by]
        print(f"running {label} ...", flush=True)
        start = time.perf_counter()
        launch([*script, *shared, *settings], args.processes, work / f"{stem}.log")
        arms[label] = json.loads(out.read_text())
        arms[label]["process_seconds"] = time.perf_counter() - start
        print(f"  done in {arms[label]['process_seconds']:.0f} s", flush=True)
    return arms


def run_throughput(args: argparse.Namespace, shared: list[str], budget: float, work: Path) -> dict[str, Any]:
    """Both batchings in alternating chunks of one run: a tokens/s ratio free of load drift."""
    out = work / "throughput.json"
    script = [*WORKERS, "throughput", "--batch_size", str(args.batch_size)]
    script += ["--max_tokens", str(budget), "--rounds", str(args.rounds), "--output_json", str(out)]
    print("running the interleaved throughput check ...", flush=True)
    launch([*script, *shared], args.processes, work / "throughput.log")
    chunks = json.loads(out.read_text())["chunks"]
    rate = {
        arm: [c["tokens"] / c["seconds"] for c in chunks if c["arm"] == arm] for arm in ("seed", "tokenbatch")
    }
    return {
        "chunks": chunks,
        "seed_tokens_per_second": statistics.median(rate["seed"]),
        "tokenbatch_tokens_per_second": statistics.median(rate["tokenbatch"]),
        "paired_ratio_median": statistics.median(
            t / s for s, t in zip(rate["seed"], rate["tokenbatch"], strict=True)
        ),
    }


def summarize(
    arms: dict[str, Any], seed_label: str, target: float
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-epoch rows and a per-arm summary: tokens/s against the seed, and time to macro-F1.

    ``seconds_to_target`` times each arm to ``target`` (None: not reached);
    ``seconds_to_shared`` times it to ``shared_f1``, the best macro-F1 that both
    this arm and the seed's reached, and ``seed_seconds_to_shared`` the seed to it.
    """
    seed = arms[seed_label]["epochs"]
    seed_tps = statistics.median(e["tokens_per_second"] for e in seed)
    rows, summary = [], {}
    for label, arm in arms.items():
        elapsed = 0.0
        for record in arm["epochs"]:
            elapsed += record["epoch_seconds"]
            rows.append({"arm": label, **record, "elapsed_seconds": elapsed})
        tps = statistics.median(e["tokens_per_second"] for e in arm["epochs"])
        best = max(e["macro_f1"] for e in arm["epochs"])
        shared = min(best, max(e["macro_f1"] for e in seed))
        summary[label] = {
            "median_tokens_per_second": tps,
            "tokens_per_second_vs_seed": tps / seed_tps,
            "best_macro_f1": best,
            "seconds_to_target": time_to(arm["epochs"], target),
            "shared_f1": shared,
            "seconds_to_shared": time_to(arm["epochs"], shared),
            "seed_seconds_to_shared": time_to(seed, shared),
        }
    return rows, summary


def main(argv: list[str] | None = None) -> None:
    parser = common.parser(NAME, __doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=32, help="the seed's batch size per process")
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="the seed's learning rate")
    parser.add_argument(
        "--tokenbatch_lrs", help="learning rates of the tokenbatch arms (default 5e-5,1e-4,2e-4)"
    )
    parser.add_argument(
        "--lr_scaling",
        help="BatchScaledLR rules (linear, sqrt, comma-separated) of tokenbatch arms at --learning_rate",
    )
    parser.add_argument(
        "--lr_by",
        choices=("samples", "tokens"),
        default="samples",
        help="scale by the step's texts against the seed's batch, or its real tokens against as many "
        "texts of the mean length",
    )
    parser.add_argument("--epochs", type=int, help="the seed's epochs (default 3; 1 with --quick)")
    parser.add_argument(
        "--tokenbatch_epochs", type=int, help="epochs of the tokenbatch arms (default --epochs)"
    )
    parser.add_argument("--train_limit", type=int, help="default all 16000 (240 with --quick)")
    parser.add_argument("--eval_limit", type=int, help="default all 2000 (200 with --quick)")
    parser.add_argument(
        "--rounds", type=int, help="chunks per arm in the throughput check (6; 2 with --quick; 0: skip it)"
    )
    parser.add_argument("--target", type=float, default=0.85, help="the validation macro-F1 to time")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    data = common.data_dir()
    if data is None:
        raise SystemExit(
            "benchmarks.training needs the emotion data: set $TOKENBATCH_DATA_DIR or ../shared/data"
        )
    args.epochs = args.epochs or (1 if args.quick else 3)
    args.tokenbatch_epochs = args.tokenbatch_epochs or args.epochs
    args.train_limit = args.train_limit or (24 if args.smoke else 240 if args.quick else None)
    args.eval_limit = args.eval_limit or (12 if args.smoke else 200 if args.quick else None)
    args.tokenbatch_lrs = args.tokenbatch_lrs or ("5e-5" if args.quick else "5e-5,1e-4,2e-4")
    args.rounds = (1 if args.smoke else 2 if args.quick else 6) if args.rounds is None else args.rounds
    model = common.minilm_path()
    budget, longest, crossover = worst_case_budget(model, data / "emotion", args.train_limit, args.batch_size)
    shared = ["--model_name", model, "--data_dir", str(data / "emotion"), "--seed", str(args.seed)]
    shared += ["--train_limit", str(args.train_limit)] if args.train_limit else []
    shared += ["--eval_limit", str(args.eval_limit)] if args.eval_limit else []
    work = args.out / "training-runs"
    work.mkdir(parents=True, exist_ok=True)

    arms = run_arms(args, shared, budget, work)
    throughput = run_throughput(args, shared, budget, work) if args.rounds else None
    rows, summary = summarize(arms, f"seed lr={args.learning_rate:g}", args.target)
    columns = ["arm", "epoch", "epoch_seconds", "elapsed_seconds", "tokens_per_second", "optimizer_steps"]
    summary_columns = ["arm", "median_tokens_per_second", "tokens_per_second_vs_seed", "best_macro_f1"]
    summary_columns += ["seconds_to_target", "shared_f1", "seconds_to_shared", "seed_seconds_to_shared"]
    markdown = "\n\n".join(
        [
            f"Emotion, all-MiniLM-L6-v2, {args.processes} CPU processes x 1 thread; train "
            f"{args.train_limit or 'all'} texts, validation {args.eval_limit or 'all'}; seed: batch "
            f"{args.batch_size} per process, {args.epochs} epochs; tokenbatch: max_tokens {budget:.0f} "
            f"(the cost of {args.batch_size} copies of the longest text, {longest} tokens, attention "
            f"crossover {crossover:.0f}), {args.tokenbatch_epochs} epochs. Other agents share this CPU, "
            "so absolute times drift; the interleaved check gives the fairer tokens/s ratio.",
            common.markdown_table(rows, [*columns, "lr_scale_mean", "loss", "macro_f1"]),
            f"Wall time (training and validation, summed over epochs) to validation macro-F1 "
            f"{args.target} ('-': not reached), and to the best macro-F1 both the arm and the seed reached:",
            common.markdown_table(
                [
                    {"arm": k, **{f: "-" if x is None else x for f, x in v.items()}}
                    for k, v in summary.items()
                ],
                summary_columns,
            ),
        ]
    )
    if throughput is not None:
        markdown += (
            f"\n\nInterleaved throughput check ({args.rounds} alternating chunks per arm in one run, same "
            f"model and loop): seed {throughput['seed_tokens_per_second']:.0f} real tokens/s, tokenbatch "
            f"{throughput['tokenbatch_tokens_per_second']:.0f}; median paired ratio "
            f"{throughput['paired_ratio_median']:.2f}x."
        )
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    settings.update(max_tokens=budget, longest=longest, crossover=crossover)
    # One row per arm (and per interleaved measurement) for benchmarks.report's tokens/s plot.
    plot_rows = [
        {"method": label, "processes": args.processes, **values} for label, values in summary.items()
    ]
    plot_rows += [
        {
            "method": f"{arm} (interleaved)",
            "processes": args.processes,
            "tokens_per_s": throughput[f"{arm}_tokens_per_second"],
        }
        for arm in ("seed", "tokenbatch")
        if throughput is not None
    ]
    results = {
        "settings": settings,
        "rows": plot_rows,
        "arms": arms,
        "summary": summary,
        "throughput": throughput,
    }
    # The 2-process run is the headline; other process counts are kept beside it.
    variant = None if args.processes == 2 else f"{args.processes}-process"
    common.write_results(NAME, args.out, results, markdown, variant)
    print(markdown)


if __name__ == "__main__":
    main()
