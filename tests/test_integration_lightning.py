"""tokenbatch.integrations.lightning with real Lightning: one process here, two DDP processes in a script.

Which samples each rank trained is recorded from the batches ``training_step``
received (tests/scripts/lightning_common.py); out-of-memory errors are real
``torch.OutOfMemoryError`` exceptions raised by ``tokenbatch.testing.inject_oom``.
"""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenbatch import TokenBudgetBatchSampler
from tokenbatch.integrations.lightning import TokenBudgetCallback, oom_fallback
from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import lightning_common as lc
finally:
    sys.path.pop(0)

EPOCHS = 2

pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings(
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"
    ),  # Lightning's own
]


@pytest.fixture(scope="module", autouse=True)
def _quiet_one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the machine is shared; one order of reductions
    lc.quiet()
    yield
    torch.set_num_threads(threads)


def expected_batches(epoch: int, *, num_replicas: int = 1, rank: int = 0) -> list[list[int]]:
    """The plan a fresh sampler with the tests' settings gives ``rank`` in ``epoch``."""
    reference = lc.make_sampler(lc.make_rows(), num_replicas=num_replicas, rank=rank)
    reference.set_epoch(epoch)
    return list(reference)


def assert_each_sample_once(per_rank: list[dict[int, list[list[int]]]]) -> None:
    assert all(sorted(batches) == list(range(EPOCHS)) for batches in per_rank)
    for epoch in range(EPOCHS):
        seen = sorted(i for batches in per_rank for batch in batches[epoch] for i in batch)
        assert seen == list(range(lc.NUM_SAMPLES)), f"epoch {epoch}: not every sample exactly once"


def fit(module: lc.Recorder, tmp_path: Path, *callbacks: TokenBudgetCallback) -> lc.Recorder:
    lc.trainer(default_root_dir=tmp_path, callbacks=list(callbacks)).fit(module)
    return module


# -- one process -------------------------------------------------------------------


def test_without_the_callback_lightning_repeats_the_first_plan(tmp_path: Path) -> None:
    """Why the callback calls set_epoch: Lightning calls it on samplers, never on a batch sampler."""
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = fit(lc.Recorder(rows, sampler), tmp_path)
    assert module.batches[0] == module.batches[1] == expected_batches(0)
    assert sampler.epoch == 0


