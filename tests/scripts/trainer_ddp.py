"""TokenBudgetTrainer on 2 processes (``accelerate launch``, CPU, gloo), out-of-memory injected on one rank.

Usage: accelerate launch --num_processes 2 trainer_ddp.py DATA_DIR OUT_DIR

Scenarios, one after the other in the same processes, each rank writing
``OUT_DIR/<scenario>.rank<r>.json`` (what tests/test_integration_transformers.py checks):

- ``split``: oom_mode="split", out of memory in the forward pass on rank 1 only.
- ``halve``: oom_mode="halve", gradient accumulation 2, out of memory in the
  backward pass on rank 0 only; checkpoints after step 3 and at the end of epoch 0.
- ``resumed``: a fresh trainer resumed from the step-3 checkpoint of ``halve``.
- ``evaluation``: an untrained model's ``evaluate()`` (with and without
  ``compute_metrics``) and ``predict()``, then both again with out-of-memory
  injected in the evaluation forward of rank 1 only.

``split`` also evaluates at the end of each epoch (``eval_strategy="epoch"``,
``compute_metrics`` recording the example ids it scored), where rank 1 runs
out of memory too.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent))

from trainer_common import OOM_LIMIT, flat_params, id_metrics, make_trainer, minilm_tokenizer, save_at

from tokenbatch.testing import inject_oom

CHECKPOINT_STEP = 3


def run(
    name: str,
    data_dir: str,
    out: Path,
    tokenizer: Any,
    *,
    where: str,
    ranks: tuple[int, ...],
    resume: str | None = None,
    **options: Any,
) -> Any:
    seen: list[list[int]] = []
    if name == "split":
        options["arguments"] = {"eval_strategy": "epoch", "label_names": ["labels", "idx"]}
        options["compute_metrics"] = id_metrics(seen)
    trainer = make_trainer(data_dir, tokenizer, out / name, **options)
    if name == "halve":
        trainer.add_callback(save_at(steps=(CHECKPOINT_STEP,), epochs=(0,)))
    injector = inject_oom(trainer.model, OOM_LIMIT, where=where, ranks=ranks)
    result = trainer.train(resume_from_checkpoint=resume)
    injector.remove()  # the evaluations below run without injected errors
    rank = trainer.accelerator.process_index
    report = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "global_step": result.global_step,
        "max_steps": trainer.state.max_steps,
        "injected": injector.count,
        "events": [event.as_dict() for event in trainer.oom_events],
        "max_tokens": trainer.oom_fallback.max_tokens,
        "sampler_max_tokens": trainer.train_sampler.max_tokens,
        "steps": trainer.recorder.steps,
        "logs": trainer.recorder.logs,
        "params": flat_params(trainer.model).tolist()[:2000],
        "eval": trainer.evaluate(),
        "eval_ids": seen,
        "eval_oom_events": [event.as_dict() for event in trainer.eval_oom_events],
        "growth": [str(event) for event in trainer.oom_fallback.growth_events],
    }
    (out / f"{name}.rank{rank}.json").write_text(json.dumps(report))
    trainer.accelerator.wait_for_everyone()  # the checkpoints are complete before anyone resumes
    return trainer


def evaluation(data_dir: str, out: Path, tokenizer: Any) -> None:
    seen: list[list[int]] = []
    arguments = {"label_names": ["labels", "idx"]}
    trainer = make_trainer(
        data_dir, tokenizer, out / "evaluation", arguments=arguments, compute_metrics=id_metrics(seen)
    )
    rank = trainer.accelerator.process_index
    report: dict[str, Any] = {"rank": rank, "metrics": trainer.evaluate()}
    predicted = trainer.predict(trainer.eval_dataset)
    report["predictions"] = predicted.predictions.tolist()
    report["label_ids"] = [ids.tolist() for ids in predicted.label_ids]
    trainer.compute_metrics = None
    report["loss_only"] = trainer.evaluate()
    trainer.compute_metrics = id_metrics(seen)
    injector = inject_oom(trainer.model, OOM_LIMIT, ranks=(1,))
    report["oom_metrics"] = trainer.evaluate()
    report["oom_predictions"] = trainer.predict(trainer.eval_dataset).predictions.tolist()
    injector.remove()
    report["injected"] = injector.count
    report["eval_oom_events"] = [e.as_dict() for e in trainer.eval_oom_events]
    report["eval_ids"] = seen
    (out / f"evaluation.rank{rank}.json").write_text(json.dumps(report))


def restore_indexed_cpu() -> None:
    """Let ``torch.load`` restore storages onto ``cpu:0`` (a test-only fix of transformers 4.x on CPU).

    transformers 4.x resumes a multi-process run by loading the optimizer state
    with ``map_location=args.device``, which is ``cpu:0`` on CPU processes, and
    torch restores only ``cpu``: every 2-process CPU resume fails there, with
    any Trainer (5.x loads onto ``cpu``). GPUs are not affected.
    """
    torch.serialization.register_package(
        30, lambda storage: None, lambda storage, location: storage if location.startswith("cpu:") else None
    )


def main() -> None:
    torch.set_num_threads(1)
    if int(transformers.__version__.split(".")[0]) < 5:
        restore_indexed_cpu()
    data_dir, out = sys.argv[1], Path(sys.argv[2])
    tokenizer = minilm_tokenizer()
    run("split", data_dir, out, tokenizer, oom_mode="split", where="forward", ranks=(1,))
    run("halve", data_dir, out, tokenizer, oom_mode="halve", accumulation=2, where="backward", ranks=(0,))
    checkpoint = out / "halve" / f"checkpoint-{CHECKPOINT_STEP}"
    run(
        "resumed",
        data_dir,
        out,
        tokenizer,
        oom_mode="halve",
        accumulation=2,
        where="backward",
        ranks=(0,),
        resume=str(checkpoint),
    )
    # Growth on in halve mode, OOM over OOM_LIMIT on rank 1 throughout: both ranks re-plan alike.
    run(
        "grow",
        data_dir,
        out,
        tokenizer,
        oom_mode="halve",
        oom_grow=True,
        epochs=3,
        where="forward",
        ranks=(1,),
    )
    evaluation(data_dir, out, tokenizer)


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
