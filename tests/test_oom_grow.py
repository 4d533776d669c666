"""OOMFallback's growth after an out-of-memory error: real injected OOMs above a token threshold.

Issue 13: after halving, the guard climbs back towards the largest budget that
fits, each try guarded like any step; every sample is still trained exactly
once, tries never reach a cost that failed, and the bracket ends within the
tolerance of the true limit.
"""

from __future__ import annotations

import doctest
import logging
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.data import DataLoader

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
from tokenbatch.oom import Grow, GrowEvent, OOMEvent, _grow
from tokenbatch.oom._grow import BudgetSearch, peak_budget
from tokenbatch.probe import BudgetCache, BudgetKey, remember_budget
from tokenbatch.testing import inject_oom

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_oom_replan import Tiny, collate  # the tests directory is not a package

LENGTHS = np.random.default_rng(1).integers(4, 40, 300).tolist()
ROWS = [{"length": n, "idx": i} for i, n in enumerate(LENGTHS)]
KEY = BudgetKey("tiny", "cpu:test", 2**30, "float32", 1)


def run(
    mode: str,
    start: float,
    limit: float,
    *,
    epochs: int = 3,
    where: str = "forward",
    grow: bool | Grow = True,
    cache: BudgetCache | None = None,
) -> tuple[list[list[int]], OOMFallback]:
    """Samples trained per epoch; every batch costing more than ``limit`` padded tokens runs out of memory."""
    model = Tiny()
    sampler = TokenBudgetBatchSampler(LENGTHS, start, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode, grow=grow)
    if cache is not None:
        remember_budget(fallback, KEY, cache=cache)
    trained: list[list[int]] = []

    def loss(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(batch["input_ids"], batch["attention_mask"])

    with inject_oom(model, limit, where=where):
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            trained.append([])
            for batch in fallback.iterate(loader):
                if fallback.backward(batch, loss) is not None:
                    trained[-1] += batch["idx"].tolist()
                    model.zero_grad()
    return trained, fallback


def history(fallback: OOMFallback) -> list[tuple[str, float]]:
    """The OOM events and growths in order: ("oom" | "failed try" | "grown", the budget it was at)."""
    marks = [
        ((e.epoch, e.step, 0, i), "failed try" if e.growth else "oom", e.old_max_tokens)
        for i, e in enumerate(fallback.events)
    ]
    marks += [
        ((g.epoch, g.step, 1, i), "grown", g.new_max_tokens) for i, g in enumerate(fallback.growth_events)
    ]
    return [(kind, budget) for _, kind, budget in sorted(marks)]


def check_run(trained: list[list[int]], fallback: OOMFallback, start: float, limit: float) -> None:
    assert [sorted(epoch) for epoch in trained] == [list(range(len(LENGTHS)))] * len(trained)
    failed = math.inf
    for kind, budget in history(fallback):
        if kind != "oom":  # never a try at or above a budget that ran out of memory earlier
            assert budget < failed, (kind, budget, failed)
        if kind != "grown":
            failed = min(failed, budget)
    growth_failures = [e for e in fallback.events if e.growth]
    assert len(growth_failures) <= fallback.grow.max_failures if fallback.grow else not growth_failures
    halvings = max(1, math.ceil(math.log2(start / limit))) + 1
    assert len(fallback.events) - len(growth_failures) <= halvings


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(["halve", "split"]),
    where=st.sampled_from(["forward", "backward"]),
    limit=st.integers(60, 300),
    ratio=st.floats(1.2, 16.0),
)
def test_growth_ends_within_tolerance_of_the_limit_and_trains_every_sample_once(
    mode: str, where: str, limit: int, ratio: float, tmp_path_factory: pytest.TempPathFactory
) -> None:
    cache = BudgetCache(tmp_path_factory.mktemp("grow") / "budgets.json")
    settings_ = Grow(tolerance=0.05, max_failures=10)
    trained, fallback = run(mode, ratio * limit, limit, where=where, grow=settings_, cache=cache)
    check_run(trained, fallback, ratio * limit, limit)
    assert fallback.events  # the limit was hit
    entry = cache.get(KEY)  # the remembered budget: the largest that trained
    assert entry is not None
    remembered = entry["max_tokens"]
    # Within the tolerance of the limit: at least 95% of it; in halve mode a try is shown only by a
    # step costing 95% of it or more, which fitted (so at most limit / 0.95).
    assert remembered >= 0.95 * limit, (remembered, limit)
    assert mode == "split" or remembered <= limit / 0.95, (remembered, limit)