def test_callback_gives_every_epoch_its_own_plan(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = fit(lc.Recorder(rows, sampler), tmp_path, TokenBudgetCallback(sampler))
    assert [module.batches[e] for e in range(EPOCHS)] == [expected_batches(e) for e in range(EPOCHS)]
    assert module.batches[0] != module.batches[1]
    assert_each_sample_once([module.batches])
    assert sampler.epoch == EPOCHS - 1 and sampler.rank is None  # one process: left unsharded


def test_callback_sets_the_epoch_before_dataloader_workers_read_ahead(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    sampler.set_epoch(5)  # left at another epoch, as by an earlier fit
    module = fit(lc.Recorder(rows, sampler, num_workers=2), tmp_path, TokenBudgetCallback(sampler))
    assert [module.batches[e] for e in range(EPOCHS)] == [expected_batches(e) for e in range(EPOCHS)]


def test_callback_finds_a_sampler_made_in_train_dataloader(tmp_path: Path) -> None:
    module = fit(lc.Recorder(lc.make_rows(), None), tmp_path, TokenBudgetCallback())
    assert [module.batches[e] for e in range(EPOCHS)] == [expected_batches(e) for e in range(EPOCHS)]
    assert module.batches[0] != module.batches[1]


def test_callback_refuses_a_sampler_planned_for_another_world_size(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows, num_replicas=2)
    with pytest.raises(
        ValueError, match=r"num_replicas should be the trainer's world_size=1, but got num_replicas=2"
    ):
        fit(lc.Recorder(rows, sampler), tmp_path, TokenBudgetCallback(sampler))


def test_callback_takes_only_token_budget_samplers() -> None:
    with pytest.raises(
        TypeError, match=r"samplers should be tokenbatch\.TokenBudgetBatchSampler objects, but got a list"
    ):
        TokenBudgetCallback([1, 2])  # type: ignore[arg-type]


def test_split_fallback_survives_an_injected_oom_in_manual_optimisation(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    reference = fit(lc.Recorder(rows, sampler, manual=True), tmp_path, TokenBudgetCallback(sampler))
    assert reference.fallback is not None and reference.fallback.events == []

    sampler = lc.make_sampler(rows)
    module = lc.Recorder(rows, sampler, manual=True, grow=False)  # the budget stays where the OOM put it
    with inject_oom(module.net, max_tokens=100, times=1) as injector:
        fit(module, tmp_path, TokenBudgetCallback(sampler))
    assert injector.count == 1 and module.fallback is not None
    (event,) = module.fallback.events
    assert (event.epoch, event.step, event.where) == (0, 0, ("forward",))
    assert module.fallback.max_tokens == event.new_max_tokens < lc.BUDGET
    assert module.batches == reference.batches  # the same planned batches, the over-budget ones split
    assert module.fallback.steps_done == len(module.batches[EPOCHS - 1])  # counted per epoch
    assert_each_sample_once([module.batches])
    assert torch.allclose(module.flat_params(), reference.flat_params(), atol=1e-6, rtol=0)


def test_halve_mode_is_refused_with_the_reason(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    with pytest.raises(
        ValueError, match=r"mode should be 'split' under Lightning, but got mode='halve'.*Lightning owns"
    ):
        fit(lc.Recorder(rows, sampler, manual=True, mode="halve"), tmp_path, TokenBudgetCallback(sampler))


def test_automatic_optimisation_is_refused_with_the_fix() -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    with pytest.raises(
        ValueError, match=r"automatic_optimization should be False.*self.automatic_optimization = False"
    ):
        oom_fallback(lc.Recorder(rows, sampler), sampler)


def test_without_lightning_the_import_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("lightning", "lightning.pytorch"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules: "import lightning" fails
    monkeypatch.delitem(sys.modules, "tokenbatch.integrations.lightning")
    with pytest.raises(ImportError, match=r"pip install 'tokenbatch\[lightning\]'"):
        importlib.import_module("tokenbatch.integrations.lightning")


# -- two processes -----------------------------------------------------------------


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """Every scenario of tests/scripts/lightning_ddp.py: (rank 0's result, rank 1's)."""
    out = tmp_path_factory.mktemp("lightning_ddp")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    command = [sys.executable, str(SCRIPTS / "lightning_ddp.py"), str(out)]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"the 2-process Lightning run hung (no result in 300 s): {error.stderr!r:.2000}")
    assert done.returncode == 0, done.stderr[-4000:]
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {name: (ranks[0][name], ranks[1][name]) for name in ranks[0]}


TRAINED = ["auto", "reference", "oom_split", "oom_grow", "rank_in_hook"]


@pytest.mark.slow
@pytest.mark.parametrize("name", TRAINED)
def test_two_processes_train_every_sample_once_per_epoch(runs: dict[str, Any], name: str) -> None:
    zero, one = runs[name]
    assert (zero["rank"], one["rank"]) == (0, 1)
    for epoch in range(EPOCHS):
        for rank, result in enumerate((zero, one)):
            assert result["batches"][epoch] == expected_batches(epoch, num_replicas=2, rank=rank)
        assert len(zero["batches"][epoch]) == len(one["batches"][epoch])  # the same number of steps
    assert_each_sample_once([zero["batches"], one["batches"]])
    assert zero["batches"][0] != zero["batches"][1]
    assert torch.equal(zero["params"], one["params"])


@pytest.mark.slow
@pytest.mark.parametrize("step", [3, 6])
def test_two_processes_resume_a_checkpoint_mid_epoch(runs: dict[str, Any], step: int) -> None:
    """ModelCheckpoint(every_n_train_steps=3), 4 steps an epoch; fit(ckpt_path=...) from steps 3 and 6."""
    whole, resumed = runs["checkpointed"], runs[f"resumed_{step}"]
    together = []
    for rank in range(2):
        before = lc.trained_before(whole[rank]["batches"], step)
        together.append(lc.joined(before, resumed[rank]["batches"]))
        assert together[rank] == whole[rank]["batches"]  # what this rank trained, in the same order
        assert torch.equal(resumed[rank]["params"], whole[rank]["params"])
    assert_each_sample_once(together)


@pytest.mark.slow
def test_two_processes_survive_an_oom_on_rank_1_by_splitting(runs: dict[str, Any]) -> None:
    zero, one = runs["oom_split"]
    assert (zero["injected"], one["injected"]) == (0, 1)
    assert zero["events"] == one["events"] and len(zero["events"]) == 1
    event = zero["events"][0]
    assert list(event["ranks"]) == [1] and event["step"] == 0
    assert zero["max_tokens"] == one["max_tokens"] == event["new_max_tokens"] < lc.BUDGET
    reference = runs["reference"][0]
    assert torch.allclose(zero["params"], reference["params"], atol=1e-6, rtol=0)


@pytest.mark.slow
def test_two_processes_grow_back_alike_after_an_oom_on_rank_1(runs: dict[str, Any]) -> None:
    """grow=True on 2 processes: every decision (failed tries, larger budgets) the same on both ranks."""
    zero, one = runs["oom_grow"]
    assert zero["injected"] == 0 and one["injected"] >= 1
    assert zero["events"] == one["events"] and zero["growth"] == one["growth"]
    assert zero["max_tokens"] == one["max_tokens"]
    tried = [event for event in zero["events"] if event["growth"]]
    assert zero["growth"] or tried, "growth never tried a larger budget"
    assert zero["max_tokens"] > zero["events"][0]["new_max_tokens"] or tried


@pytest.mark.slow
def test_two_processes_fallback_averages_gradients_like_lightning_ddp(runs: dict[str, Any]) -> None:
    auto, guarded = runs["auto"][0], runs["reference"][0]
    assert torch.allclose(auto["params"], guarded["params"], atol=1e-6, rtol=0)
    assert auto["losses"] == pytest.approx(guarded["losses"], abs=1e-6)


REFUSED = {
    "replacement": r"ValueError: use_distributed_sampler should be False for TokenBudgetBatchSampler on 2 "
    r"processes, but got use_distributed_sampler=True .*"
    r"Pass Trainer\(\.\.\., use_distributed_sampler=False\)",
    # Refused by the callback, or first by the sampler itself when Lightning's DataLoader reads it.
    "unsharded": r"ValueError: rank should be (set on the training DataLoader's TokenBudgetBatchSampler on 2 "
    r"processes, but got rank=None: every process would train every sample|this process's rank when a "
    r"DataLoader reads the sampler itself on 2 processes)",
    "halve": r"ValueError: mode should be 'split' under Lightning, but got mode='halve'",
    # What Lightning does without the callback (its own refusal: the sampler has no fixed batch size).
    "replacement_no_callback": (
        r"TypeError: .*can't inject a \(distributed\) sampler .*use_distributed_sampler"
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(REFUSED))
def test_two_processes_refuse_what_would_fail_or_repeat_samples(runs: dict[str, Any], name: str) -> None:
    for result in runs[name]:  # on both ranks, before any training step
        assert set(result) == {"error"}
        assert re.match(REFUSED[name], result["error"]), result["error"]


def test_expected_batches_shard_the_global_plan() -> None:
    """The reference the 2-process tests compare with: rank r's batches are the global plan's r, r+2, ..."""
    lengths = [len(r["input_ids"]) for r in lc.make_rows()]
    whole = TokenBudgetBatchSampler(lengths, max_tokens=lc.BUDGET, seed=3, num_replicas=2)
    whole.set_epoch(1)
    plan = list(whole)
    assert expected_batches(1, num_replicas=2, rank=0) == plan[0::2]
    assert expected_batches(1, num_replicas=2, rank=1) == plan[1::2]


def test_split_fallback_grows_back_after_an_oom_and_trains_every_sample_once(tmp_path: Path) -> None:
    """grow=True under Lightning: the micro-batch budget climbs back towards the threshold."""
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = lc.Recorder(rows, sampler, manual=True, grow=True)
    with inject_oom(module.net, max_tokens=100) as injector:  # every batch over 100 padded tokens fails
        fit(module, tmp_path, TokenBudgetCallback(sampler))
    fallback = module.fallback
    assert fallback is not None and injector.count >= 1
    assert fallback.growth_events, "no larger budget was tried and trained"
    # Within 10% of the threshold (the budget counts tokens of the plan, the injector padded ones).
    assert fallback.events[0].new_max_tokens < fallback.max_tokens
    assert abs(fallback.max_tokens - 100) <= 0.1 * 100
    assert_each_sample_once([module.batches])
