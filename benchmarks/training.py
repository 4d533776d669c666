"""Emotion fine-tuning on CPU, 2 processes: tokenbatch versus the seed's fixed batches.

Both arms train all-MiniLM-L6-v2 with a [CLS] linear head (the example's
model, tokenization and validation) at the same worst-case padded memory:

- ``seed``: the blog post's design, random batches of a fixed ``--batch_size``
  per process inside accelerate's ``find_executable_batch_size`` (which only
  matters after an OOM; there is none on CPU, so it runs once);
- ``tokenbatch``: ``examples/emotion/train.py`` with ``--max_tokens`` equal to
  the cost of the seed's worst batch, ``batch_size`` copies of the longest
  training text (quadratic attention cost, the model's crossover).

Per epoch: wall time, real tokens per second, optimizer steps, validation
macro-F1; and the wall time until validation macro-F1 first reaches
``--target`` (or the best F1 that every arm reaches). Larger token-budget
batches take fewer steps per epoch, so ``--tokenbatch_lrs`` can add arms with
a larger learning rate.

    python -m benchmarks.training --quick     # about a minute
    python -m benchmarks.training             # the whole training set, 3 epochs: long on 2 cores
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from benchmarks import common

NAME = "training"
EXAMPLE = common.REPO / "examples" / "emotion" / "train.py"


def load_example() -> ModuleType:
    """``examples/emotion/train.py`` as a module, to share its model, data and validation code."""
    spec = importlib.util.spec_from_file_location("emotion_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- the seed's arm, run under accelerate launch as `-m benchmarks.training --worker ...` ------------


def seed_worker(argv: list[str]) -> None:
    """The seed's training loop: shuffled fixed batches inside find_executable_batch_size."""
    import torch
    from accelerate import Accelerator
    from accelerate.utils import find_executable_batch_size, set_seed
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithPadding

    from tokenbatch import column_lengths

    parser = argparse.ArgumentParser()
    for name in ("--model_name", "--data_dir", "--output_json"):
        parser.add_argument(name, required=True)
    for name in ("--batch_size", "--num_epochs", "--train_limit", "--eval_limit", "--seed"):
        parser.add_argument(name, type=int)
    parser.add_argument("--learning_rate", type=float, required=True)
    args = parser.parse_args(argv)
    args.data_dir, args.tiny_model, args.max_length = Path(args.data_dir), False, 512
    example = load_example()

    accelerator = Accelerator()
    set_seed(args.seed)
    tokenizer = example.load_tokenizer(args.model_name)
    with accelerator.main_process_first():
        encoded = example.tokenize(example.load_splits(args), tokenizer, args.max_length)
    collator = DataCollatorWithPadding(tokenizer)
    results: dict[str, Any] = {"epochs": [], "world_size": accelerator.num_processes}
    # accelerate completes the last step by repeating a few texts; count each text once.
    dataset_tokens = int(column_lengths(encoded["train"]).sum())

    @find_executable_batch_size(starting_batch_size=args.batch_size)
    def inner_training_loop(batch_size: int) -> None:
        accelerator.free_memory()
        set_seed(args.seed)
        model = example.EmotionClassifier(
            example.load_encoder(args, tokenizer), example.num_labels_of(encoded["train"])
        )
        optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
        train_loader = DataLoader(encoded["train"], batch_size=batch_size, shuffle=True, collate_fn=collator)
        eval_loader = DataLoader(encoded["validation"], batch_size=batch_size, collate_fn=collator)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(
            model, optimizer, train_loader, eval_loader
        )
        for epoch in range(args.num_epochs):
            model.train()
            start = time.perf_counter()
            loss_sum, steps, tokens = 0.0, 0, 0
            for batch in train_loader:
                loss, _ = model(**batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                loss_sum, steps = loss_sum + float(loss), steps + 1
                tokens += int(batch["attention_mask"].sum())
            train_seconds = time.perf_counter() - start
            totals = accelerator.reduce(torch.tensor([loss_sum, steps, tokens], dtype=torch.float64), "sum")
            macro_f1, scored = example.evaluate(model, eval_loader, accelerator)
            record = {
                "epoch": epoch + 1,
                "loss": float(totals[0] / totals[1]),
                "macro_f1": macro_f1,
                "train_seconds": train_seconds,
                "epoch_seconds": time.perf_counter() - start,
                "real_tokens": dataset_tokens,
                "tokens_processed": int(totals[2]),
                "tokens_per_second": dataset_tokens / train_seconds,
                "optimizer_steps": steps,
                "batch_size": batch_size,
                "eval_samples": scored,
            }
            results["epochs"].append(record)
            accelerator.print(f"seed epoch {epoch + 1}: {record}")

    inner_training_loop()
    if accelerator.is_main_process:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    accelerator.end_training()


# -- the driver ---------------------------------------------------------------------------------


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
    example: ModuleType, model: str, data_dir: Path, limit: int | None, batch_size: int
) -> tuple[float, int, float]:
    """The cost of ``batch_size`` copies of the longest training text: the seed's worst batch."""
    from transformers import AutoConfig, AutoTokenizer

    from tokenbatch import CostModel, text_lengths

    texts = [row["text"] for row in common.read_jsonl(data_dir / "train.jsonl", limit)]
    longest = int(text_lengths(texts, AutoTokenizer.from_pretrained(model), max_length=512).max())
    crossover = example.attention_crossover(AutoConfig.from_pretrained(model))
    return CostModel.attention(crossover).cost(batch_size, longest), longest, crossover


