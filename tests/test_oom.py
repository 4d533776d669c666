"""OOMFallback on one process: real OOM errors (injected), real training of a tiny BERT."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.probe import BudgetCache, BudgetKey, remember_budget
from tokenbatch.testing import inject_oom

quiet()
ROWS = make_rows(64)
LENGTHS = [len(r["input_ids"]) for r in ROWS]


def train(
    mode: str = "split",
    *,
    limit: float | None = None,
    where: str = "forward",
    epochs: int = 2,
    loader: Callable[[TokenBudgetBatchSampler], Any] | None = None,
    setup: Callable[[OOMFallback], None] | None = None,
    **options: Any,
) -> tuple[torch.nn.Module, list[int], OOMFallback]:
    """Train two epochs; batches above ``limit`` padded tokens run out of memory."""
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    data = loader(sampler) if loader else DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode, **options)
    if setup is not None:
        setup(fallback)
    trained: list[int] = []
    injector = inject_oom(model, limit, where=where) if limit is not None else None
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in fallback.iterate(data):
            loss = fallback.backward(batch, loss_fn(model))
            if loss is not None:
                assert loss.dim() == 0 and not loss.requires_grad
                trained += batch["idx"].tolist()
                optimizer.step()
                optimizer.zero_grad()
    if injector is not None:
        injector.remove()
    return model, trained, fallback


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    model, trained, fallback = train()
    assert sorted(trained) == sorted(list(range(64)) * 2) and fallback.events == []
    return flat_params(model)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_split_matches_a_run_without_oom(reference: torch.Tensor, where: str) -> None:
    model, trained, fallback = train("split", limit=200, where=where, grow=False)  # plain halving
    assert sorted(trained) == sorted(list(range(64)) * 2)
    [event] = fallback.events
    assert (event.step, event.mode, event.where, event.ranks) == (0, "split", (where,), (0,))
    assert event.old_max_tokens == 256 and event.new_max_tokens < 128
    assert fallback.max_tokens == event.new_max_tokens and fallback.sampler.max_tokens == 256
    assert torch.allclose(flat_params(model), reference, atol=1e-6, rtol=0)


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_halve_replans_the_rest_of_the_epoch(reference: torch.Tensor, where: str) -> None:
    model, trained, fallback = train("halve", limit=200, where=where, grow=False)  # plain halving
    assert sorted(trained) == sorted(list(range(64)) * 2)  # the failed batch's samples come back once
    [event] = fallback.events
    assert fallback.sampler.max_tokens == fallback.max_tokens == event.new_max_tokens < 128
    assert fallback.sampler.stats().max_budget_use <= 1.0
    assert not torch.allclose(flat_params(model), reference)  # a different, shorter-batch trajectory


def test_retries_until_micro_batches_fit(reference: torch.Tensor) -> None:
    model, _, fallback = train("split", limit=40, where="backward", grow=False)
    assert [e.attempt for e in fallback.events] == list(range(len(fallback.events)))
    assert len(fallback.events) >= 3 and fallback.max_tokens <= 40
    assert torch.allclose(flat_params(model), reference, atol=1e-6, rtol=0)


def test_prefetching_loaders_lose_and_repeat_nothing() -> None:
    from accelerate.data_loader import DataLoaderShard

    def shard(sampler: TokenBudgetBatchSampler) -> Any:  # reads one batch ahead, like accelerate's
        return DataLoaderShard(ROWS, batch_sampler=sampler, collate_fn=collate)

    def workers(sampler: TokenBudgetBatchSampler) -> Any:  # the sampler runs far ahead
        return DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate, num_workers=2, prefetch_factor=4)

    for loader in (shard, workers):
        _, trained, fallback = train("halve", limit=100, epochs=1, loader=loader)
        assert sorted(trained) == list(range(64)), loader.__name__
        assert len(fallback.events) >= 1 and fallback.steps_done == fallback.sampler.plan.num_steps


def test_a_dataloader_the_sampler_does_not_feed_is_refused() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    other = DataLoader(ROWS, batch_sampler=TokenBudgetBatchSampler(LENGTHS, 256, seed=0), collate_fn=collate)
    with pytest.raises(ValueError, match="batch samplers are TokenBudgetBatchSampler"):
        next(OOMFallback(sampler, tiny_bert(0)).iterate(other))


def test_one_sample_that_cannot_fit_raises_instead_of_looping() -> None:
    with pytest.raises(SampleTooLargeError, match="single sample of") as info:
        train("split", limit=3)
    assert info.value.length > 3 and info.value.rank == 0
    with pytest.raises(SampleTooLargeError, match="min_tokens=100"):
        train("halve", limit=50, min_tokens=100)


def test_other_errors_pass_through_unchanged() -> None:
    model = tiny_bert(0)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    fallback = OOMFallback(sampler, model)
    batch = collate(ROWS[:4])
    error = KeyError("labels")

    def broken(batch: Any) -> torch.Tensor:
        raise error

    with pytest.raises(KeyError) as info:
        fallback.backward(batch, broken)
    assert info.value is error and fallback.events == []
    with pytest.raises(TypeError, match="scalar tensor"):
        fallback.backward(batch, lambda b: model(**{k: v for k, v in b.items() if k != "idx"}))


def test_resume_after_halving_keeps_the_budget_and_finishes_the_epoch() -> None:
    model = tiny_bert(0)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode="halve")
    trained: list[int] = []
    with inject_oom(model, 200):
        for batch in fallback.iterate(loader):
            if fallback.backward(batch, loss_fn(model)) is not None:
                trained += batch["idx"].tolist()
                model.zero_grad()
            if fallback.steps_done == 3:
                state = sampler.state_dict(steps_done=fallback.steps_done)
                break
    resumed = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    resumed.load_state_dict(state)
    assert resumed.max_tokens == fallback.max_tokens < 256
    rest = OOMFallback(resumed, model, mode="halve")
    for batch in rest.iterate(DataLoader(ROWS, batch_sampler=resumed, collate_fn=collate)):
        assert rest.backward(batch, loss_fn(model)) is not None
        trained += batch["idx"].tolist()
    assert sorted(trained) == list(range(64)) and rest.events == []


def test_resume_into_a_later_epoch_under_accelerate_one_process() -> None:
    """accelerate's DataLoaderShard calls set_epoch(its own pass count) on one process."""
    from accelerate.data_loader import DataLoaderShard

    model = tiny_bert(0)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    sampler.set_epoch(2)
    expected = [i for batch in list(sampler)[2:] for i in batch]
    state = sampler.state_dict(steps_done=2)
    resumed = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    resumed.load_state_dict(state)
    fallback = OOMFallback(resumed, model, mode="halve")
    trained: list[int] = []
    for batch in fallback.iterate(DataLoaderShard(ROWS, batch_sampler=resumed, collate_fn=collate)):
        assert fallback.backward(batch, loss_fn(model)) is not None
        trained += batch["idx"].tolist()
    assert resumed.epoch == 2 and trained == expected


