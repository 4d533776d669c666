"""The processes ``benchmarks.training`` starts under ``accelerate launch``, one per arm.

``python -m benchmarks.training_workers {seed,tokenbatch,throughput} [options]``

Every arm trains the emotion example's task, written out again here because
benchmarks use only tokenbatch's public API: the JSON Lines splits cut to the
first N texts, truncation at 512 tokens, a linear head on the [CLS] hidden state
of a pretrained encoder without its pooler (``examples/emotion/emotion.py``),
and validation macro-F1 with every text scored once.

- ``seed``: the blog post's loop, shuffled fixed batches inside accelerate's
  ``find_executable_batch_size``;
- ``tokenbatch``: the example's loop (``examples/emotion/train.py``): token-budget
  batches under ``OOMFallback``, with ``--lr_scaling`` each step's learning rate
  scaled by its samples against ``--lr_reference`` texts, or with ``--lr_by tokens``
  by its real tokens against as many texts of mean length (``OOMFallback(lr_scaling=...)``);
- ``throughput``: both batchings in alternating chunks of one run.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import find_executable_batch_size, set_seed
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.validation_points import ValidationPoints
from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler, column_lengths
from tokenbatch.integrations.accelerate import finish, gather_samples

MAX_LENGTH = 512


def attention_crossover(config: Any) -> float:
    """``34 * hidden / (5 * heads)``: where a BERT layer's attention scores take as much memory as the rest.

    Korthikanti et al. (2022), 16-bit activations. The committed results were run
    with this crossover (218 for all-MiniLM-L6-v2); the example now takes its cost
    from ``MemoryModel.from_config`` for the device and precision it runs in.
    """
    return float(34.0 * config.hidden_size / (5.0 * config.num_attention_heads))


class EmotionClassifier(nn.Module):
    """The example's model: a linear layer on the encoder's [CLS] hidden state, with cross-entropy."""

    def __init__(self, encoder: Any, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.linear = nn.Linear(int(encoder.config.hidden_size), num_labels)
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        logits = self.linear(hidden[:, 0, :])
        return self.loss_fct(logits, labels), logits


def load_task(args: argparse.Namespace, accelerator: Accelerator) -> tuple[Any, Any, Any]:
    """The tokenizer and the tokenized train and validation splits, as the example makes them."""
    import datasets
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    files = {split: str(Path(args.data_dir) / f"{split}.jsonl") for split in ("train", "validation")}

    def encode(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["text"], truncation=True, max_length=MAX_LENGTH)

    with accelerator.main_process_first():  # the main process tokenizes, the others read its cache
        splits = datasets.load_dataset("json", data_files=files)
        for split, limit in (("train", args.train_limit), ("validation", args.eval_limit)):
            if limit is not None and limit < len(splits[split]):
                splits[split] = splits[split].select(range(limit))
        splits = datasets.DatasetDict(train=splits["train"], validation=splits["validation"])
        encoded = splits.map(encode, batched=True, remove_columns=["text"], desc="Tokenizing")
    encoded = encoded.rename_column("label", "labels")
    return tokenizer, encoded["train"], encoded["validation"]


def load_model(args: argparse.Namespace, train: Any) -> EmotionClassifier:
    from transformers import AutoModel

    encoder = AutoModel.from_pretrained(args.model_name)
    encoder.pooler = None  # the head reads the [CLS] state: the pooler would only cost compute
    return EmotionClassifier(encoder, max(6, int(max(train["labels"])) + 1))


def evaluate(model: nn.Module, loader: Any, accelerator: Accelerator) -> tuple[float, int]:
    """Validation macro-F1 over all processes' predictions, and how many texts were scored."""
    from sklearn.metrics import f1_score

    model.eval()
    pairs = []
    with torch.no_grad():
        for batch in loader:
            pair = torch.stack([model(**batch)[1].argmax(dim=-1), batch["labels"]], dim=1)
            pairs.append(gather_samples(accelerator, pair))
    model.train()
    y_pred, y_true = torch.cat(pairs).cpu().numpy().T
    return float(f1_score(y_true, y_pred, average="macro", zero_division=0)), len(y_true)


def validation_points(
    args: argparse.Namespace, steps_per_epoch: int, model: nn.Module, loader: Any, accelerator: Accelerator
) -> ValidationPoints:
    """Validation ``--evals_per_epoch`` times an epoch (once by default), the last at the epoch's end."""
    return ValidationPoints(
        per_epoch=args.evals_per_epoch or 1,
        steps_per_epoch=steps_per_epoch,
        validate=lambda: evaluate(model, loader, accelerator),
    )


