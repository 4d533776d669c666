"""The guard on packs (one process): a pack costed as a pack, split into smaller packs, its loss unchanged.

Packs are collated by transformers' ``DataCollatorWithFlattening``; the model is
``tests/scripts/pack_loop.py``'s tiny Llama (eager attention, which transformers
masks block-diagonally from ``position_ids``). Real processes: test_oom_packs_loop.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import DataCollatorWithFlattening

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from oom_common import quiet
from pack_loop import lm_rows, tiny_model

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
from tokenbatch._packs import packed_examples
from tokenbatch.oom import EvalGuard
from tokenbatch.oom._grow import Growth
from tokenbatch.oom._split import _Packs, inspect_batch, plan_packs, split_batch
from tokenbatch.testing import inject_oom

quiet()
ROWS = lm_rows()
LENGTHS = [len(r["input_ids"]) for r in ROWS]
COSTS = [CostModel(packing="varlen"), CostModel.attention(64, packing="full", pad_to_multiple_of=8)]


def pack(indices: list[int], **options: Any) -> dict[str, Any]:
    return DataCollatorWithFlattening(**options)([ROWS[i] for i in indices])


@settings(max_examples=60, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 60), min_size=1, max_size=30),
    cost=st.sampled_from(COSTS),
    share=st.floats(0.05, 1.0),
    fill=st.booleans(),
)
def test_smaller_packs_hold_every_example_once_and_each_fits(
    lengths: list[int], cost: CostModel, share: float, fill: bool
) -> None:
    budget = share * cost.batch_cost(lengths)
    groups = plan_packs(np.array(lengths), cost, budget, fill=fill)
    assert sorted(np.concatenate(groups).tolist()) == list(range(len(lengths)))
    for group in groups:
        assert list(group) == sorted(group)  # in the batch's order
        assert len(group) == 1 or cost.batch_cost(np.array(lengths)[group]) <= budget
    # The running sums cost a pack exactly as the cost model does.
    packs = _Packs(cost)
    for i, length in enumerate(lengths):
        packs.add(0, i, length)
    assert packs.costs()[0] == pytest.approx(cost.batch_cost(lengths), rel=1e-12)


@pytest.mark.parametrize("options", [{}, {"return_flash_attn_kwargs": True, "return_seq_idx": True}])
def test_a_split_pack_is_packs_of_whole_examples_weighted_by_labelled_tokens(options: dict[str, Any]) -> None:
    indices = list(range(12))
    batch = pack(indices, **options)
    shape = inspect_batch(batch)
    assert shape.packed is not None and shape.lengths.tolist() == [LENGTHS[i] for i in indices]
    cost = COSTS[1]
    assert shape.cost(cost) == cost.batch_cost(shape.lengths)  # a pack, not rows x longest
    pieces = split_batch(batch, shape, cost, shape.cost(cost) / 3)
    assert len(pieces) >= 3
    seen = []
    for piece, share, rows in pieces:
        chosen = [indices[i] for i in rows]
        expected = pack(chosen, **options)  # what the collator makes of those examples
        assert set(piece) == set(expected) and all(
            torch.equal(piece[k], expected[k]) for k in ("input_ids", "labels")
        )
        assert share == pytest.approx(
            sum(LENGTHS[i] - 1 for i in chosen) / sum(LENGTHS[i] - 1 for i in indices)
        )
        seen += chosen
    assert sorted(seen) == indices


def grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])


@pytest.mark.parametrize("mode", ["split", "halve"])
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_pack_that_runs_out_of_memory_trains_as_it_would_have_whole(where: str, mode: str) -> None:
    cost = CostModel.attention(256, packing="full")
    sampler = TokenBudgetBatchSampler(LENGTHS[:24], 400, cost=cost, seed=0)
    batches = [pack(indices) for indices in sampler]
    model = tiny_model()
    expected = []
    for batch in batches:
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        expected.append((loss.detach(), grads(model)))
    fallback = OOMFallback(sampler, model, mode=mode, grow=False)
    with inject_oom(
        model,
        0.6 * max(cost.batch_cost(packed_examples(b).lengths) for b in batches),
        where=where,
        cost=sampler,
    ) as injector:
        for step, batch in enumerate(fallback.iterate(batches)):
            model.zero_grad()
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if mode == "halve":  # the step is dropped and the epoch re-planned under half the pack's cost
                assert loss is None
                break
            assert loss is not None
            assert torch.allclose(loss, expected[step][0], atol=1e-6)
            assert torch.allclose(grads(model), expected[step][1], atol=1e-6)
    assert injector.count >= 1 and fallback.events[0].where == (where,)
    failed = max(cost.batch_cost(packed_examples(b).lengths) for b in batches[: fallback.events[0].step + 1])
    assert fallback.events[0].new_max_tokens == pytest.approx(0.5 * min(400, failed))
    if mode == "halve":
        assert sampler.max_tokens == fallback.events[0].new_max_tokens
        replanned = sampler.plan
        assert all(
            c <= sampler.max_tokens or n == 1
            for c, n in zip(
                replanned.batch_costs(sampler.lengths, cost), replanned.batch_sizes(), strict=True
            )
        )


@pytest.mark.parametrize("cost", COSTS, ids=["varlen", "full"])
def test_inject_oom_costs_a_pack_as_a_pack(cost: CostModel) -> None:
    model = tiny_model()
    indices = list(range(10))
    batch = pack(indices)
    packed = cost.batch_cost([LENGTHS[i] for i in indices])
    with inject_oom(model, packed, cost=cost) as injector:
        model(**batch)  # at the limit: fine
    assert injector.costs == [packed] and injector.count == 0
    with inject_oom(model, packed - 1e-6, cost=cost) as injector, pytest.raises(torch.OutOfMemoryError):
        model(**batch)
    with inject_oom(model, 1e9, cost=CostModel()) as injector:  # a padded cost: the examples padded
        model(**batch)
    assert injector.costs == [10 * max(LENGTHS[:10])]
    with inject_oom(model, 1e9) as injector:  # by default, the tokens of the row
        model(**batch)
    assert injector.costs == [sum(LENGTHS[:10])]


def test_evaluation_of_a_pack_in_smaller_packs_gives_the_whole_pack_s_loss_and_logits() -> None:
    model = tiny_model().eval()
    batch = pack(list(range(16)))
    with torch.no_grad():
        whole = model(**batch)
    guard = EvalGuard(model, cost=COSTS[0])
    with inject_oom(model, 0.4 * COSTS[0].batch_cost(LENGTHS[:16]), cost=COSTS[0]) as injector:
        out = guard.evaluate(batch, lambda b: model(**b))
    assert injector.count == 1 and len(guard.events) == 1
    assert out.logits.shape == whole.logits.shape
    assert torch.allclose(out.logits, whole.logits, atol=1e-5)
    assert torch.allclose(out.loss, whole.loss, atol=1e-6)


def test_growth_costs_a_packed_plan_s_steps_as_packs() -> None:
    cost = CostModel.attention(128, packing="varlen")
    sampler = TokenBudgetBatchSampler(LENGTHS, 300, cost=cost, seed=0)
    model = tiny_model()
    fallback = OOMFallback(sampler, model)
    growth = fallback._growth
    assert isinstance(growth, Growth)
    costs = sampler.plan.batch_costs(sampler.lengths, cost)
    assert [growth.step_cost(s, 300) for s in range(3)] == pytest.approx(costs[:3].tolist())
    # Split mode under a lower budget: the costliest smaller pack the guard cuts the step's pack into.
    step = int(np.argmax(costs))
    lengths = sampler.lengths[sampler.plan.batch(step)]
    pieces = plan_packs(lengths, cost, 100)
    shown = max(cost.batch_cost(lengths[p]) for p in pieces)
    assert growth.step_cost(step, 100) == pytest.approx(shown) and shown <= 100
