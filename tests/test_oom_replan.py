"""OOMFallback after a re-plan: no sample refused before it ran out of memory alone (issue 11, item 4)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom


class Tiny(torch.nn.Module):
    """A model as cheap as a model gets, called like a transformers one (the injector reads the mask)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(8, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1)).square().mean()


def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    width = max(r["length"] for r in rows)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        mask[i, : row["length"]] = 1
    return {"input_ids": mask.clone(), "attention_mask": mask, "idx": torch.tensor([r["idx"] for r in rows])}


def train(
    lengths: list[int], max_tokens: float, limit: float, *, mode: str, oversize: str, epochs: int = 2
) -> tuple[list[list[int]], OOMFallback]:
    """Samples trained per epoch, with batches above ``limit`` padded tokens running out of memory."""
    rows = [{"length": n, "idx": i} for i, n in enumerate(lengths)]
    model = Tiny()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=0, oversize=oversize)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode)
    trained: list[list[int]] = []

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"])

    with inject_oom(model, limit):
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            trained.append([])
            for batch in fallback.iterate(loader):
                if fallback.backward(batch, loss) is not None:
                    trained[-1] += batch["idx"].tolist()
                    model.zero_grad()
    return trained, fallback


@pytest.mark.parametrize("oversize", ["error", "skip"])
def test_a_sample_over_the_halved_budget_is_tried_alone(oversize: str) -> None:
    lengths = [70] + [10] * 40
    trained, fallback = train(lengths, 256, 100, mode="halve", oversize=oversize)
    assert fallback.max_tokens < 70  # halved below the long sample, which fits alone
    assert [sorted(epoch) for epoch in trained] == [list(range(41))] * 2


def test_only_a_sample_that_runs_out_of_memory_alone_is_too_large() -> None:
    with pytest.raises(SampleTooLargeError, match="single sample of 70 tokens") as info:
        train([70] + [10] * 40, 256, 60, mode="halve", oversize="error")
    assert info.value.length == 70


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 48), min_size=2, max_size=30),
    scale=st.sampled_from([0.8, 1.0, 1.5, 3.0]),
    limit_share=st.floats(0.05, 1.0),
    mode=st.sampled_from(["halve", "split"]),
    oversize=st.sampled_from(["error", "skip"]),
)
def test_every_sample_that_fits_alone_is_trained_once(
    lengths: list[int], scale: float, limit_share: float, mode: str, oversize: str
) -> None:
    """Injected limits anywhere: each admitted sample trains once per epoch, or one too large stops it."""
    max_tokens = max(lengths) * scale
    if oversize == "error" and scale < 1:
        oversize = "skip"  # "error" would refuse the sampler itself (samples over the budget it is given)
    admitted = [i for i, n in enumerate(lengths) if n <= max_tokens]
    limit = max(1.0, max(lengths) * limit_share)
    try:
        trained, _ = train(lengths, max_tokens, limit, mode=mode, oversize=oversize)
    except SampleTooLargeError as error:  # proven: it ran out of memory in a batch of its own
        assert error.length > limit and f"single sample of {error.length} tokens" in str(error)
        assert error.length in [lengths[i] for i in admitted]
        return
    assert all(lengths[i] <= limit for i in admitted)
    assert [sorted(epoch) for epoch in trained] == [admitted] * 2