def options(argv: list[str], *extra: tuple[str, type]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    for name in ("--model_name", "--data_dir", "--output_json"):
        parser.add_argument(name, required=True)
    for name in ("--num_epochs", "--train_limit", "--eval_limit", "--seed", "--evals_per_epoch"):
        parser.add_argument(name, type=int)
    for name, kind in extra:
        parser.add_argument(name, type=kind)
    return parser.parse_args(argv)


def seed_worker(argv: list[str]) -> None:
    """The seed's training loop: shuffled fixed batches inside find_executable_batch_size."""
    from transformers import DataCollatorWithPadding

    args = options(argv, ("--batch_size", int), ("--learning_rate", float))
    accelerator = Accelerator()
    set_seed(args.seed)
    tokenizer, train, validation = load_task(args, accelerator)
    collator = DataCollatorWithPadding(tokenizer)
    results: dict[str, Any] = {"epochs": [], "world_size": accelerator.num_processes}
    # accelerate completes the last step by repeating a few texts; count each text once.
    dataset_tokens = int(column_lengths(train).sum())

    @find_executable_batch_size(starting_batch_size=args.batch_size)  # type: ignore[untyped-decorator]
    def inner_training_loop(batch_size: int) -> None:
        accelerator.free_memory()
        set_seed(args.seed)
        model = load_model(args, train)
        optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
        train_loader = DataLoader(train, batch_size=batch_size, shuffle=True, collate_fn=collator)
        eval_loader = DataLoader(validation, batch_size=batch_size, collate_fn=collator)
        model, optimizer, train_loader, eval_loader = accelerator.prepare(
            model, optimizer, train_loader, eval_loader
        )
        points = validation_points(args, len(train_loader), model, eval_loader, accelerator)
        for epoch in range(args.num_epochs):
            model.train()
            start, validated = time.perf_counter(), points.validation_seconds
            loss_sum, steps, tokens = 0.0, 0, 0
            for batch in train_loader:
                loss, _ = model(**batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                loss_sum, steps = loss_sum + loss.item(), steps + 1
                real = int(batch["attention_mask"].sum())
                tokens += real
                points.after_step(epoch, tokens=real)
            train_seconds = time.perf_counter() - start - (points.validation_seconds - validated)
            totals = accelerator.reduce(torch.tensor([loss_sum, steps, tokens], dtype=torch.float64), "sum")
            macro_f1, scored = points.end_epoch()
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
            results["evals"] = points.records
            accelerator.print(f"seed epoch {epoch + 1}: {record}")

    inner_training_loop()  # returns: its references to the DDP model go before finish()
    if accelerator.is_main_process:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    finish(accelerator)


def tokenbatch_worker(argv: list[str]) -> None:
    """The example's loop: token-budget batches under OOMFallback, validation batched the same way."""
    args = options(
        argv,
        *(("--max_tokens", float), ("--learning_rate", float), ("--oom_mode", str)),
        *(("--lr_scaling", str), ("--lr_reference", float), ("--lr_by", str)),
    )
    accelerator = Accelerator()
    results = train_tokenbatch(args, accelerator)  # returns: its references to the DDP model go first
    if accelerator.is_main_process:
        Path(args.output_json).write_text(json.dumps(results, indent=2) + "\n")
    finish(accelerator)


def train_tokenbatch(args: argparse.Namespace, accelerator: Accelerator) -> dict[str, Any]:
    from transformers import DataCollatorWithPadding

    set_seed(args.seed)
    tokenizer, train, validation = load_task(args, accelerator)
    model = load_model(args, train)
    crossover = attention_crossover(model.encoder.config)
    cost = CostModel.attention(crossover)
    collator = DataCollatorWithPadding(tokenizer)
    sampler = TokenBudgetBatchSampler(column_lengths(train), args.max_tokens, cost=cost, seed=args.seed)
    eval_sampler = TokenBudgetBatchSampler(
        column_lengths(validation), args.max_tokens, cost=cost, shuffle=False
    )
    train_loader = DataLoader(train, batch_sampler=sampler, collate_fn=collator)
    eval_loader = DataLoader(validation, batch_sampler=eval_sampler, collate_fn=collator)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    # Unset: no scaling at all, so the unscaled arms run exactly the loop they always ran.
    by = args.lr_by or "samples"  # by tokens, the reference is as many texts of the mean length
    reference = (args.lr_reference or 1) * (float(column_lengths(train).mean()) if by == "tokens" else 1)
    scaling = {}
    if args.lr_scaling:
        scaling = {"lr_scaling": args.lr_scaling, "lr_scaling_by": by, "lr_reference": reference}
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=args.oom_mode or "split", **scaling)
    results: dict[str, Any] = {"epochs": [], "world_size": accelerator.num_processes, "crossover": crossover}
    points = validation_points(args, len(train_loader), model, eval_loader, accelerator)
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        start, validated = time.perf_counter(), points.validation_seconds
        loss_sum, steps, tokens, scales = 0.0, 0, 0, []
        for batch in fallback.iterate(train_loader):
            loss = fallback.backward(batch, lambda b: model(**b)[0])
            if loss is not None:  # None: this step hit OOM in halve mode and is re-planned
                if scaling:  # the step's rate, scaled by its real tokens on all processes
                    scales.append(fallback.step(optimizer))
                else:
                    optimizer.step()
                    scales.append(1.0)
                optimizer.zero_grad()
                loss_sum += float(loss)
                steps += 1
                real = int(batch["attention_mask"].sum())
                tokens += real
                points.after_step(epoch, tokens=real)
        train_seconds = time.perf_counter() - start - (points.validation_seconds - validated)
        totals = accelerator.reduce(
            torch.tensor([loss_sum, steps, tokens], dtype=torch.float64, device=accelerator.device), "sum"
        )
        macro_f1, scored = points.end_epoch()
        record = {
            "epoch": epoch + 1,
            "loss": float(totals[0] / max(float(totals[1]), 1.0)),
            "macro_f1": macro_f1,
            "train_seconds": train_seconds,
            "epoch_seconds": time.perf_counter() - start,
            "real_tokens": int(totals[2]),
            "tokens_per_second": float(totals[2]) / train_seconds,
            "optimizer_steps": steps,
            "lr_scale_mean": sum(scales) / max(len(scales), 1),
            "lr_scale_min": min(scales, default=1.0),
            "lr_scale_max": max(scales, default=1.0),
            "max_tokens": float(fallback.max_tokens),
            "sampler_max_tokens": float(sampler.max_tokens),
            "oom_events": len(fallback.events),
            "eval_samples": scored,
        }
        results["epochs"].append(record)
        accelerator.print(f"tokenbatch epoch {epoch + 1}: {record}")
    results["oom_events"] = [event.as_dict() for event in fallback.events]
    results["evals"] = points.records
    return results


def throughput_worker(argv: list[str]) -> None:
    """Real tokens/s of both batchings measured in alternation, so both see the same machine load.

    One model and optimizer; each round trains a chunk of seed batches then a chunk
    of token-budget batches (the order alternates), with the same plain loop, and
    over all rounds each arm covers about one epoch of its own batches.
    """
    args = options(argv, ("--batch_size", int), ("--rounds", int), ("--max_tokens", float))
    args.eval_limit = 1  # no validation here: tokenize one validation text only
    accelerator = Accelerator()
    chunks = measure_throughput(args, accelerator)  # returns: its references to the DDP model go first
    if accelerator.is_main_process:
        Path(args.output_json).write_text(json.dumps({"chunks": chunks}, indent=2) + "\n")
    finish(accelerator)


def measure_throughput(args: argparse.Namespace, accelerator: Accelerator) -> list[dict[str, Any]]:
    from transformers import DataCollatorWithPadding

    set_seed(args.seed)
    tokenizer, train, _ = load_task(args, accelerator)
    collator = DataCollatorWithPadding(tokenizer)
    model = load_model(args, train)
    optimizer = torch.optim.Adam(model.parameters(), lr=5e-5)
    cost = CostModel.attention(attention_crossover(model.encoder.config))
    sampler = TokenBudgetBatchSampler(column_lengths(train), args.max_tokens, cost=cost, seed=args.seed)
    loaders = {
        "seed": DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collator),
        "tokenbatch": DataLoader(train, batch_sampler=sampler, collate_fn=collator),
    }
    model, optimizer, loaders["seed"], loaders["tokenbatch"] = accelerator.prepare(
        model, optimizer, loaders["seed"], loaders["tokenbatch"]
    )
    chunk = {arm: max(1, math.ceil(len(loader) / args.rounds)) for arm, loader in loaders.items()}
    streams = {arm: iter(loader) for arm, loader in loaders.items()}

    def next_batch(arm: str) -> Any:
        try:
            return next(streams[arm])
        except StopIteration:
            streams[arm] = iter(loaders[arm])
            return next(streams[arm])

    chunks = []
    model.train()
    for number in range(args.rounds):
        for arm in ("seed", "tokenbatch") if number % 2 == 0 else ("tokenbatch", "seed"):
            accelerator.wait_for_everyone()
            start, tokens = time.perf_counter(), 0
            for _ in range(chunk[arm]):
                batch = next_batch(arm)
                loss, _ = model(**batch)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                tokens += int(batch["attention_mask"].sum())
            seconds = time.perf_counter() - start
            total = float(accelerator.reduce(torch.tensor([float(tokens)], dtype=torch.float64), "sum")[0])
            chunks.append(
                {"round": number, "arm": arm, "steps": chunk[arm], "tokens": total, "seconds": seconds}
            )
            accelerator.print(f"round {number} {arm}: {total / seconds:.0f} real tokens/s")
    return chunks


WORKERS = {"seed": seed_worker, "tokenbatch": tokenbatch_worker, "throughput": throughput_worker}

if __name__ == "__main__":
    WORKERS[sys.argv[1]](sys.argv[2:])