def test_fallback_state_restores_the_micro_batch_budget() -> None:
    _, _, fallback = train("split", limit=200, epochs=1)
    fresh = OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256, seed=0), tiny_bert(0))
    fresh.load_state_dict(fallback.state_dict())
    assert fresh.max_tokens == fallback.max_tokens < 256 and fresh.events == fallback.events
    with pytest.raises(ValueError, match=r"OOMFallback\.state_dict"):
        fresh.load_state_dict({"max_tokens": 3})


@pytest.mark.parametrize("mode", ["split", "halve"])
def test_the_budget_that_worked_is_remembered(tmp_path: Path, mode: str) -> None:
    cache = BudgetCache(tmp_path / "budgets.json")
    key = BudgetKey("tiny-bert", "cpu:test", 2**30, "float32", 1)
    remember = lambda f: remember_budget(f, key, cache)  # noqa: E731
    _, _, fallback = train(mode, limit=200, epochs=1, setup=remember, grow=False)  # growth: test_oom_grow
    entry = cache.get(key)
    assert entry is not None and entry["max_tokens"] == fallback.max_tokens < 256
    assert entry["source"] == "oom" and entry["mode"] == mode
    # What it holds for: the sampler's cost model and padded lengths (no run trusts it for others).
    assert entry["version"] == 2 and entry["lengths"] == [min(LENGTHS), max(LENGTHS)]
    assert entry["cost"] == {"linear": 1.0, "quadratic": 0.0, "per_sample": 0.0, "pad_to_multiple_of": 1}
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    again = OOMFallback(sampler, tiny_bert(0), mode=mode)
    remember_budget(again, key, cache=cache)
    assert again.max_tokens == fallback.max_tokens
    assert sampler.max_tokens == (fallback.max_tokens if mode == "halve" else 256)


