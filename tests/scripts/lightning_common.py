"""Shared pieces of the Lightning tests: tiny data, a tiny model, a LightningModule that records.

Imported by path by tests/test_integration_lightning.py and tests/scripts/lightning_ddp.py
(the tests directory is not a package). The module writes down, per epoch, the
sample indices of every batch it trained, so that the tests can check that each
sample is trained exactly once per epoch across ranks and that plans change.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.integrations.lightning import oom_fallback

VOCAB, PAD, NUM_SAMPLES, BUDGET = 50, 0, 64, 128


def make_rows(n: int = NUM_SAMPLES, seed: int = 0) -> list[dict[str, Any]]:
    """Token-id rows of 3 to 30 tokens, a label out of 4, and each row's index."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(10), 0.5, n).astype(int), 3, 30)
    return [
        {"input_ids": rng.integers(1, VOCAB, int(length)).tolist(), "label": int(rng.integers(4)), "idx": i}
        for i, length in enumerate(lengths)
    ]


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Right-padded ids and mask, labels, and the rows' indices."""
    width = max(len(r["input_ids"]) for r in rows)
    ids = torch.full((len(rows), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row["input_ids"])] = torch.tensor(row["input_ids"])
        mask[i, : len(row["input_ids"])] = 1
    labels = torch.tensor([r["label"] for r in rows])
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "labels": labels,
        "idx": torch.tensor([r["idx"] for r in rows]),
    }


def make_sampler(rows: list[dict[str, Any]], **options: Any) -> TokenBudgetBatchSampler:
    return TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], max_tokens=BUDGET, seed=3, **options)


class TinyClassifier(nn.Module):
    """Mean-pooled embeddings and a linear head; returns the mean cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8, padding_idx=PAD)
        self.head = nn.Linear(8, 4)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor
    ) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return nn.functional.cross_entropy(self.head(pooled), labels)


class Recorder(pl.LightningModule):
    """Trains TinyClassifier on ``rows`` with ``sampler``; records every batch's indices per epoch.

    ``manual=True`` runs manual optimisation through :func:`oom_fallback`
    (``mode`` and ``grow`` as given; ``grow=None``: its default); otherwise Lightning's automatic
    optimisation.
    With ``sampler=None`` it builds one inside train_dataloader(), with
    ``rank=self.trainer.global_rank`` if ``rank_in_hook``, else without ``rank=``.
    ``num_workers`` worker processes read batches ahead of training.
    """

    def __init__(
        self,
        rows: list[dict[str, Any]],
        sampler: TokenBudgetBatchSampler | None,
        *,
        manual: bool = False,
        mode: str = "split",
        rank_in_hook: bool = False,
        num_workers: int = 0,
        grow: Any = None,
    ) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = TinyClassifier()
        self.rows, self.sampler = rows, sampler
        self.automatic_optimization = not manual
        self.mode = mode
        self.grow = grow
        self.rank_in_hook = rank_in_hook
        self.num_workers = num_workers
        self.fallback: OOMFallback | None = None
        self.batches: dict[int, list[list[int]]] = {}
        self.losses: list[float] = []

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.net(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"]
        )

    def train_dataloader(self) -> DataLoader[Any]:
        if self.sampler is None:  # made here, where the rank is known
            self.sampler = make_sampler(
                self.rows, rank=self.trainer.global_rank if self.rank_in_hook else None
            )
        return DataLoader(
            self.rows, batch_sampler=self.sampler, collate_fn=collate, num_workers=self.num_workers
        )

    def on_train_start(self) -> None:
        if not self.automatic_optimization:
            assert self.sampler is not None
            options = {} if self.grow is None else {"grow": self.grow}
            self.fallback = oom_fallback(self, self.sampler, mode=self.mode, **options)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor | None:
        self.batches.setdefault(self.current_epoch, []).append(batch["idx"].tolist())
        if self.automatic_optimization:
            loss = self.loss(batch)
            self.losses.append(float(loss.detach()))
            return loss
        assert self.fallback is not None
        optimizer = self.optimizers()
        loss = self.fallback.backward(batch, self.loss)
        assert loss is not None  # split mode never drops a step
        optimizer.step()
        optimizer.zero_grad()
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.5)

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in self.net.parameters()])


def trainer(**options: Any) -> pl.Trainer:
    """A quiet CPU Trainer for 2 epochs; ``options`` override."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "devices": 1,
        "max_epochs": 2,
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        **options,
    }
    return pl.Trainer(**settings)


def quiet() -> None:
    """Silence Lightning's banners and its few-workers hint (the data are tiny on purpose)."""
    warnings.filterwarnings("ignore", message=".*does not have many workers.*")
    warnings.filterwarnings("ignore", message=".*`training_step` returned `None`.*")
    for name in ("lightning.pytorch", "lightning.fabric", "lightning"):
        logging.getLogger(name).setLevel(logging.ERROR)


def checkpoints(dirpath: Any, **options: Any) -> Any:
    """A ModelCheckpoint keeping every checkpoint as ``epoch=E-step=S.ckpt`` (``options``: when to save)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    return ModelCheckpoint(dirpath=dirpath, filename="{epoch}-{step}", save_top_k=-1, **options)


def trained_before(batches: dict[int, list[list[int]]], steps: int) -> dict[int, list[list[int]]]:
    """The first ``steps`` batches of a run's record, per epoch (one optimizer step per batch)."""
    kept: dict[int, list[list[int]]] = {}
    for epoch in sorted(batches):
        for batch in batches[epoch]:
            if steps == 0:
                return kept
            kept.setdefault(epoch, []).append(batch)
            steps -= 1
    return kept


def joined(*records: dict[int, list[list[int]]]) -> dict[int, list[list[int]]]:
    """The batches of several records of one run, per epoch, in order."""
    out: dict[int, list[list[int]]] = {}
    for record in records:
        for epoch, batches in record.items():
            out.setdefault(epoch, []).extend(batches)
    return out
