"""Fine-tune BERT for 6-way emotion classification under a token budget, with accelerate.

The seed's script (a linear head on the [CLS] state, cross-entropy, Adam; the mean loss and the validation
macro-F1 per epoch) on batches of similar-length texts whose padded cost fits ``--max_tokens``; a batch that
still runs out of memory is split or the epoch re-planned at half the budget (``--oom_mode``), and every
process carries on from the same step. README.md has the commands and output, emotion.py the data and model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from argparse import ArgumentDefaultsHelpFormatter, ArgumentParser, Namespace
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from emotion import EmotionClassifier, load_encoder, load_splits, load_tokenizer, num_labels_of, tokenize
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import DataCollatorWithPadding

from tokenbatch import (
    BatchScaledLR,
    CostModel,
    OOMFallback,
    TokenBudgetBatchSampler,
    auto_budget,
    column_lengths,
)
from tokenbatch.integrations.accelerate import finish, gather_samples, progress, token_cost
from tokenbatch.probe import parse_memory, synthetic_batch
from tokenbatch.testing import inject_oom

POSITIVE = ("max_length", "train_limit", "eval_limit", "max_tokens", "eval_max_tokens", "crossover")
EPOCH_LINE = (
    "Epoch: {epoch}\tloss: {loss:.4f}\tmacro-F1: {macro_f1:.4f}\t({optimizer_steps} steps, budget "
    "{max_tokens:g}, {train_seconds:.1f} s, {tokens_per_second:,.0f} real tokens/s, {oom_events} OOM events)"
)


def budget(text: str) -> float | str:
    """``--max_tokens``: a number, or ``auto`` (the remembered budget, else the probe's)."""
    return "auto" if text.strip().lower() == "auto" else float(text)


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model_name", default="bert-base-cased", help="hub name or local directory")
    add("--data_dir", type=Path, help="has train.jsonl, validation.jsonl; unset: dair-ai/emotion, hub")
    add("--max_length", type=int, default=512, help="truncate texts to this many tokens")
    add("--train_limit", type=int, help="train on the first N training texts only")
    add("--eval_limit", type=int, help="validate on the first N validation texts only")
    add("--max_tokens", type=budget, default=16384, help="budget per batch and process, in tokens, or auto")
    add(
        "--memory_limit",
        type=parse_memory,
        help="--max_tokens auto: bytes (8GiB); unset: GPU free, CPU rlimit",
    )
    add("--eval_max_tokens", type=float, help="budget for validation batches; unset: --max_tokens")
    add("--crossover", type=float, help="length at which attention doubles a text's cost; unset: the model's")
    add("--pad_to_multiple_of", type=int, help="pad batches to a multiple of this")
    add("--oom_mode", choices=("split", "halve"), default="split", help="on OOM: split, or halve the budget")
    add("--simulate_oom_above", type=float, help="rehearsal: training batches costing more run out of memory")
    add("--simulate_oom_where", choices=("forward", "backward"), default="forward", help="in this pass")
    add("--simulate_oom_rank", type=int, help="on this rank only; unset: every rank")
    add("--learning_rate", type=float, default=5e-5, help="Adam's learning rate")
    add("--lr_scaling", choices=("none", "sqrt", "linear"), default="linear", help="lr x rule(step/ref.)")
    add("--lr_reference", type=float, help="texts per step, all processes, the lr suits (32 per process)")
    add("--num_epochs", type=int, default=5, help="epochs to train")
    add("--seed", type=int, default=0, help="seed of the plans and of the head's initialisation")
    args = parser.parse_args(argv)
    for name in (*POSITIVE, "pad_to_multiple_of", "simulate_oom_above", "num_epochs", "lr_reference"):
        if (value := getattr(args, name)) not in (None, "auto") and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name} should be a positive number, but got {name}={value}")
    return args


def evaluate(model: torch.nn.Module, loader: Any, accelerator: Accelerator) -> tuple[float, int]:
    """Validation macro-F1 over all processes' predictions, and how many texts were scored."""
    model.eval()
    pairs = []  # (prediction, label) rows of every process: their batch sizes differ, gather_samples copes
    with torch.no_grad():
        for batch in tqdm(loader, "validation", disable=not accelerator.is_local_main_process, leave=False):
            pair = torch.stack([model(**batch)[1].argmax(dim=-1), batch["labels"]], dim=1)
            pairs.append(gather_samples(accelerator, pair))
    model.train()
    y_pred, y_true = torch.cat(pairs).cpu().numpy().T
    return float(f1_score(y_true, y_pred, average="macro", zero_division=0)), len(y_true)


