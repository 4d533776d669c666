"""The probe on tiny BERTs on CPU: fit quality, attention, searching, OOM handling, no side effects.

A probe runs a dozen or more real training steps, so tests that only read a
fit share one (module-scoped fixtures); every test still asserts on its own.
"""

from __future__ import annotations

import copy
import json
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from tokenbatch import CostModel
from tokenbatch.probe import Measurement, MemoryModel, ProbeResult, find_max_tokens
from tokenbatch.probe._measure import measure_peak
from tokenbatch.probe._model import fit_memory

MiB = 2**20
#: The data the shared fit probes for: its longest (128) and shortest (12) sequence set the range.
LENGTHS = [12, 40, 33, 128, 17, 90]
WIDER = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "intermediate_size": 100}


def tiny_classifier(attn: str = "eager", seed: int = 0, **overrides: Any) -> BertForSequenceClassification:
    settings: dict[str, Any] = {
        "vocab_size": 1000,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        "max_position_embeddings": 512,
        **overrides,
    }
    config = BertConfig(**settings)
    config._attn_implementation = attn
    torch.manual_seed(seed)
    return BertForSequenceClassification(config)


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread: a tiny model's ops are too small to split, and on a busy 2-core machine
    each op's second thread waits for a core (this module ran about 6 times slower with two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def eager_fit(one_thread: None) -> tuple[BertForSequenceClassification, ProbeResult]:
    """The tiny eager classifier and one fit of it for :data:`LENGTHS` under 40 MiB."""
    model = tiny_classifier()
    return model, find_max_tokens(model, lengths=LENGTHS, memory_limit=40 * MiB)


@pytest.fixture(scope="module")
def wider_fit(one_thread: None) -> tuple[BertForSequenceClassification, ProbeResult]:
    """A wider, deeper tiny classifier and its fit for lengths 16-128 under 40 MiB."""
    model = tiny_classifier(**WIDER)
    return model, find_max_tokens(model, max_len=128, memory_limit=40 * MiB)


