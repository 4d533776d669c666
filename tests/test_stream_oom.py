"""OOMFallback over a TokenBudgetStream: real injected OOMs, every example read trained exactly once.

Halve mode re-budgets the stream (the batches it forms next, from what it
buffers too) and trains the batches already formed in micro-batches; split
mode micro-batches and leaves the stream alone. Two real processes: see
tests/test_stream_oom_distributed.py.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbatch import CostModel, OOMFallback, TokenBudgetStream
from tokenbatch.testing import inject_oom

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from oom_common import collate, make_rows

sys.path.pop(0)


class Tiny(torch.nn.Module):
    """Embedding, masked mean, linear: a model whose forward sees (rows, padded length)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(64, 8)
        self.head = torch.nn.Linear(8, 6)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Any:
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1)
        return torch.nn.functional.cross_entropy(self.head(pooled), labels)


def loss_of(model: torch.nn.Module) -> Any:
    return lambda b: model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], labels=b["labels"])


def cost_of(batch: dict[str, torch.Tensor]) -> float:
    return float(batch["input_ids"].shape[0] * batch["attention_mask"].sum(1).max())


def train(
    stream: TokenBudgetStream, mode: Any, oom_above: float, *, workers: int = 0, times: int | None = None
) -> tuple[OOMFallback, list[list[int]], list[tuple[float, float]]]:
    """One epoch under the guard; each trained step's example ids, and (batch cost, budget then)."""
    model = Tiny()
    fallback = OOMFallback(stream, model, mode=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(stream, batch_size=None, collate_fn=collate, num_workers=workers)
    trained, costs = [], []
    with inject_oom(model, max_tokens=oom_above, times=times):
        for batch in fallback.iterate(loader):
            costs.append((cost_of(batch), stream.max_tokens))
            loss = fallback.backward(batch, loss_of(model))
            assert loss is not None  # a stream's step is never dropped
            fallback.step(optimizer)
            optimizer.zero_grad()
            trained.append(batch["idx"].tolist())
    return fallback, trained, costs


ROWS = make_rows(300, seed=3, max_len=60)


@pytest.mark.parametrize("mode", ["halve", "split"])
def test_each_example_trained_once_after_real_ooms(mode: str) -> None:
    stream = TokenBudgetStream(ROWS, max_tokens=256, buffer_size=64, seed=1)
    fallback, trained, costs = train(stream, mode, oom_above=100)
    assert Counter(i for step in trained for i in step) == Counter(range(len(ROWS)))
    assert fallback.events and fallback.steps_done == len(trained)
    assert fallback.max_tokens <= 100
    if mode == "halve":
        # The stream forms every batch after the first event under the new budget (no read-ahead here).
        first = fallback.events[0].step
        assert stream.max_tokens == fallback.max_tokens
        assert all(cost <= budget for cost, budget in costs[first + 1 :])
        assert max(cost for cost, _ in costs[first + 1 :]) <= fallback.events[0].new_max_tokens
    else:  # split leaves the stream's budget alone: its batches are micro-batched
        assert stream.max_tokens == 256
        assert max(cost for cost, _ in costs) > 100


class TinyPacks(torch.nn.Module):
    """Embedding and linear over one flattened row; each example's first token is its own marker."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, 8)
        self.head = torch.nn.Linear(8, vocab)
        self.trained: list[int] = []  # the markers of every pack whose forward ran (no injected OOM)

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, labels: torch.Tensor, **_: Any
    ) -> Any:
        self.trained += input_ids[position_ids == 0].tolist()
        logits = self.head(self.embed(input_ids))[0, :-1]
        return torch.nn.functional.cross_entropy(logits, labels[0, 1:], ignore_index=-100)


@pytest.mark.parametrize("packing", ["varlen", "full"])
def test_halve_forms_the_packs_left_under_the_new_budget(packing: str) -> None:
    from transformers import DataCollatorWithFlattening

    vocab = 64
    rows = [{"input_ids": [vocab + r["idx"], *r["input_ids"][1:]]} for r in ROWS]
    cost = CostModel.attention(64, packing=packing)
    stream = TokenBudgetStream(rows, max_tokens=400, cost=cost, buffer_size=128, seed=1)
    model = TinyPacks(vocab + len(rows))
    fallback = OOMFallback(stream, model, mode="halve")
    flatten = DataCollatorWithFlattening()
    budgets, costs = [], []
    with inject_oom(model, max_tokens=150, cost=stream):
        for batch in fallback.iterate(DataLoader(stream, batch_size=None, collate_fn=flatten)):
            starts = torch.nonzero(batch["position_ids"][0] == 0).flatten().tolist()
            costs.append(cost.batch_cost(np.diff([*starts, batch["input_ids"].shape[1]])))
            budgets.append(stream.max_tokens)
            assert fallback.backward(batch, lambda b: model(**b)) is not None
    assert Counter(model.trained) == Counter(vocab + i for i in range(len(rows)))
    first = fallback.events[0].step
    assert fallback.max_tokens <= 150 and stream.max_tokens == fallback.max_tokens
    # The round of packs formed under 400 went back to the buffer: every pack after an event is formed
    # under the budget it set (those of the round before would cost up to 400).
    assert costs[first] > 200 and len(costs) > first + 1
    assert all(cost <= budget for cost, budget in zip(costs[first + 1 :], budgets[first + 1 :], strict=True))
    assert max(costs[fallback.events[-1].step + 1 :]) <= fallback.max_tokens


def test_halve_reaches_dataloader_workers() -> None:
    stream = TokenBudgetStream(ROWS, max_tokens=256, buffer_size=32, seed=2)
    fallback, trained, costs = train(stream, "halve", oom_above=100, workers=2)
    assert Counter(i for step in trained for i in step) == Counter(range(len(ROWS)))
    last = fallback.events[-1]
    # The batches the workers had formed (2 workers x prefetch_factor 2) are micro-batched; from then
    # on each worker forms its batches under the budget it read from shared memory.
    late = [cost for cost, _ in costs[last.step + 5 :]]
    assert late and max(late) <= fallback.max_tokens
    assert max(cost for cost, _ in costs[: last.step + 5]) > fallback.max_tokens  # formed under 256


def test_halve_keeps_going_from_a_resumed_stream_with_its_budget() -> None:
    stream = TokenBudgetStream(ROWS, max_tokens=256, buffer_size=64, seed=1)
    model = Tiny()
    fallback = OOMFallback(stream, model, mode="halve")
    loader = DataLoader(stream, batch_size=None, collate_fn=collate)
    seen: list[int] = []
    with inject_oom(model, max_tokens=100, times=1):
        for n, batch in enumerate(fallback.iterate(loader)):
            fallback.backward(batch, loss_of(model))
            seen += batch["idx"].tolist()
            if n == 6 and fallback.events:
                break
    assert fallback.events
    state, saved = stream.state_dict(), fallback.state_dict()
    assert state["max_tokens"] == fallback.max_tokens < 256

    resumed = TokenBudgetStream(ROWS, max_tokens=256, buffer_size=64, seed=1)
    resumed.load_state_dict(state)
    assert resumed.max_tokens == fallback.max_tokens
    again = OOMFallback(resumed, Tiny(), mode="halve")
    again.load_state_dict(saved)
    rest, steps = [], 0
    for batch in again.iterate(DataLoader(resumed, batch_size=None, collate_fn=collate)):
        assert cost_of(batch) <= resumed.max_tokens  # the saved budget, over the buffer rebuilt
        again.backward(batch, loss_of(again.model))
        rest += batch["idx"].tolist()
        steps += 1
    assert again.steps_done == 7 + steps  # the resumed pass counts on from the 7 steps trained
    assert Counter(seen + rest) == Counter(range(len(ROWS)))


def test_halve_weights_the_micro_batches_of_a_stream_and_refuses_another_dataloader() -> None:
    stream = TokenBudgetStream(ROWS, max_tokens=256, buffer_size=64)
    fallback = OOMFallback(stream, Tiny(), mode="halve", weight="tokens")
    assert fallback.mode == "halve" and fallback.max_tokens == 256
    other = DataLoader(TokenBudgetStream(ROWS, max_tokens=256), batch_size=None, collate_fn=collate)
    with pytest.raises(ValueError, match="dataloader should read this fallback's stream"):
        next(iter(fallback.iterate(other)))
    with pytest.raises(ValueError, match="weight should be"):
        OOMFallback(stream, Tiny(), mode="halve", weight="rows")


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lengths=st.lists(st.integers(1, 48), min_size=1, max_size=120),
    buffer=st.integers(1, 40),
    budget=st.integers(48, 400),
    oom_share=st.floats(0.1, 1.0),
    mode=st.sampled_from(["halve", "split"]),
    quadratic=st.sampled_from([0.0, 1 / 32]),
)
def test_exactly_once_for_any_lengths_budgets_and_thresholds(
    lengths: list[int], buffer: int, budget: int, oom_share: float, mode: str, quadratic: float
) -> None:
    rows = [{"input_ids": [1 + i % 60] * n, "label": i % 6, "idx": i} for i, n in enumerate(lengths)]
    cost = CostModel(quadratic=quadratic)
    # Above the longest single example's own cost: every example fits alone, so training never gives up.
    alone = max(cost.cost(1, n) for n in lengths)
    threshold = alone + oom_share * (budget - alone) if budget > alone else alone
    stream = TokenBudgetStream(rows, max_tokens=budget, cost=cost, buffer_size=buffer, oversize="alone")
    model = Tiny()
    fallback = OOMFallback(stream, model, mode=mode)
    trained = []
    with inject_oom(model, max_tokens=threshold, cost=cost):
        for batch in fallback.iterate(DataLoader(stream, batch_size=None, collate_fn=collate)):
            assert fallback.backward(batch, loss_of(model)) is not None
            trained += batch["idx"].tolist()
    assert Counter(trained) == Counter(range(len(rows)))
    assert fallback.max_tokens <= max(threshold, budget)


def test_a_stream_only_shrinks_with_the_same_defaults() -> None:
    """Growth proves a budget on the sampler's global plan, which a stream has not: the default is
    the same everywhere, and on a stream it is shrinking only."""
    stream = TokenBudgetStream(make_rows(12), max_tokens=256, buffer_size=8)
    assert OOMFallback(stream, Tiny(), mode="halve").grow is None
    assert OOMFallback(stream, Tiny(), mode="split", grow=False).grow is None
    assert OOMFallback(stream, Tiny(), mode="halve", grow=True).grow is None
    with pytest.raises(TypeError, match=r"grow should be True, False or a tokenbatch\.oom\.Grow"):
        OOMFallback(stream, Tiny(), mode="halve", grow="yes")  # type: ignore[arg-type]