@settings(max_examples=8, deadline=None)
@given(mode=st.sampled_from(["halve", "split"]), limit=st.integers(60, 300), ratio=st.floats(1.2, 16.0))
def test_default_growth_is_bounded_and_lands_near_the_limit(mode: str, limit: int, ratio: float) -> None:
    trained, fallback = run(mode, ratio * limit, limit)
    check_run(trained, fallback, ratio * limit, limit)
    assert sum(e.growth for e in fallback.events) <= 3
    good = [g.new_max_tokens for g in fallback.growth_events]
    # The budget that trained last: after halving (>= limit / 2) and any growth proven since.
    assert max([*good, min(e.new_max_tokens for e in fallback.events)]) >= 0.85 * limit


def test_grow_false_keeps_plain_halving() -> None:
    trained, fallback = run("halve", 3 * 100, 100, grow=False)  # halving lands at 75
    assert [sorted(epoch) for epoch in trained] == [list(range(len(LENGTHS)))] * 3
    assert fallback.growth_events == [] and not any(e.growth for e in fallback.events)
    assert fallback.max_tokens == fallback.events[-1].new_max_tokens <= 100
    assert fallback.state_dict()["growth"] is None
    _, grown = run("halve", 3 * 100, 100)
    assert grown.growth_events and grown.max_tokens > fallback.max_tokens