def held_out_shapes(
    budget: float, cost: CostModel, used: set[tuple[int, int]], seed: int
) -> list[tuple[int, int]]:
    """Random (batch, length) shapes costing 30-100% of the budget, none of them measured by the probe."""
    rng = np.random.default_rng(seed)
    shapes: list[tuple[int, int]] = []
    while len(shapes) < 6:
        length = int(rng.integers(20, 129))
        size = int(budget * rng.uniform(0.3, 1.0) // float(cost.sample_cost(length)))
        if size >= 1 and (size, length) not in used:
            shapes.append((size, length))
    return shapes


@pytest.mark.parametrize("which", ["eager_fit", "wider_fit"], ids=["h32-l2", "h64-l3"])
def test_fit_predicts_held_out_shapes_within_15_percent(which: str, request: pytest.FixtureRequest) -> None:
    model, result = request.getfixturevalue(which)
    assert result.fit is not None
    used = {(m.batch_size, m.length) for m in result.measurements + result.checks}
    errors = []
    for size, length in held_out_shapes(result.max_tokens, result.cost, used, seed=1):
        measured = measure_peak(model, size, length).peak_bytes
        errors.append(result.fit.predict(size, length) / measured - 1)
    assert max(abs(e) for e in errors) < 0.15, errors
    # The checks at the suggested budget are held out too, and they fit under the target.
    target = 40 * MiB * 0.9
    assert result.checks and all(not c.oom and c.peak_bytes <= target for c in result.checks)
    assert max(c.peak_bytes for c in result.checks) > 0.9 * target  # the budget is not timid either
    for row in result.table():
        assert row["error"] is not None and abs(row["error"]) < 0.15


def test_eager_attention_has_a_clearly_positive_quadratic_term(
    eager_fit: tuple[BertForSequenceClassification, ProbeResult],
) -> None:
    eager = eager_fit[1].fit
    # CPU sdpa without attention dropout runs the fused kernel, which keeps no L x L scores.
    fused_model = tiny_classifier("sdpa", attention_probs_dropout_prob=0.0)
    fused = find_max_tokens(fused_model, max_len=128, memory_limit=40 * MiB).fit
    assert eager is not None and fused is not None
    assert eager.quadratic * 128 > 0.5 * eager.linear  # at max_len the scores outweigh half the rest
    assert eager.quadratic > 3 * fused.quadratic


def test_search_agrees_with_the_fit_and_stays_under_the_target(
    eager_fit: tuple[BertForSequenceClassification, ProbeResult],
) -> None:
    model, fitted = eager_fit
    searched = find_max_tokens(
        model, lengths=LENGTHS, memory_limit=40 * MiB, method="search", cost=fitted.cost
    )
    assert searched.fit is None and searched.method == "search"
    assert searched.max_tokens == pytest.approx(fitted.max_tokens, rel=0.06)
    target = 40 * MiB * 0.9
    passed = [m for m in searched.measurements if not m.oom and m.peak_bytes <= target]
    assert max(fitted.cost.cost(m.batch_size, m.length) for m in passed) <= searched.max_tokens * 1.0001


def snapshot(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return {
        "tensors": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "buffers": [b.clone() for b in model.buffers()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "optimizer": copy.deepcopy(optimizer.state_dict()),
        "training": model.training,
        "rng": (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()),
    }


def assert_same(before: dict[str, Any], after: dict[str, Any]) -> None:
    assert before["tensors"].keys() == after["tensors"].keys()
    for key, value in before["tensors"].items():
        assert torch.equal(value, after["tensors"][key]), key
    assert all(torch.equal(a, b) for a, b in zip(before["buffers"], after["buffers"], strict=True))
    for a, b in zip(before["grads"], after["grads"], strict=True):
        assert (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
    opt_a, opt_b = before["optimizer"], after["optimizer"]
    assert opt_a["param_groups"] == opt_b["param_groups"]
    assert opt_a["state"].keys() == opt_b["state"].keys()
    for index, state in opt_a["state"].items():
        for name, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(opt_b["state"][index][name])), name
    assert before["training"] == after["training"]
    assert torch.equal(before["rng"][0], after["rng"][0])
    assert before["rng"][1] == after["rng"][1]
    assert np.array_equal(before["rng"][2], after["rng"][2])


def test_probe_leaves_model_optimizer_and_rng_unchanged() -> None:
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = {"input_ids": torch.randint(0, 1000, (4, 24)), "labels": torch.tensor([0, 1, 0, 1])}
    model(**batch).loss.backward()
    optimizer.step()  # optimizer state exists, and gradients are left in place on purpose
    model.eval()
    torch.manual_seed(123)
    random.seed(5)
    np.random.seed(7)
    before = snapshot(model, optimizer)
    find_max_tokens(model, optimizer=optimizer, max_len=64, memory_limit=24 * MiB)
    # A coarse search: what it leaves behind does not depend on how finely it bisects.
    default = find_max_tokens(
        model, optimizer=optimizer, max_len=64, memory_limit=24 * MiB, method="search", tolerance=0.25
    )
    measure_peak(model, 3, 40, optimizer=optimizer)
    assert_same(before, snapshot(model, optimizer))
    # Without a cost model the search uses the config's analytic one, in token units.
    assert default.cost.linear == 1.0 and default.cost.quadratic > 0
    # A fresh optimizer stays fresh.
    fresh = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    measure_peak(model, 2, 16, optimizer=fresh)
    assert fresh.state_dict()["state"] == {}


def oom_above(tokens: int) -> Callable[[Any, Any], torch.Tensor]:
    """A loss that raises a real torch.OutOfMemoryError for batches of more than ``tokens`` tokens."""

    def loss_fn(output: Any, batch: Any) -> torch.Tensor:
        if batch["input_ids"].numel() > tokens:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        return output.loss

    return loss_fn


def test_search_finds_an_injected_oom_boundary_and_restores_state() -> None:
    model = tiny_classifier()
    optimizer = torch.optim.AdamW(model.parameters())
    before = snapshot(model, optimizer)
    result = find_max_tokens(
        model,
        optimizer=optimizer,
        max_len=48,
        memory_limit=2**30,
        method="search",
        cost=CostModel(),
        loss_fn=oom_above(1000),
    )
    assert any(m.oom for m in result.measurements)
    assert all(m.tokens <= 1000 for m in result.measurements if not m.oom)
    # 1008 tokens is the smallest budget with a batch over 1000: 63 x 16, 36 x 28 and 21 x 48.
    assert 1000 / 1.03 <= result.max_tokens <= 1008
    assert_same(before, snapshot(model, optimizer))


def test_fit_survives_ooms_and_checks_stay_below_them() -> None:
    # At 3000 tokens the pilot and three of the grid's lengths run out of memory (and halve).
    result = find_max_tokens(tiny_classifier(), max_len=128, memory_limit=2**30, loss_fn=oom_above(3000))
    assert len({m.length for m in result.measurements if m.oom}) >= 2  # the pilot's and the grid's
    assert result.checks and all(not c.oom for c in result.checks)
    assert all(c.tokens <= 3000 for c in result.checks)


def test_base_model_without_labels_uses_the_mean_output(tiny_bert_factory: Callable[..., Any]) -> None:
    model = tiny_bert_factory(vocab_size=1000, attn_implementation="eager")
    result = find_max_tokens(model, max_len=64, memory_limit=24 * MiB)
    assert result.fit is not None and result.fit.linear > 0
    assert all(abs(row["error"]) < 0.15 for row in result.table())


def test_impossible_limits_say_what_to_change() -> None:
    model = tiny_classifier()
    with pytest.raises(ValueError, match="one sequence of max_len=512"):
        find_max_tokens(model, max_len=512, memory_limit=3 * MiB)
    with pytest.raises(ValueError, match="max_position_embeddings=512"):
        find_max_tokens(model, max_len=600, memory_limit=64 * MiB)
    with pytest.raises(ValueError, match="max_len"):
        find_max_tokens(model, memory_limit=64 * MiB)
    with pytest.raises(ValueError, match="method should be one of"):
        find_max_tokens(model, max_len=64, method="guess")
    with pytest.raises(ValueError, match="margin"):
        find_max_tokens(model, max_len=64, margin=1.0)


def test_lengths_set_the_range_and_the_result_is_json(
    eager_fit: tuple[BertForSequenceClassification, ProbeResult],
) -> None:
    result = eager_fit[1]
    assert result.max_len == 128
    # The checks run the longest, the shortest and the geometric middle (39) of LENGTHS.
    assert {c.length for c in result.checks} <= {128, 39, 12} and min(c.length for c in result.checks) == 12
    payload = json.loads(json.dumps(result.to_dict()))
    assert payload["cost"]["linear"] == 1.0 and payload["max_tokens"] == result.max_tokens
    assert len(payload["table"]) == len(result.measurements) + len(result.checks)
    assert result.steps >= len(payload["table"])


def synthetic(fit: MemoryModel, shapes: list[tuple[int, int]]) -> list[Measurement]:
    return [
        Measurement(b, n, int(fit.predict(b, n)), int(fit.predict(b, n)), int(fit.step_peak), False, 0.0)
        for b, n in shapes
    ]


def test_fit_memory_recovers_known_coefficients_and_stays_non_negative() -> None:
    truth = MemoryModel(constant=5e6, linear=3000.0, quadratic=40.0, per_sample=900.0, step_peak=1e6)
    shapes = [(64, 32), (32, 64), (8, 256), (4, 256), (100, 16), (20, 100)]
    fitted = fit_memory(synthetic(truth, shapes))
    assert isinstance(fitted, MemoryModel) and fitted.stores_scores is None  # fitted: not known
    for name in ("constant", "linear", "quadratic", "per_sample", "step_peak"):
        assert getattr(fitted, name) == pytest.approx(getattr(truth, name), rel=1e-3), name
    # Data with no quadratic growth at all: the term is clamped at zero, not fitted negative.
    linear_only = MemoryModel(constant=1e6, linear=1000.0, quadratic=0.0, per_sample=0.0)
    data = synthetic(linear_only, shapes)
    data = [
        Measurement(
            m.batch_size, m.length, m.peak_bytes, int(m.peak_bytes * (1 - 1e-4 * m.length)), 0, False, 0.0
        )
        for m in data
    ]
    clamped = fit_memory(data)
    assert clamped.quadratic == 0.0 and clamped.linear > 0 and clamped.constant >= 0
    with pytest.raises(ValueError, match=r"at least 3 distinct lengths|at least 4 measured shapes"):
        fit_memory(synthetic(truth, [(1, 8), (2, 8), (1, 16), (2, 16)]))


def test_memory_fit_budget_and_token_units() -> None:
    fit = MemoryModel(constant=2e6, linear=2000.0, quadratic=20.0, per_sample=100.0, step_peak=3e6)
    budget = fit.budget(20e6, margin=0.1)
    assert budget == pytest.approx(16e6)
    tokens = fit.token_cost()
    assert tokens.cost(3, 50) * fit.linear == pytest.approx(fit.cost_model().cost(3, 50))
    assert fit.predict(1, 1) == 3e6  # the optimizer step's peak dominates tiny batches
    with pytest.raises(ValueError, match="weights, gradients and optimizer state alone"):
        fit.budget(3e6, margin=0.1)