def test_events_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        train("halve", limit=200, epochs=1)
    [message] = [r.getMessage() for r in caplog.records if r.name == "tokenbatch.oom"]
    assert "epoch 0, step 0 on rank 0 (forward)" in message and "max_tokens 256 ->" in message


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"mode": "double"}, "mode should be one of 'split', 'halve'"),
        ({"factor": 1.0}, "factor should be below 1"),
        ({"factor": 0}, "factor should be a positive"),
        ({"min_tokens": -1}, "min_tokens should be a positive"),
    ],
)
def test_arguments_are_checked(options: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256), tiny_bert(0), **options)


def test_micro_batch_options_are_checked_and_unknown_keywords_refused() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256)
    with pytest.raises(ValueError, match="weight should be 'samples', 'tokens', a function or None"):
        OOMFallback(sampler, tiny_bert(0), weight="rows")
    assert OOMFallback(sampler, tiny_bert(0), weight="tokens").mode == "split"
    assert OOMFallback(sampler, tiny_bert(0), mode="halve", pad_token_id=0).mode == "halve"
    with pytest.raises(TypeError, match="unexpected keyword argument 'weigth'"):
        OOMFallback(sampler, tiny_bert(0), weigth="tokens")  # type: ignore[call-arg]


@pytest.mark.parametrize("mode", ["split", "halve"])
def test_start_from_lowers_the_budget_and_listeners_hear_of_new_budgets(mode: str) -> None:
    heard: list[float] = []

    def setup(fallback: OOMFallback) -> None:
        assert not fallback.start_from(256) and fallback.start_from(220) and fallback.max_tokens == 220
        fallback.add_listener(lambda f: heard.append(f.max_tokens))

    _, trained, fallback = train(mode, limit=100, epochs=1, setup=setup, grow=False)  # growth: test_oom_grow
    assert sorted(trained) == list(range(64))
    assert fallback.events and fallback.events[0].old_max_tokens == 220
    if mode == "split":
        assert fallback.sampler.max_tokens == 256  # the plan stays; micro-batches start at 220
    # Once per step trained after new events, that is after the new budget was shown to fit.
    assert 1 <= len(heard) <= len(fallback.events) and heard[-1] == fallback.max_tokens


def test_wrong_sampler_or_model_type() -> None:
    with pytest.raises(TypeError, match="TokenBudgetBatchSampler"):
        OOMFallback([[0, 1]], tiny_bert(0))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256), lambda x: x)  # type: ignore[arg-type]


def test_halve_mode_outside_iterate_is_refused_before_anything_trains() -> None:
    """Halve mode re-plans the epoch, and only a pass that restarts (iterate, the Trainer's) follows it."""
    model = tiny_bert(0)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode="halve")
    batch = next(iter(loader))
    with pytest.raises(ValueError, match=r"mode='halve' re-plans .* outside fallback\.iterate\(\)"):
        fallback.backward(batch, loss_fn(model))
    assert all(p.grad is None for p in model.parameters()) and fallback.steps_done == 0
    split = OOMFallback(sampler, model, mode="split")  # split mode keeps every batch: any loop will do
    trained = []
    with inject_oom(model, 200):
        for batch in loader:
            assert split.backward(batch, loss_fn(model)) is not None
            trained += batch["idx"].tolist()
    assert sorted(trained) == list(range(64)) and len(split.events) >= 1
    assert split.steps_done == sampler.plan.num_steps


def test_token_weights_split_a_token_averaged_loss_exactly() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(64, 8), torch.nn.Linear(8, 1))

    def token_mean(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].float()
        scores = model(batch["input_ids"]).squeeze(-1)
        return (scores.square() * mask).sum() / mask.sum()

    batch = collate(ROWS[:12])
    token_mean(batch).backward()
    whole = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    fallback = OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256), model, weight="tokens")
    with inject_oom(model, 60, times=1) as injector:
        loss = fallback.backward(batch, token_mean)
    assert injector.count == 1 and fallback.max_tokens < 256 and loss is not None
    for split_grad, grad in zip([p.grad for p in model.parameters()], whole, strict=True):
        assert split_grad is not None and torch.allclose(split_grad, grad, atol=1e-6)


def test_an_oom_on_a_batch_that_cannot_be_split_is_reported_not_guessed() -> None:
    fallback = OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256), tiny_bert(0))

    def runs_out(batch: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")

    with pytest.raises(TypeError, match="cannot split a batch of type dict with no tensor"):
        fallback.backward({"text": ["a", "b"]}, runs_out)
    assert fallback.events == []
