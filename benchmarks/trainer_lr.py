"""``TokenBudgetTrainer(lr_scaling="linear")`` at the seed's rate against a hand-tuned rate, in Trainer.

The same question as ``benchmarks/lr_scaling.py``, asked of the Trainer
integration rather than the example's loop: all-MiniLM-L6-v2 with transformers'
sequence-classification head, emotion texts, token-budget batches
(``max_tokens`` the cost of 32 copies of the longest text), a constant rate,
AdamW without weight decay, validation macro-F1 every ``--eval_every`` steps.
Arms, one process each, per seed: ``scaled`` (5e-5, ``lr_scaling="linear"``,
``per_device_train_batch_size=32``, the seed's batch, as the reference) and
``hand-tuned`` (2e-4, no scaling). They train the same batches, so the ratio of
their steps to the target is their time ratio.

    python -m benchmarks.trainer_lr --quick
    python -m benchmarks.trainer_lr --seeds 0,1    # about 20 minutes on 2 cores
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.lr_scaling import summarize
from benchmarks.training import worst_case_budget

NAME = "trainer_lr"


def worker(spec: dict[str, Any]) -> None:
    """One Trainer run (in its own process): its validation records go to ``spec["out"]``."""
    import numpy as np
    import torch
    from accelerate import PartialState
    from sklearn.metrics import f1_score
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, TrainingArguments

    from benchmarks.training_workers import load_task
    from tokenbatch import CostModel
    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    torch.set_num_threads(1)
    args = type("Args", (), spec)()
    tokenizer = AutoTokenizer.from_pretrained(spec["model_name"])
    _, train, validation = load_task(args, PartialState())  # its main_process_first, as Trainer's
    model = AutoModelForSequenceClassification.from_pretrained(spec["model_name"], num_labels=6)

    def macro_f1(prediction: Any) -> dict[str, float]:
        labels = np.argmax(prediction.predictions, axis=-1)
        return {"macro_f1": float(f1_score(prediction.label_ids, labels, average="macro", zero_division=0))}

    arguments = TrainingArguments(
        spec["work"],
        num_train_epochs=spec["num_epochs"],
        learning_rate=spec["learning_rate"],
        per_device_train_batch_size=32,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        eval_strategy="steps",
        eval_steps=spec["eval_every"],
        logging_steps=spec["eval_every"],
        save_strategy="no",
        report_to=[],
        seed=spec["seed"],
        data_seed=spec["seed"],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    trainer = TokenBudgetTrainer(
        model=model,
        args=arguments,
        train_dataset=train,
        eval_dataset=validation,
        processing_class=tokenizer,
        compute_metrics=macro_f1,
        max_tokens=spec["max_tokens"],
        cost=CostModel.attention(spec["crossover"]),
        oom_mode=None,
        lr_scaling=spec["lr_scaling"],
    )
    trainer.train()
    steps_per_epoch = trainer.train_sampler.plan.num_steps  # type: ignore[union-attr]
    evals = [
        {"step": r["step"], "epoch": r["step"] / steps_per_epoch, "macro_f1": r["eval_macro_f1"]}
        for r in trainer.state.log_history
        if "eval_macro_f1" in r
    ]
    scales = [r["lr_scale"] for r in trainer.state.log_history if "lr_scale" in r]
    epochs = [{"lr_scale_mean": sum(scales) / len(scales) if scales else 1.0}]
    result = {"evals": evals, "epochs": epochs, "steps_per_epoch": steps_per_epoch}
    Path(spec["out"]).write_text(json.dumps(result))


def rounded(values: list[float]) -> str:
    return ", ".join(f"{value:.3f}" for value in values) or "no pair"


def saved_run(spec: dict[str, Any]) -> dict[str, Any] | None:
    """The run ``spec`` as an earlier invocation saved it (``--reuse``), or None."""
    path = Path(spec["out"])
    if not path.exists():
        return None
    result = json.loads(path.read_text())
    return {"arm": spec["arm"], "seed": spec["seed"], "lr": spec["learning_rate"], **result}


def launch(spec: dict[str, Any]) -> dict[str, Any]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
    with open(Path(spec["out"]).with_suffix(".log"), "w") as log:
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.trainer_lr", "--worker", json.dumps(spec)],
            env=env,
            cwd=common.REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            check=False,
        )
    if done.returncode != 0:
        raise SystemExit(f"{spec['arm']} seed {spec['seed']} failed (exit {done.returncode}); see its log")
    print(f"  {spec['arm']} seed {spec['seed']} done", flush=True)
    result = json.loads(Path(spec["out"]).read_text())
    return {"arm": spec["arm"], "seed": spec["seed"], "lr": spec["learning_rate"], **result}


def main(argv: list[str] | None = None) -> None:
    if argv is None and sys.argv[1:2] == ["--worker"]:
        worker(json.loads(sys.argv[2]))
        return
    parser = common.parser(NAME, __doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--epochs", type=int, help="default 3 (1 with --quick)")
    parser.add_argument("--train_limit", type=int, help="default 4000 (240 with --quick)")
    parser.add_argument("--eval_every", type=int, default=9, help="validate every N optimizer steps")
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--reuse", action="store_true", help="take runs already saved in --out")
    args = parser.parse_args(argv)
    data = common.data_dir()
    if data is None:
        raise SystemExit(f"benchmarks.{NAME} needs the emotion data: set $TOKENBATCH_DATA_DIR")
    seeds = [int(s) for s in args.seeds.split(",") if s][: 1 if args.quick else None]
    epochs = args.epochs or (1 if args.quick else 3)
    train_limit = args.train_limit or (240 if args.quick else 4000)
    target = min(args.target, 0.1) if args.quick else args.target
    model = common.minilm_path()
    budget, _, crossover = worst_case_budget(model, data / "emotion", train_limit, 32)
    work = args.out / "trainer-lr-runs"
    work.mkdir(parents=True, exist_ok=True)
    base = {
        "model_name": model,
        "data_dir": str(data / "emotion"),
        "train_limit": train_limit,
        "eval_limit": 200 if args.quick else None,
        "num_epochs": epochs,
        "max_tokens": budget,
        "crossover": crossover,
        "eval_every": args.eval_every,
    }
    arms = {"hand-tuned": (2e-4, "none"), "scaled": (5e-5, "linear")}
    specs = [
        {
            **base,
            "arm": arm,
            "seed": seed,
            "learning_rate": lr,
            "lr_scaling": rule,
            "out": str(work / f"{arm}-seed{seed}.json"),
            "work": str(work / f"{arm}-seed{seed}"),
        }
        for seed in seeds
        for arm, (lr, rule) in arms.items()
    ]
    saved = {spec["out"]: saved_run(spec) for spec in specs} if args.reuse else {}
    todo = [spec for spec in specs if saved.get(spec["out"]) is None]
    with ThreadPoolExecutor(2) as pool:  # one run per core
        trained = dict(zip([spec["out"] for spec in todo], pool.map(launch, todo), strict=True))
    runs = [saved.get(spec["out"]) or trained[spec["out"]] for spec in specs]
    summary = summarize(runs, target)
    text = "\n\n".join(
        [
            f"TokenBudgetTrainer, all-MiniLM-L6-v2 (sequence-classification head), 1 CPU process per run; "
            f"train {train_limit} texts, validation {base['eval_limit'] or 'all'}, every {args.eval_every} "
            f"steps; max_tokens {budget:.0f}, {epochs} epochs, constant rate, seeds {args.seeds}. "
            f"Target macro-F1 {target}.",
            common.markdown_table(
                [{k: "-" if v is None else v for k, v in row.items()} for row in summary["rows"]],
                [c for c in summary["rows"][0] if "seconds" not in c],  # Trainer's records carry no time
            ),
            "Scaled over hand-tuned, steps to the target, paired by seed where both reached it: first "
            f"validation {rounded(summary['ratios']['scaled_over_hand_tuned_steps'])}, interpolated "
            f"{rounded(summary['ratios']['scaled_over_hand_tuned_interpolated'])}.",
        ]
    )
    common.write_results(NAME, args.out, {"runs": runs, **summary}, text)
    print(text)


if __name__ == "__main__":
    main()