@pytest.mark.parametrize("mode", ["halve", "split"])
def test_a_successful_growth_is_an_event_a_log_line_and_remembered(
    mode: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = BudgetCache(tmp_path / "budgets.json")
    with caplog.at_level(logging.INFO, logger="tokenbatch.oom"):
        _, fallback = run(mode, 150, 100, epochs=1, cache=cache)
    assert fallback.growth_events and all(isinstance(g, GrowEvent) for g in fallback.growth_events)
    first = fallback.growth_events[0]
    assert first.old_max_tokens < first.new_max_tokens <= 150 and first.reason == "bracket"
    assert any(m.startswith("grew max_tokens") for m in caplog.messages)
    # What is remembered is the largest budget that trained: the last growth, or where a failed try went back.
    last_oom, last_grow = fallback.events[-1], fallback.growth_events[-1]
    expected = (
        last_grow.new_max_tokens
        if (last_grow.epoch, last_grow.step) >= (last_oom.epoch, last_oom.step)
        else last_oom.new_max_tokens
    )
    entry = cache.get(KEY)
    assert entry is not None and entry["max_tokens"] == expected


def test_the_state_carries_the_bracket_so_a_resume_does_not_try_a_failed_budget_again() -> None:
    _, fallback = run("split", 400, 100, epochs=1)
    state = fallback.state_dict()
    assert state["version"] == 3 and state["growth"]["search"]["failed"] is not None
    failed = state["growth"]["search"]["failed"]
    sampler = TokenBudgetBatchSampler(LENGTHS, 400, seed=0)
    again = OOMFallback(sampler, Tiny(), mode="split")
    again.load_state_dict(state)
    assert again.max_tokens == fallback.max_tokens and again.growth_events == fallback.growth_events
    search = again._growth.search
    assert search is not None and search.failed == failed
    target = search.next_try(again.max_tokens)
    assert target is None or target < failed
    # A state of another version is refused, naming the one this tokenbatch reads.
    old = {k: state[k] for k in ("mode", "max_tokens")} | {"version": 1, "events": []}
    fresh = OOMFallback(TokenBudgetBatchSampler(LENGTHS, 400, seed=0), Tiny(), mode="split")
    with pytest.raises(ValueError, match=r"state should be an OOMFallback\.state_dict\(\) \(version 3"):
        fresh.load_state_dict(old)
    old_event = {k: v for k, v in fallback.events[0].as_dict().items() if k != "growth"}
    with pytest.raises(ValueError, match=r"event should be an OOMEvent\.as_dict\(\), with keys"):
        OOMEvent.from_dict(old_event)
    with pytest.raises(ValueError, match=r"state\['growth'\]\['search'\]\['failures'\] should be an integer"):
        bad = {
            **state,
            "growth": {**state["growth"], "search": {**state["growth"]["search"], "failures": -1}},
        }
        fresh.load_state_dict(bad)


def test_memory_changed_opens_the_bracket_up_to_the_ceiling() -> None:
    search = BudgetSearch(Grow(), ceiling=1000.0)
    assert search.failed_try(budget=1000.0, failed_cost=990.0, halved=495.0) == 495.0
    search.trained(budget=495.0, step_cost=480.0)
    search.start(735.0, before=495.0, reason="bracket")
    assert search.failed_try(budget=735.0, failed_cost=700.0, halved=367.5) == 495.0
    search.trained(budget=495.0, step_cost=490.0)
    assert search.memory_try(900.0, 495.0) is None  # above a cost that failed
    assert search.next_try(495.0) == (490.0 + 700.0) / 2  # below the cost that failed
    search.memory_changed()
    assert search.failed == search.ceiling and search.failures == 0  # the bracket reaches the ceiling again
    assert search.next_try(495.0) == (490.0 + 1000.0) / 2  # as after a first OOM at the ceiling
    assert search.memory_try(900.0, 495.0) == 900.0


def test_an_oom_at_the_budget_that_trained_still_lowers_it() -> None:
    """A step as costly as the budget trained (a sample over the budget alone, or batches longer
    than the lengths planned), then a batch costing more fails at that same budget: going back to
    "the costliest step that trained" would be the budget that just failed, re-planned for ever."""
    search = BudgetSearch(Grow(), ceiling=1000.0)
    assert search.failed_try(budget=1000.0, failed_cost=990.0, halved=495.0) == 495.0
    search.trained(budget=495.0, step_cost=600.0)  # trained alone, over the budget: proven is 495
    assert search.proven == 495.0
    new = search.failed_try(budget=495.0, failed_cost=650.0, halved=247.5)
    assert new < 495.0, "the budget that failed was kept: the same step fails again, for ever"
    assert new == 247.5


def test_grow_options_are_checked() -> None:
    with pytest.raises(ValueError, match="tolerance should be below 1"):
        Grow(tolerance=1.5)
    with pytest.raises(ValueError, match=r"memory_fraction should be in \(0, 1\)"):
        Grow(memory_fraction=1.2)
    with pytest.raises(TypeError, match=r"grow should be True, False or a tokenbatch\.oom\.Grow"):
        OOMFallback(TokenBudgetBatchSampler(LENGTHS, 100), Tiny(), grow="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capacity"):
        OOMFallback(TokenBudgetBatchSampler(LENGTHS, 100), Tiny(), grow=Grow(peak=lambda: 1.0))


# Forward + backward peaks of a 2-layer BERT (hidden size 64, AdamW), measured once on this CPU
# with the torch profiler through tokenbatch.probe's ProbeStep: (padded tokens, bytes). Two shapes
# per cost (8x64 and 16x32 ...): longer rows cost more at the same token count (attention).
MEASURED = [
    (256, 4384780),
    (512, 6887692),
    (512, 7674124),
    (1024, 11893516),
    (1024, 13487724),
    (2048, 21933804),
    (2048, 25145068),
]


def test_the_peak_fit_predicts_a_larger_measured_step_from_smaller_ones() -> None:
    costs: list[float] = []
    peaks: list[float] = []
    for cost, peak in MEASURED[:5]:  # up to 1024 tokens
        costs.append(cost)
        peaks.append(peak)
        if len(costs) < 4:
            assert peak_budget(costs, peaks, 100e6) is None  # too few points to say anything
    for cost, peak in MEASURED[5:]:  # the 2048-token steps, not seen by the fit
        proposed = peak_budget(costs, peaks, peak)
        assert proposed is not None and abs(proposed - cost) / cost < 0.15


def test_peak_readings_grow_the_budget_before_any_oom() -> None:
    """The CPU has no peak counter: a reader of the measured numbers above stands in for CUDA's."""
    costs, peaks = zip(*sorted(dict(MEASURED).items()), strict=True)
    ran: list[float] = []

    def peak() -> float | None:  # the measured peak for the batch just run, interpolated
        return None if not ran else float(np.interp(ran[-1], costs, peaks))

    capacity = 40e6  # 90%: 36 MB, about 3200 padded tokens on the measured line
    sampler = TokenBudgetBatchSampler(LENGTHS, 4000, seed=0)
    model = Tiny()
    grow = Grow(peak=peak, capacity=capacity, check_every=5)
    fallback = OOMFallback(sampler, model, mode="halve", grow=grow)
    assert fallback.start_from(600)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    for batch in fallback.iterate(loader):
        ran.append(float(batch["attention_mask"].numel()))
        fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"]))
    assert fallback.events == []
    [grown] = [g for g in fallback.growth_events if g.reason == "memory"][:1]
    assert grown.old_max_tokens == 600 and 2500 < grown.new_max_tokens < 3600


def test_without_readings_nothing_grows_before_an_oom() -> None:
    _, fallback = run("split", 400, 1000, epochs=1)  # the limit is never reached
    assert fallback.events == [] and fallback.growth_events == [] and fallback.max_tokens == 400


def test_doctests() -> None:
    assert doctest.testmod(_grow).failed == 0


def test_events_say_what_happened() -> None:
    _, fallback = run("halve", 150, 100, epochs=1)
    text = [str(e) for e in fallback.events if e.growth]
    assert all("growth try failed" in t for t in text)
    assert str(fallback.growth_events[0]).startswith("grew max_tokens")
    assert GrowEvent.from_dict(fallback.growth_events[0].as_dict()) == fallback.growth_events[0]


@pytest.mark.slow
def test_the_growth_benchmark_runs_quick(tmp_path: Path) -> None:
    import json
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(repo), "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.growth", "--quick", "--out", str(tmp_path)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "growth.json").read_text())
    rows = {(r["start"], r["schedule"]): r for r in result["search"]}
    # From 1.5x the limit, growth recovers what halving loses (halving lands at 0.75).
    assert rows[(1.5, "halve")]["final_over_limit"] == pytest.approx(0.75, abs=0.02)
    assert rows[(1.5, "grow")]["final_over_limit"] >= 0.9
    assert rows[(16.0, "factor-0.9")]["oom_events"] > rows[(16.0, "grow")]["oom_events"]