def time_to(epochs: list[dict[str, Any]], target: float) -> float | None:
    """Wall time (training and validation) until validation macro-F1 first reaches ``target``."""
    elapsed = 0.0
    for record in epochs:
        elapsed += record["epoch_seconds"]
        if record["macro_f1"] >= target:
            return elapsed
    return None


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:2] == ["--worker", "seed"]:  # one process of the seed's arm, under accelerate launch
        seed_worker(argv[2:])
        return
    parser = common.parser(NAME, __doc__.split("\n\n")[0])
    parser.add_argument("--batch_size", type=int, default=32, help="the seed's batch size per process")
    parser.add_argument("--learning_rate", type=float, default=5e-5, help="the seed's learning rate")
    parser.add_argument(
        "--tokenbatch_lrs",
        help="comma-separated learning rates for tokenbatch arms (default 5e-5,1e-4; 5e-5 with --quick)",
    )
    parser.add_argument("--epochs", type=int, help="default 3 (1 with --quick)")
    parser.add_argument("--train_limit", type=int, help="default all 16000 (240 with --quick)")
    parser.add_argument("--eval_limit", type=int, help="default all 2000 (200 with --quick)")
    parser.add_argument("--target", type=float, default=0.85, help="the validation macro-F1 to time")
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    data = common.data_dir()
    if data is None:
        raise SystemExit(
            "benchmarks.training needs the emotion data: set $TOKENBATCH_DATA_DIR or ../shared/data"
        )
    epochs = args.epochs or (1 if args.quick else 3)
    train_limit = args.train_limit or (240 if args.quick else None)
    eval_limit = args.eval_limit or (200 if args.quick else None)
    lrs = args.tokenbatch_lrs or ("5e-5" if args.quick else "5e-5,1e-4")
    model = common.minilm_path()
    example = load_example()
    budget, longest, crossover = worst_case_budget(
        example, model, data / "emotion", train_limit, args.batch_size
    )
    shared = ["--model_name", model, "--data_dir", str(data / "emotion"), "--num_epochs", str(epochs)]
    shared += ["--seed", str(args.seed)]
    shared += ["--train_limit", str(train_limit)] if train_limit else []
    shared += ["--eval_limit", str(eval_limit)] if eval_limit else []
    work = args.out / "training-runs"
    work.mkdir(parents=True, exist_ok=True)

    arms: dict[str, dict[str, Any]] = {}
    runs = [("seed", args.learning_rate)] + [("tokenbatch", float(lr)) for lr in lrs.split(",")]
    for kind, lr in runs:
        label = f"{kind} lr={lr:g}"
        out = work / f"{kind}-lr{lr:g}.json"
        settings = ["--learning_rate", str(lr), "--output_json", str(out)]
        if kind == "seed":
            script = ["-m", "benchmarks.training", "--worker", "seed", "--batch_size", str(args.batch_size)]
        else:
            script = [str(EXAMPLE), "--max_tokens", str(budget)]
        print(f"running {label} ...", flush=True)
        start = time.perf_counter()
        launch([*script, *shared, *settings], args.processes, work / f"{kind}-lr{lr:g}.log")
        arms[label] = json.loads(out.read_text())
        arms[label]["process_seconds"] = time.perf_counter() - start
        print(f"  done in {arms[label]['process_seconds']:.0f} s: {arms[label]['epochs'][-1]}", flush=True)

    best_shared = min(max(e["macro_f1"] for e in arm["epochs"]) for arm in arms.values())
    target = args.target if best_shared >= args.target else best_shared
    rows, summary = [], {}
    seed_label = f"seed lr={args.learning_rate:g}"
    seed_tps = statistics.median(e["tokens_per_second"] for e in arms[seed_label]["epochs"])
    for label, arm in arms.items():
        elapsed = 0.0
        for record in arm["epochs"]:
            elapsed += record["epoch_seconds"]
            rows.append({"arm": label, **record, "elapsed_seconds": elapsed})
        tps = statistics.median(e["tokens_per_second"] for e in arm["epochs"])
        summary[label] = {
            "median_tokens_per_second": tps,
            "tokens_per_second_vs_seed": tps / seed_tps,
            "seconds_to_target": time_to(arm["epochs"], target),
            "best_macro_f1": max(e["macro_f1"] for e in arm["epochs"]),
        }
    columns = ["arm", "epoch", "epoch_seconds", "elapsed_seconds", "tokens_per_second", "optimizer_steps"]
    columns += ["loss", "macro_f1"]
    summary_rows = [{"arm": k, **v} for k, v in summary.items()]
    markdown = "\n\n".join(
        [
            f"Emotion, all-MiniLM-L6-v2, {args.processes} CPU processes x 1 thread; train "
            f"{train_limit or 'all'} texts, validation {eval_limit or 'all'}; seed batch {args.batch_size} "
            f"per process vs tokenbatch max_tokens {budget:.0f} (= cost of {args.batch_size} x the longest "
            f"text, {longest} tokens, attention crossover {crossover:.0f}). Time to macro-F1 {target:.3f}"
            f"{'' if target == args.target else ' (the best every arm reached)'}. "
            "Other agents share this CPU.",
            common.markdown_table(rows, columns),
            common.markdown_table(
                summary_rows,
                [
                    "arm",
                    "median_tokens_per_second",
                    "tokens_per_second_vs_seed",
                    "seconds_to_target",
                    "best_macro_f1",
                ],
            ),
        ]
    )
    results = {
        "settings": {
            "batch_size": args.batch_size,
            "max_tokens": budget,
            "longest": longest,
            "crossover": crossover,
            "epochs": epochs,
            "train_limit": train_limit,
            "eval_limit": eval_limit,
            "processes": args.processes,
            "target": target,
        },
        "arms": arms,
        "summary": summary,
    }
    common.write_results(NAME, args.out, results, markdown)
    print(markdown)


if __name__ == "__main__":
    main()