def train(args: Namespace, accelerator: Accelerator) -> list[dict[str, Any]]:
    """Run the whole fine-tuning; return the per-epoch metrics (the same on every process)."""
    set_seed(args.seed)
    accelerator.is_local_main_process or datasets.disable_progress_bars()  # one process draws the bars
    tokenizer = load_tokenizer(args.model_name)
    with accelerator.main_process_first():  # the main process tokenizes, the others read its cache
        encoded = tokenize(load_splits(args), tokenizer, args.max_length)
    train_set, eval_set = encoded["train"], encoded["validation"]
    model = EmotionClassifier(load_encoder(args.model_name, tokenizer), num_labels_of(train_set))
    pad = args.pad_to_multiple_of or 1  # the cost: the encoder's memory per batch here, in padded tokens
    cost = token_cost(accelerator, model.encoder.config, task="base", pad_to_multiple_of=pad)
    cost = CostModel.attention(args.crossover, pad_to_multiple_of=pad) if args.crossover else cost
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=args.pad_to_multiple_of)
    lengths = column_lengths(train_set)  # as the collator pads them: the input_ids, special tokens included
    sampler = TokenBudgetBatchSampler(lengths, args.max_tokens, cost=cost, seed=args.seed)
    if not sampler.resolved:  # --max_tokens auto: the remembered budget, else the probe's, on every process
        model.to(accelerator.device)  # the probe measures on the training device

        def make_batch(size: int, length: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
            batch = synthetic_batch(model.encoder, size, length, generator)  # the encoder's inputs, + labels
            return {**batch, "labels": torch.zeros(size, dtype=torch.long)}

        chosen = auto_budget(
            model, sampler, config=model.encoder.config, memory_limit=args.memory_limit, make_batch=make_batch
        )
        accelerator.print(f"--max_tokens auto: {chosen}")
    eval_budget = args.eval_max_tokens or sampler.max_tokens
    eval_sampler = TokenBudgetBatchSampler(column_lengths(eval_set), eval_budget, cost=cost, shuffle=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, DataLoader(train_set, batch_sampler=sampler, collate_fn=collator),
        DataLoader(eval_set, batch_sampler=eval_sampler, collate_fn=collator),
    )  # fmt: skip
    # No find_unused_parameters (the seed's fix for the unused pooler): it is dropped, OOMFallback syncs.
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=args.oom_mode)
    # The seed's batch of 32 per process; counted in real tokens, steadier than texts under a budget (README).
    texts = args.lr_reference or 32 * accelerator.num_processes
    scaling = BatchScaledLR(optimizer, reference=texts * lengths.mean(), by="tokens", rule=args.lr_scaling)
    stats, crossover = sampler.stats(), 1 / cost.quadratic if cost.quadratic else math.inf
    accelerator.print(
        f"{len(train_set)} training texts, {len(eval_set)} validation texts, {accelerator.num_processes} "
        f"process(es), max_tokens={sampler.max_tokens:g} per process, attention crossover {crossover:.0f}: "
        f"{stats.num_steps} steps per epoch, {stats.mean_batch_size:.1f} texts per batch on average "
        f"(at most {stats.max_batch_size}), {stats.padding_efficiency:.0%} of padded tokens are real; "
        f"lr {args.learning_rate:g} scaled per step ({args.lr_scaling}) by {texts:g} texts of mean length"
    )
    ranks, epochs = None if args.simulate_oom_rank is None else [args.simulate_oom_rank], []
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        start, totals = time.perf_counter(), np.zeros(3)  # loss sum, steps and real tokens of this process
        rehearsal = args.simulate_oom_above and inject_oom(  # during training only: validation is left alone
            model, args.simulate_oom_above, where=args.simulate_oom_where, ranks=ranks, cost=cost
        )
        with rehearsal or contextlib.nullcontext():
            for batch in progress(fallback, train_loader, desc=f"epoch {epoch + 1}"):
                loss = fallback.backward(batch, lambda b: model(**b)[0])
                if loss is not None:  # None: this step hit OOM in halve mode and is re-planned
                    with scaling.applied(scaling.step_size(batch)):  # this step's tokens on all processes
                        optimizer.step()
                    optimizer.zero_grad()
                    totals += (float(loss), 1, int(batch["attention_mask"].sum()))
        seconds = time.perf_counter() - start
        loss_sum, steps, tokens = accelerator.reduce(torch.tensor(totals, device=accelerator.device)).tolist()
        macro_f1, scored = evaluate(model, eval_loader, accelerator)
        epochs.append(dict(
            epoch=epoch + 1, loss=loss_sum / max(steps, 1.0), macro_f1=macro_f1, eval_samples=scored,
            train_seconds=seconds, epoch_seconds=time.perf_counter() - start, optimizer_steps=int(totals[1]),
            real_tokens=int(tokens), tokens_per_second=tokens / seconds, oom_events=len(fallback.events),
            max_tokens=fallback.max_tokens, sampler_max_tokens=sampler.max_tokens,
        ))  # fmt: skip
        accelerator.print(EPOCH_LINE.format(**epochs[-1]))
    return epochs


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    train(parse_args(argv), accelerator := Accelerator())
    finish(accelerator)  # after train() returned, so that no reference to the DDP model is left


if __name__ == "__main__":
    main()