def run_uniform(length: int, count: int, start: float, limit: float) -> tuple[list[int], OOMFallback]:
    """Split mode, three epochs of ``count`` rows of one ``length``: each batch over the limit is cut.

    The case an even cut never proves: a batch under any budget between half its
    cost and all of it splits into the same two halves.
    """
    rows = [{"length": length, "idx": i} for i in range(count)]
    model = Tiny()
    with pytest.warns(UserWarning, match="same length"):
        sampler = TokenBudgetBatchSampler([length] * count, start, seed=0)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode="split", grow=Grow(tolerance=0.05, max_failures=10))
    trained: list[int] = []
    with inject_oom(model, limit):
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for batch in fallback.iterate(loader):
                assert (
                    fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"])) is not None
                )
                trained += batch["idx"].tolist()
                model.zero_grad()
    return trained, fallback


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(length=st.integers(4, 12), fit=st.integers(2, 8), ratio=st.floats(1.5, 16.0))
def test_split_growth_proves_its_tries_where_the_rows_allow(length: int, fit: int, ratio: float) -> None:
    limit = length * fit + length / 2  # between two multiples of the row cost: ``fit`` rows fit, not more
    per_batch = math.floor(ratio * limit / length)  # rows in a planned batch: more than fit
    count = 6 * per_batch
    trained, fallback = run_uniform(length, count, ratio * limit, limit)
    assert sorted(trained) == sorted(list(range(count)) * 3)  # every sample once per epoch
    allowed = length * fit  # the largest micro-batch under the limit: whole rows
    good = [g.new_max_tokens for g in fallback.growth_events]
    # The largest budget that trained: a proven try, or the halving after the first OOMs.
    reached = max([*good, min(e.new_max_tokens for e in fallback.events)])
    assert reached >= min(0.95 * limit, allowed), (reached, limit, history(fallback))
    failed = math.inf
    for kind, budget in history(fallback):  # never a try at or above a budget that ran out of memory
        assert kind == "oom" or budget < failed, (kind, budget, failed)
        failed = min(failed, budget) if kind != "grown" else failed


