"""Fine-tune a causal LM with TRL's SFTTrainer under a token budget: emotion texts -> their label's name.

Each text is a prompt, its label's name the completion that the loss trains on. See README.md beside
this file (and its offline recipe: a tiny Llama built from a config) and docs/trl.md.
"""

from __future__ import annotations

import json
import math
from argparse import ArgumentDefaultsHelpFormatter, ArgumentParser, Namespace
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset, DatasetDict, load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig

from tokenbatch.integrations.trl import TokenBudgetSFTTrainer

LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")
OFFLINE = "examples/sft/README.md builds a tiny one offline (Offline, on CPU)"


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model_name", default="Qwen/Qwen2.5-0.5B", help="hub name or local directory")
    add("--data_dir", type=Path, help="has train.jsonl, validation.jsonl; unset: dair-ai/emotion, hub")
    add("--output_dir", default="sft-emotion", help="checkpoints, one per epoch")
    add("--max_length", type=int, default=256, help="truncate prompt and completion to this many tokens")
    add("--max_tokens", type=float, default=8192, help="budget per batch and process, in padded tokens")
    add("--padding_free", action="store_true", help="batches are packs of whole examples in one row")
    add("--oom_mode", choices=("split", "halve"), default="split", help="on OOM: split, or halve the budget")
    add("--learning_rate", type=float, default=2e-5, help="for 8 texts per process, scaled to each step")
    add("--num_epochs", type=int, default=1, help="epochs to train")
    add("--resume", action="store_true", help="continue from the last checkpoint in --output_dir")
    args = parser.parse_args(argv)
    for name in ("max_length", "max_tokens", "learning_rate", "num_epochs"):
        if not 0 < getattr(args, name) < math.inf:
            parser.error(f"--{name} should be a positive number, but got {name}={getattr(args, name)}")
    return args


def load_pairs(data_dir: Path | None) -> DatasetDict:
    """The emotion splits as prompt/completion pairs (TRL trains on the completion only)."""
    if data_dir is None:
        try:
            data = load_dataset("dair-ai/emotion")
        except Exception as error:  # offline, no cache, or the hub is down: say what to do instead
            raise SystemExit(
                f"Could not load the dair-ai/emotion dataset from the Hugging Face Hub "
                f"({type(error).__name__}: {error}).\nWithout hub access, pass --data_dir DIR with "
                f'train.jsonl and validation.jsonl holding one {{"text": ..., "label": 0-5}} per line.'
            ) from None
    else:
        files = {split: str(data_dir / f"{split}.jsonl") for split in ("train", "validation")}
        data = load_dataset("json", data_files=files)

    def pair(row: dict[str, object]) -> dict[str, str]:
        return {"prompt": f"{row['text']}\nemotion:", "completion": f" {LABELS[int(str(row['label']))]}"}

    return DatasetDict(
        {split: Dataset.from_list([pair(row) for row in data[split]]) for split in ("train", "validation")}
    )


def load_model(name: str) -> tuple[Any, Any]:
    """The tokenizer and causal LM ``name`` (``--model_name``), or an error that says what to pass."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(name)
        model = AutoModelForCausalLM.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"Could not load --model_name {name} ({type(error).__name__}: {error}).\nWithout hub access, "
            f"pass --model_name PATH to a local causal LM directory; {OFFLINE}."
        ) from None
    if tokenizer.eos_token is None:  # TRL appends it to every completion, and fails on None
        raise SystemExit(
            f"The tokenizer of --model_name {name} has no eos_token, which SFTTrainer appends to every "
            f"completion. Give it one and save it with the model (AutoTokenizer.from_pretrained(..., "
            f'eos_token="[SEP]").save_pretrained(PATH) for a BERT tokenizer), or pass a causal LM\'s '
            f"tokenizer; {OFFLINE}."
        )
    return tokenizer, model


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    data = load_pairs(args.data_dir)
    tokenizer, model = load_model(args.model_name)
    config = SFTConfig(
        args.output_dir,
        num_train_epochs=args.num_epochs,
        learning_rate=args.learning_rate,
        per_device_train_batch_size=8,  # not a batch: the step size learning_rate suits (lr_scaling)
        max_length=args.max_length,
        padding_free=args.padding_free,  # packs: the budget counts real tokens (docs/trl.md)
        eval_strategy="epoch",
        save_strategy="epoch",
        logging_steps=10,
        report_to="none",
        bf16=torch.cuda.is_available() and torch.cuda.is_bf16_supported(),
    )
    trainer = TokenBudgetSFTTrainer(
        model=model,
        args=config,
        train_dataset=data["train"],
        eval_dataset=data["validation"],
        processing_class=tokenizer,
        max_tokens=args.max_tokens,
        eval_max_tokens=2 * args.max_tokens,  # no activations kept for backward
        oom_mode=args.oom_mode,
        lr_scaling="linear",
    )
    result = trainer.train(resume_from_checkpoint=args.resume or None)
    metrics = {**result.metrics, **trainer.evaluate()}
    if trainer.is_world_process_zero():
        print(json.dumps({"train_loss": metrics["train_loss"], "eval_loss": metrics["eval_loss"]}))
        print(*(str(event) for event in trainer.oom_events), sep="\n")


if __name__ == "__main__":
    main()
