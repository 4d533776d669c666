"""Guarded evaluation (EvalGuard, OOMFallback.evaluate): real injected OOM errors, 1 and 2 processes."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from oom_common import collate, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.oom import EvalGuard
from tokenbatch.oom._eval import combine
from tokenbatch.testing import inject_oom

quiet()
ROWS = make_rows(64)
LENGTHS = [len(r["input_ids"]) for r in ROWS]
REPO = Path(__file__).resolve().parents[1]


def forward(model: torch.nn.Module) -> Any:
    """What an evaluation loop computes for a batch: the model's output, loss and logits."""

    def run(batch: dict[str, torch.Tensor]) -> Any:
        return model(**{k: v for k, v in batch.items() if k != "idx"})

    return run


def batches(budget: float = 256) -> list[dict[str, torch.Tensor]]:
    sampler = TokenBudgetBatchSampler(LENGTHS, budget, shuffle=False)
    return [collate([ROWS[i] for i in indices]) for indices in sampler]


def test_without_oom_the_result_is_fn_s_own() -> None:
    model = tiny_bert(0).eval()
    guard = EvalGuard(model)
    sentinel = object()
    seen: list[bool] = []

    def fn(batch: Any) -> object:
        seen.append(torch.is_grad_enabled())
        return sentinel

    assert guard.evaluate(batches()[0], fn) is sentinel
    assert seen == [False] and guard.events == [] and guard.max_tokens is None and guard.batches == 1


def test_oom_splits_the_batch_and_gives_the_unsplit_result() -> None:
    model = tiny_bert(0).eval()
    data = batches()
    with torch.no_grad():
        expected = [forward(model)(batch) for batch in data]
    guard = EvalGuard(model)
    with inject_oom(model, 120) as injector:
        results = [guard.evaluate(batch, forward(model)) for batch in data]

    assert injector.count >= 1 and len(guard.events) == injector.count
    first = guard.events[0]
    assert (first.step, first.where, first.mode, first.ranks) == (0, ("forward",), "split", (0,))
    assert guard.max_tokens is not None and guard.max_tokens <= 120 and max(injector.costs[-3:]) <= 120
    # Later batches over the budget were split at once: every OOM came from the first batch.
    assert {event.step for event in guard.events} == {0}
    for got, want in zip(results, expected, strict=True):
        assert type(got) is type(want) and got.logits.shape == want.logits.shape
        assert torch.allclose(got.logits, want.logits, atol=1e-6, rtol=0)
        assert torch.allclose(got.loss, want.loss, atol=1e-6, rtol=0)  # mean over samples: weighted by them


def test_token_weights_and_containers_are_put_together() -> None:
    """A token-averaged scalar with weight="tokens", and per-row tensors inside a dict and a tuple."""
    embed = torch.nn.Embedding(64, 3)
    batch = collate(ROWS[:12])

    def fn(b: dict[str, torch.Tensor]) -> dict[str, Any]:
        mask = b["attention_mask"].unsqueeze(-1).float()
        vectors = embed(b["input_ids"]) * mask
        return {"token_mean": vectors.sum() / mask.sum(), "rows": (vectors.sum(1), b["idx"]), "name": "x"}

    with torch.no_grad():
        want = fn(batch)
    guard = EvalGuard(embed, weight="tokens")
    with inject_oom(embed, batch["input_ids"].numel() - 1):
        got = guard.evaluate(batch, fn)
    assert len(guard.events) == 1
    assert torch.allclose(got["token_mean"], want["token_mean"], atol=1e-6)
    assert torch.allclose(got["rows"][0], want["rows"][0], atol=1e-6)
    assert torch.equal(got["rows"][1], want["rows"][1]) and got["name"] == "x"


def test_combine_restores_row_order_and_refuses_what_it_cannot_join() -> None:
    rows = [np.array([1, 3]), np.array([0, 2])]
    parts = [torch.tensor([10.0, 30.0]), torch.tensor([0.0, 20.0])]
    assert combine(parts, [0.5, 0.5], rows).tolist() == [0.0, 10.0, 20.0, 30.0]
    with pytest.raises(TypeError, match="one row per sample"):
        combine([torch.zeros(3), torch.zeros(2)], [0.5, 0.5], rows)
    with pytest.raises(TypeError, match="cannot put together"):
        combine(["a", "b"], [0.5, 0.5], rows)


def test_one_sample_that_does_not_fit_stops_with_sample_too_large() -> None:
    model = tiny_bert(0).eval()
    with inject_oom(model, 1), pytest.raises(SampleTooLargeError, match="batch 0: a single sample"):
        EvalGuard(model).evaluate(batches()[0], forward(model))


@pytest.mark.parametrize("mode", ["split", "halve"])
def test_the_training_budget_is_untouched_unless_asked(mode: str) -> None:
    model = tiny_bert(0)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    fallback = OOMFallback(sampler, model, mode=mode)
    batch = batches()[0]
    with inject_oom(model, 100):
        fallback.evaluate(batch, forward(model))
        assert fallback.max_tokens == sampler.max_tokens == 256 and sampler.state_dict()["replans"] == []
        budget = fallback.eval_guard.max_tokens
        assert budget is not None and budget <= 100
        fallback.evaluate(batch, forward(model), lower_training=True)
    assert fallback.max_tokens == budget and fallback.events == []
    assert sampler.max_tokens == (256 if mode == "split" else budget)
    assert len(sampler.state_dict()["replans"]) == (mode == "halve")  # the next pass starts on the new plan


@pytest.mark.slow
def test_two_ranks_oom_on_one_splits_without_hanging(tmp_path: Path, torchrun: Any) -> None:
    """torchrun, 2 ranks, DDP-wrapped: results equal an unguarded run's; errors stop both ranks."""
    torchrun(REPO / "tests" / "scripts" / "oom_eval_ddp.py", tmp_path, timeout=180)
    zero, one = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2))

    assert zero["plain"]["sizes"] != one["plain"]["sizes"]  # other batch sizes at the same steps
    assert (zero["oom"]["injected"], one["oom"]["injected"]) == (0, 1)
    assert zero["oom"]["events"] == one["oom"]["events"] and zero["oom"]["events"][0]["ranks"] == (1,)
    assert zero["oom"]["eval_max_tokens"] == one["oom"]["eval_max_tokens"] < 150
    for rank in (zero, one):
        assert rank["oom"]["max_tokens"] == 256  # the training budget stays
        for name in ("guarded", "oom"):
            assert len(rank[name]["results"]) == len(rank["plain"]["results"])
            for got, want in zip(rank[name]["results"], rank["plain"]["results"], strict=True):
                assert torch.allclose(got[0], want[0], atol=1e-6)
                assert torch.allclose(got[1], want[1], atol=1e-6)
                assert torch.equal(got[2], want[2])
    assert one["error"]["error"]["type"] == "ValueError"
    assert zero["error"]["error"]["type"] == "RankFailedError"
    assert "rank 1 raised ValueError" in zero["error"]["error"]["message"]
    assert zero["too_large"]["error"] == one["too_large"]["error"]
    assert zero["too_large"]["error"]["type"] == "SampleTooLargeError"