def test_split_growth_matches_a_run_without_oom() -> None:
    from test_oom import flat_params, train  # the greedy cut of a try changes only how a batch is cut

    reference, _, _ = train()
    model, trained, fallback = train("split", limit=200, grow=True)
    assert fallback.growth_events and sorted(trained) == sorted(list(range(64)) * 2)
    assert torch.allclose(flat_params(model), flat_params(reference), atol=1e-6, rtol=0)


def test_the_docstring_case_grows_in_split_mode() -> None:
    # OOMFallback's example: 4 rows of 4 tokens per batch, one OOM at 16 -> 8; a try of 12 is
    # cut 3 + 1 rows (not 2 + 2), so the step proves it.
    sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
    model = torch.nn.Linear(4, 1)
    fallback = OOMFallback(sampler, model, mode="split")
    batches = [torch.ones(len(indices), 4) for indices in sampler]
    with inject_oom(model, max_tokens=8, times=1):
        for x in fallback.iterate(batches):
            fallback.backward(x, lambda x: model(x).square().mean())
    [grown] = fallback.growth_events
    assert (grown.step, grown.old_max_tokens, grown.new_max_tokens) == (1, 8.0, 12.0)


@pytest.mark.parametrize("mode", ["halve", "split"])
def test_memory_changed_climbs_again_towards_the_samplers_budget(mode: str) -> None:
    """Issue 21.2: more memory, then ``memory_changed()``: the guard climbs as after the first OOM, on CPU."""
    model = Tiny()
    sampler = TokenBudgetBatchSampler(LENGTHS, 2000, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode)
    changed_at = 2
    with inject_oom(model, 300) as injector:
        for epoch in range(5):
            if epoch == changed_at:  # the other job on the device ended: 1000 fits now
                injector.max_tokens = 1000
                fallback.memory_changed()
            sampler.set_epoch(epoch)
            trained: list[int] = []
            for batch in fallback.iterate(loader):
                if fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"])) is not None:
                    trained += batch["idx"].tolist()
            assert sorted(trained) == list(range(len(LENGTHS))), epoch  # every sample once per epoch
            if epoch == changed_at - 1:
                assert fallback.max_tokens <= 300 / 0.95
    after = [g.new_max_tokens for g in fallback.growth_events if g.epoch >= changed_at]
    assert after and max(after) >= 0.85 * 1000, (fallback.max_tokens, after)
    assert mode == "split" or max(after) <= 1000 / 0.95
    # After the change: at most max_failures failed tries, none at or above a cost that failed since.
    since = [e for e in fallback.events if e.epoch >= changed_at]
    assert all(e.growth for e in since) and len(since) <= Grow().max_failures
    failed = math.inf
    for kind, budget in history(fallback)[-len(after) - len(since) :]:
        assert kind == "oom" or budget < failed, (kind, budget, failed)
        failed = min(failed, budget) if kind != "grown" else failed


