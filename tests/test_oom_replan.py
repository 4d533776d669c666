"""OOMFallback's halve-mode re-plans: every sample once, or a clear error, never a silent loss.

Halve mode re-plans the rest of the epoch, and only a pass that starts the
DataLoader afresh (``fallback.iterate``) can follow it: a loop over the
DataLoader itself is refused before it trains anything. A sample over the
lowered budget is tried alone before it is called too large.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
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


LENGTHS = np.random.default_rng(0).integers(4, 40, 60).tolist()
ROWS = [{"length": n, "idx": i} for i, n in enumerate(LENGTHS)]


Loader = Callable[[TokenBudgetBatchSampler], Any]


def plain(sampler: TokenBudgetBatchSampler) -> DataLoader[Any]:
    return DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)


def one_ahead(sampler: TokenBudgetBatchSampler) -> Any:  # as accelerate's prepared DataLoader does
    from accelerate.data_loader import DataLoaderShard

    return DataLoaderShard(ROWS, batch_sampler=sampler, collate_fn=collate)


def workers(sampler: TokenBudgetBatchSampler) -> Any:
    return DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate, num_workers=1)


@pytest.mark.parametrize("make_loader", [plain, one_ahead, workers])
def test_halve_mode_in_a_loop_over_the_dataloader_is_refused_before_it_trains(make_loader: Loader) -> None:
    model = Tiny()
    sampler = TokenBudgetBatchSampler(LENGTHS, 160, seed=0)
    fallback = OOMFallback(sampler, model, mode="halve")
    batch = next(iter(make_loader(sampler)))
    with pytest.raises(ValueError, match=r"outside fallback\.iterate\(\): loop with `for batch in fallback"):
        fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"]))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("make_loader", [plain, one_ahead, workers])
def test_iterate_follows_every_replan_on_any_loader(make_loader: Loader) -> None:
    model = Tiny()
    sampler = TokenBudgetBatchSampler(LENGTHS, 160, seed=0)
    loader = make_loader(sampler)
    fallback = OOMFallback(sampler, model, mode="halve")
    trained: list[list[int]] = []
    with inject_oom(model, 100, after=5):
        for epoch in range(2):
            sampler.set_epoch(epoch)
            trained.append([])
            for batch in fallback.iterate(loader):
                if fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"])) is not None:
                    trained[-1] += batch["idx"].tolist()
                    model.zero_grad()
    assert fallback.events and fallback.events[0].step == 5
    assert [sorted(epoch) for epoch in trained] == [list(range(60))] * 2


def test_a_training_budget_lowered_by_evaluation_between_steps_carries_on() -> None:
    """``evaluate(lower_training=True)`` re-plans halve mode between steps: iterate goes on with it."""
    model = Tiny()
    sampler = TokenBudgetBatchSampler(LENGTHS, 160, seed=0)
    fallback = OOMFallback(sampler, model, mode="halve")

    def forward(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"])

    trained: list[list[int]] = []
    loader = plain(sampler)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        trained.append([])
        for step, batch in enumerate(fallback.iterate(loader)):
            assert fallback.backward(batch, forward) is not None
            trained[-1] += batch["idx"].tolist()
            if step == 1 and epoch == 0:
                with inject_oom(model, 100):
                    fallback.evaluate(collate(ROWS[:20]), forward, lower_training=True)
        if epoch == 0:
            with inject_oom(model, 45):  # after the epoch's last step: nothing left to re-plan
                fallback.evaluate(collate(ROWS[:20]), forward, lower_training=True)
    assert sampler.max_tokens <= 45 and [sorted(epoch) for epoch in trained] == [list(range(60))] * 2


def train(
    lengths: list[int],
    max_tokens: float,
    limit: float,
    *,
    mode: str,
    oversize: str,
    epochs: int = 2,
    grow: bool = True,
) -> tuple[list[list[int]], OOMFallback]:
    """Samples trained per epoch, with batches above ``limit`` padded tokens running out of memory."""
    rows = [{"length": n, "idx": i} for i, n in enumerate(lengths)]
    model = Tiny()
    sampler = TokenBudgetBatchSampler(lengths, max_tokens, seed=0, oversize=oversize)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode, grow=grow)
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
    trained, fallback = train(lengths, 256, 100, mode="halve", oversize=oversize, grow=False)
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
