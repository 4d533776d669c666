"""Shared pieces of the OOM fallback tests: synthetic data, a tiny BERT, a training loop.

The tests and the scripts they launch import this file by path (the tests
directory is not a package). Everything is small and deterministic so that
two runs can be compared parameter by parameter.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

VOCAB = 64
PAD = 0


def make_rows(n: int = 96, *, seed: int = 0, min_len: int = 4, max_len: int = 40) -> list[dict[str, Any]]:
    """Emotion-like rows: token ids of random lengths (long-tailed), a label out of 6, an index."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(12), 0.5, n).astype(int), min_len, max_len)
    return [
        {"input_ids": rng.integers(1, VOCAB, int(length)).tolist(), "label": int(rng.integers(6)), "idx": i}
        for i, length in enumerate(lengths)
    ]


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded tensors, like transformers' DataCollatorWithPadding, plus each row's index."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": torch.tensor([r["label"] for r in rows]),
        "idx": torch.tensor([r["idx"] for r in rows]),
    }


def tiny_bert(seed: int = 0) -> torch.nn.Module:
    """A 2-layer BERT classifier with hidden size 32 and no dropout (runs are comparable)."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=64,
        num_labels=6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config)


def loss_fn(model: torch.nn.Module) -> Callable[[dict[str, torch.Tensor]], torch.Tensor]:
    """The forward pass the guard runs: the model's mean cross-entropy over the batch."""

    def run(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        inputs = {k: v for k, v in batch.items() if k != "idx"}
        return model(**inputs).loss

    return run


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one float64 vector, for comparing runs."""
    return torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])


def quiet() -> None:
    """One thread, no hub, no warnings about it: fast and the same everywhere."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    torch.set_num_threads(1)