# Long-tailed lengths (a few reviews of hundreds of tokens among short ones): here attention's
# quadratic term ranks batches differently from their padded token count.
TAILED = np.clip(np.random.default_rng(1).lognormal(np.log(60), 0.8, 300), 4, 500).astype(int).tolist()


def run_attention(mode: str, rule: str) -> tuple[list[tuple[float, float, float]], OOMFallback]:
    """Two epochs under ``CostModel.attention(435)`` and 3000 of ``rule`` ("sampler": the same cost,
    "padded": padded tokens): per OOM event (the costliest step trained before it, the cost of
    the batch that failed, both in the sampler's cost, the new budget)."""
    model = Tiny()
    rows = [{"length": n, "idx": i} for i, n in enumerate(TAILED)]
    sampler = TokenBudgetBatchSampler(TAILED, 8192, cost=CostModel.attention(435), seed=0)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    fallback = OOMFallback(sampler, model, mode=mode)
    shapes: list[tuple[int, int]] = []  # every model call, the failing ones too (hooked before the injector)
    model.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape)))
    seen: list[tuple[float, float, float]] = []
    proven = 0.0  # the costliest step (split: micro-batch) trained since the last OOM at or below it
    with inject_oom(model, 3000, cost=sampler if rule == "sampler" else None) as injector:
        for epoch in range(2):
            sampler.set_epoch(epoch)
            trained: list[int] = []
            for batch in fallback.iterate(loader):
                calls, events = len(shapes), len(fallback.events)
                loss = fallback.backward(batch, lambda b: model(b["input_ids"], b["attention_mask"]))
                ran = [
                    (sampler.cost.cost(*shape), over > injector.max_tokens)
                    for shape, over in zip(shapes[calls:], injector.costs[calls:], strict=True)
                ]
                failed = [c for c, oom in ran if oom]
                for event, failed_cost in zip(fallback.events[events:], failed, strict=True):
                    seen.append((proven, failed_cost, event.new_max_tokens))
                    proven = 0.0 if failed_cost <= proven else proven
                if loss is not None:  # the calls after the last failure trained
                    last = max((i for i, (_, oom) in enumerate(ran) if oom), default=-1)
                    proven = max([proven] + [c for c, _ in ran[last + 1 :]])
                    trained += batch["idx"].tolist()
            assert sorted(trained) == list(range(len(TAILED))), epoch  # every sample once per epoch
    return seen, fallback


@pytest.mark.parametrize("mode", ["halve", "split"])
def test_a_later_oom_goes_back_to_the_costliest_step_that_trained(mode: str) -> None:
    """Issue 21.8: a rehearsal with the sampler's own cost never lands below what trained."""
    seen, fallback = run_attention(mode, "sampler")
    assert len(seen) == len(fallback.events) > 2 and fallback.growth_events
    for proven, failed_cost, new in seen:
        assert failed_cost > proven and new >= proven, (proven, failed_cost, new)


def test_below_what_trained_only_after_a_batch_cheaper_than_it_failed() -> None:
    """Where memory ranks batches otherwise than the sampler's cost (padded tokens against
    attention's), a batch cheaper than a step that trained can fail: only then is the budget halved
    from it, below that step (what docs/oom.md says)."""
    seen, _ = run_attention("halve", "padded")
    assert any(failed_cost <= proven for proven, failed_cost, _ in seen)  # the case happens here
    for proven, failed_cost, new in seen:
        assert new >= proven or failed_cost <= proven, (proven, failed_cost, new)
