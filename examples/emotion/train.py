"""Fine-tune BERT for 6-way emotion classification under a token budget, with accelerate (see README.md).

The seed's script on batches of similar-length texts; out of memory, every process splits them or re-plans.
"""

from __future__ import annotations

import logging
from argparse import ArgumentDefaultsHelpFormatter, ArgumentParser, Namespace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from emotion import LABELS, EmotionClassifier, load_encoder, load_splits, load_tokenizer, tokenize
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import DataCollatorWithPadding

from tokenbatch import OOMFallback, TokenBudgetBatchSampler, auto_budget, column_lengths
from tokenbatch.integrations.accelerate import finish, gather_samples, progress, token_cost
from tokenbatch.probe import parse_memory


def budget(text: str) -> float | str:
    """``--max_tokens``: a number, or ``auto`` (the remembered budget, else the probe's)."""
    return "auto" if text.strip().lower() == "auto" else float(text)


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model_name", default="bert-base-cased", help="hub name or local directory")
    add("--data_dir", type=Path, help="has train.jsonl, validation.jsonl; unset: dair-ai/emotion, hub")
    add("--max_length", type=int, default=512, help="truncate texts to this many tokens")
    add("--max_tokens", type=budget, default=16384, help="budget per batch and process, in tokens, or auto")
    add("--memory_limit", type=parse_memory, help="for auto: bytes, or 8GiB; unset: GPU free, CPU rlimit")
    add("--oom_mode", choices=("split", "halve"), default="split", help="on OOM: split, or halve the budget")
    add("--learning_rate", type=float, default=5e-5, help="Adam's, for the seed's 32 texts per process")
    add("--num_epochs", type=int, default=5, help="epochs to train")
    args = parser.parse_args(argv)
    for name in ("max_length", "max_tokens", "learning_rate", "num_epochs"):
        if (value := getattr(args, name)) != "auto" and not 0 < value < float("inf"):
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
    tokenizer = load_tokenizer(args.model_name)
    with accelerator.main_process_first():  # the main process tokenizes, the others read its cache
        train_set, eval_set = tokenize(load_splits(args.data_dir), tokenizer, args.max_length).values()
    model = EmotionClassifier(load_encoder(args.model_name), len(LABELS))
    cost = token_cost(accelerator, model.encoder.config, task="base")  # the encoder's memory, in tokens
    collator = DataCollatorWithPadding(tokenizer)
    lengths = column_lengths(train_set)  # as the collator pads them: the input_ids, special tokens included
    # The seed's batch of 32 per process, in real tokens: steadier than texts under a budget (README.md).
    reference, mean = 32 * accelerator.num_processes * float(lengths.mean()), float(lengths.mean())
    accelerator.print(
        f"lr {args.learning_rate:g} scaled per step (linear) by its real tokens over {reference:.0f} "
        f"(32 texts x {accelerator.num_processes} process(es) x mean length {mean:.2f})"
    )
    sampler = TokenBudgetBatchSampler(lengths, args.max_tokens, cost=cost)
    if not sampler.resolved:  # --max_tokens auto: the remembered budget, else the probe's, on every process
        model.to(accelerator.device)  # probed on the training device, in batches shaped like a real one
        chosen = auto_budget(model, sampler, memory_limit=args.memory_limit, batch=collator(train_set[:8]))
        accelerator.print(f"--max_tokens auto: {chosen}")
    evals = TokenBudgetBatchSampler(column_lengths(eval_set), sampler.max_tokens, cost=cost, shuffle=False)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train_set, batch_sampler=sampler, collate_fn=collator),
        DataLoader(eval_set, batch_sampler=evals, collate_fn=collator),
    )
    scaling = dict(lr_scaling="linear", lr_reference=reference)  # no find_unused_parameters: the guard syncs
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=args.oom_mode, **scaling)
    epochs = []
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        totals = np.zeros(3)  # loss sum, steps and real tokens of this process
        for batch in progress(fallback, train_loader, desc=f"epoch {epoch + 1}"):
            loss = fallback.backward(batch, lambda b: model(**b)[0])
            if loss is not None:  # None: this step hit OOM in halve mode and is re-planned
                fallback.step(optimizer)  # at lr x this step's real tokens on all processes / reference
                optimizer.zero_grad()
                totals += (float(loss), 1, int(batch["attention_mask"].sum()))
        summed = accelerator.reduce(torch.tensor(totals, device=accelerator.device)).tolist()  # all processes
        macro_f1, scored = evaluate(model, eval_loader, accelerator)
        epochs.append(
            dict(
                epoch=epoch + 1,
                loss=summed[0] / max(summed[1], 1),
                macro_f1=macro_f1,
                eval_samples=scored,
                steps=int(totals[1]),
                real_tokens=int(summed[2]),
                max_tokens=fallback.max_tokens,
                oom_events=len(fallback.events),
            )
        )
        accelerator.print(
            "Epoch: {epoch}\tloss: {loss:.4f}\tmacro-F1: {macro_f1:.4f}\t({steps} steps, {real_tokens} real "
            "tokens, budget {max_tokens:g}, {oom_events} OOM events)".format(**epochs[-1])
        )
    return epochs


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    train(parse_args(argv), accelerator := Accelerator())
    finish(accelerator)  # after train() returned, so that no reference to the DDP model is left


if __name__ == "__main__":
    main()
