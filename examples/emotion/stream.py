"""Fine-tune on emotion streamed from its JSON Lines file: token-budget batches without lengths up front.

``train.py``'s task (emotion.py's data and model) read with ``datasets``' ``streaming=True`` through a
``TokenBudgetStream``: each process reads its own part, holds ``--buffer_size`` texts, and draws batches
of similar lengths within ``--max_tokens``; every process ends each epoch at the same step. Out of memory,
``OOMFallback`` splits the batch or halves the stream's budget (``--oom_mode``). README.md has the commands.
"""

from __future__ import annotations

import logging
from argparse import ArgumentDefaultsHelpFormatter, ArgumentParser, Namespace
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from emotion import LABELS, EmotionClassifier, load_encoder, load_tokenizer
from torch.utils.data import DataLoader
from transformers import DataCollatorWithPadding

from tokenbatch import OOMFallback, TokenBudgetStream
from tokenbatch.integrations.accelerate import finish, token_cost


def parse_args(argv: list[str] | None = None) -> Namespace:
    parser = ArgumentParser(description=__doc__.split("\n")[0], formatter_class=ArgumentDefaultsHelpFormatter)
    add = parser.add_argument
    add("--model_name", default="bert-base-cased", help="hub name or local directory")
    add("--train_file", type=Path, required=True, help="JSON Lines, one {'text': ..., 'label': 0-5} a line")
    add("--max_length", type=int, default=512, help="truncate texts to this many tokens")
    add("--max_tokens", type=float, default=16384, help="budget per batch and process, in padded tokens")
    add("--buffer_size", type=int, default=10_000, help="texts each process holds to batch from")
    add("--oom_mode", choices=("split", "halve"), default="split", help="on OOM: split, or halve the budget")
    add("--learning_rate", type=float, default=5e-5, help="Adam's learning rate")
    add("--num_epochs", type=int, default=2, help="passes over the file")
    return parser.parse_args(argv)


def train(args: Namespace, accelerator: Accelerator) -> list[dict[str, Any]]:
    """Train; return per epoch the steps, texts and real tokens trained on all processes, and the loss."""
    tokenizer = load_tokenizer(args.model_name)
    data = datasets.load_dataset("json", data_files=str(args.train_file), split="train", streaming=True)
    encode = lambda row: tokenizer(row["text"], truncation=True, max_length=args.max_length)  # noqa: E731
    data = data.map(encode, remove_columns=["text"]).rename_column("label", "labels")
    model = EmotionClassifier(load_encoder(args.model_name), len(LABELS))
    cost = token_cost(accelerator, model.encoder.config, task="base")
    stream = TokenBudgetStream(data, args.max_tokens, cost=cost, buffer_size=args.buffer_size)
    # The stream's DataLoader stays out of prepare(): each process reads its own part (docs/streaming.md).
    loader = DataLoader(stream, batch_size=None, collate_fn=DataCollatorWithPadding(tokenizer))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    model, optimizer = accelerator.prepare(model, optimizer)
    fallback = OOMFallback(stream, model, accelerator=accelerator, mode=args.oom_mode)
    epochs = []
    for epoch in range(args.num_epochs):
        stream.set_epoch(epoch)
        totals = torch.zeros(4, dtype=torch.float64)  # loss sum, steps, texts, real tokens
        for batch in fallback.iterate(loader):
            batch = batch.to(accelerator.device)
            loss = fallback.backward(batch, lambda b: model(**b)[0])  # never None on a stream
            fallback.step(optimizer)
            optimizer.zero_grad()
            totals += torch.tensor([float(loss), 1, len(batch["labels"]), int(batch["attention_mask"].sum())])
        loss_sum, steps, texts, tokens = accelerator.reduce(totals.to(accelerator.device)).tolist()
        epochs.append(
            dict(
                epoch=epoch + 1,
                loss=loss_sum / max(steps, 1.0),
                steps=int(totals[1]),
                texts=int(texts),
                real_tokens=int(tokens),
                oom_events=len(fallback.events),
                max_tokens=fallback.max_tokens,
            )
        )
        accelerator.print(
            "Epoch: {epoch}\tloss: {loss:.4f}\t({steps} steps, {texts} texts, budget {max_tokens:g}, "
            "{oom_events} OOM events)".format(**epochs[-1])
        )
    return epochs


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    epochs = train(parse_args(argv), accelerator := Accelerator())
    finish(accelerator)  # after train() returned, so that no reference to the DDP model is left
    return epochs


if __name__ == "__main__":
    main()
