"""Example tests of TokenBudgetBatchSampler: DataLoader use, accelerate's sharding, statistics, errors."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
from accelerate.data_loader import BatchSamplerShard
from torch.utils.data import DataLoader, Dataset

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler


class IndexDataset(Dataset[int]):
    """Returns its own index, so a batch shows which samples it holds."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> int:
        return index


def long_tailed(n: int, seed: int = 0) -> np.ndarray:
    values = np.random.default_rng(seed).lognormal(np.log(60), 0.9, n)
    return np.clip(np.round(values), 2, 256).astype(np.int64)


def test_dataloader_with_two_workers_sees_each_sample_once() -> None:
    lengths = long_tailed(3000)
    sampler = TokenBudgetBatchSampler(lengths, 4096, cost=CostModel(quadratic=1 / 512), seed=3)
    loader = DataLoader(IndexDataset(len(lengths)), batch_sampler=sampler, num_workers=2)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected = list(sampler)
        got = [batch.tolist() for batch in loader]
        assert got == expected
        assert len(loader) == len(got)
        assert sorted(i for batch in got for i in batch) == list(range(len(lengths)))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_accelerate_batch_sampler_shard_splits_the_global_plan(world: int) -> None:
    lengths = long_tailed(1001, seed=world)
    sampler = TokenBudgetBatchSampler(lengths, 2048, num_replicas=world, seed=1)
    assert len(sampler) % world == 0
    seen: list[int] = []
    counts = []
    for rank in range(world):
        shard = BatchSamplerShard(sampler, num_processes=world, process_index=rank, even_batches=True)
        batches = list(shard)
        assert len(shard) == len(batches)
        # The same batches a plain-DDP sampler for this rank yields.
        assert batches == list(TokenBudgetBatchSampler(lengths, 2048, num_replicas=world, rank=rank, seed=1))
        counts.append(len(batches))
        seen += [i for batch in batches for i in batch]
    assert len(set(counts)) == 1
    assert sorted(seen) == list(range(len(lengths)))  # even_batches never had to repeat a sample


def test_no_fixed_batch_size_for_accelerate() -> None:
    sampler = TokenBudgetBatchSampler([3, 4], 10)
    assert not hasattr(sampler, "batch_size")  # accelerate then knows the batches are not of one size
    assert BatchSamplerShard(sampler, 2, 0).batch_size is None


def test_world_size_comes_from_the_launcher_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    sampler = TokenBudgetBatchSampler(long_tailed(500), 1024)
    assert sampler.num_replicas == 4
    assert len(sampler) % 4 == 0
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert sampler.num_replicas == 1  # read when planning, not frozen at construction


def test_stats_describe_the_plan() -> None:
    lengths = np.array([10] * 6 + [12] * 2 + [20] * 4 + [40])
    sampler = TokenBudgetBatchSampler(lengths, 96, shuffle=False)
    batches = list(sampler)
    assert batches == [list(range(8)), [8, 9, 10, 11], [12]]  # costs 96, 80, 40: costliest first
    stats = sampler.stats()
    assert stats.num_samples == 13
    assert stats.num_batches == stats.num_steps == 3
    assert math.isclose(stats.padding_efficiency, (60 + 24 + 80 + 40) / (96 + 80 + 40))
    assert math.isclose(stats.mean_budget_use, (96 + 80 + 40) / 3 / 96)
    assert stats.max_budget_use <= 1.0
    assert stats.max_batch_size == max(len(b) for b in batches)
    assert stats.num_skipped == stats.num_dropped == 0


def test_costliest_batch_comes_first() -> None:
    lengths = np.concatenate([np.full(500, 10), np.full(3, 300)])
    cost = CostModel(quadratic=1 / 100)
    sampler = TokenBudgetBatchSampler(lengths, cost.cost(1, 300) * 2, cost=cost, seed=5)
    for epoch in range(3):
        sampler.set_epoch(epoch)
        first = next(iter(sampler))
        assert lengths[first].max() == 300


def test_set_epoch_same_epoch_keeps_resumed_position() -> None:
    lengths = long_tailed(400)
    sampler = TokenBudgetBatchSampler(lengths, 512, seed=2)
    sampler.set_epoch(3)
    batches = list(sampler)
    state = sampler.state_dict(steps_done=4)
    resumed = TokenBudgetBatchSampler(lengths, 512, seed=2)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # a training loop calling set_epoch on resume must not lose the position
    assert resumed.start_step == 4
    assert list(resumed) == batches[4:]
    resumed.set_epoch(4)
    assert len(resumed) == len(list(resumed))


def test_replan_stops_a_running_iterator_that_read_past_it() -> None:
    lengths = long_tailed(400)
    sampler = TokenBudgetBatchSampler(lengths, 1024, seed=2)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(3)]
    sampler.replan(512, steps_done=1)  # the second and third batches were fetched but not trained
    assert list(iterator) == []
    assert sampler.start_step == 1
    rest = list(sampler)
    assert sorted(i for b in taken[:1] + rest for i in b) == list(range(400))
    assert sampler.state_dict()["max_tokens"] == 512.0


def test_a_replan_stops_the_running_pass_and_the_next_pass_yields_the_new_plan() -> None:
    """A pass walks the plan it started on; after a re-plan a new pass (a new DataLoader pass) follows."""
    lengths = long_tailed(400)
    sampler = TokenBudgetBatchSampler(lengths, 1024, seed=2, num_replicas=2)
    iterator = iter(sampler)
    taken = [next(iterator) for _ in range(6)]  # three whole steps
    sampler.replan(512, steps_done=2)  # the third step's batches were fetched but not trained
    assert list(iterator) == []  # the old pass stops: no batch of the replaced plan comes after
    plan = sampler.plan
    expected = [plan.batch(b).tolist() for b in range(2 * 2, plan.num_batches)]
    rest = list(sampler)
    assert rest == expected and sampler.state_dict()["steps_done"] == plan.num_steps
    assert sorted(i for b in taken[:4] + rest for i in b) == list(range(400))


def test_state_dict_default_position_counts_handed_out_steps() -> None:
    sampler = TokenBudgetBatchSampler(long_tailed(400), 512, num_replicas=2)
    iterator = iter(sampler)
    for _ in range(5):  # two whole steps and half of the third
        next(iterator)
    assert sampler.state_dict()["steps_done"] == 2


def test_the_sampler_counts_only_the_steps_it_yielded() -> None:
    sampler = TokenBudgetBatchSampler(long_tailed(400), 512, num_replicas=2, seed=1)
    iterator = iter(sampler)
    for _ in range(4):  # two whole steps: a step counts as yielded with its last batch
        next(iterator)
    assert (sampler.start_step, sampler.state_dict()["steps_done"]) == (0, 2)
    sampler.replan(256, steps_done=0)  # before the step last yielded: the old pass cannot carry on
    assert list(iterator) == []  # the old pass stops, and leaves the new plan's count alone
    assert (sampler.start_step, sampler.state_dict()["steps_done"]) == (0, 0)
    sampler.set_epoch(1)
    assert (sampler.epoch, sampler.start_step, sampler.state_dict()["steps_done"]) == (1, 0, 0)


def test_steps_in_epoch_is_the_plan_a_fresh_sampler_makes() -> None:
    lengths = long_tailed(400)
    sampler = TokenBudgetBatchSampler(lengths, 512, seed=4, num_replicas=2)
    sampler.replan(300, steps_done=3)  # re-plans of the current epoch do not count
    for epoch in range(3):
        fresh = TokenBudgetBatchSampler(lengths, 256, seed=4, num_replicas=2)
        fresh.set_epoch(epoch)
        assert sampler.steps_in_epoch(epoch, 256) == fresh.plan.num_steps
    assert (
        sampler.steps_in_epoch(0)
        == TokenBudgetBatchSampler(lengths, 300, seed=4, num_replicas=2).plan.num_steps
    )


def test_samples_over_the_budget_are_reported_by_the_sampler(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="tokenbatch.sampler"):
        TokenBudgetBatchSampler([10, 500, 10, 600], 100, oversize="alone")
        list(TokenBudgetBatchSampler([10, 500, 10], 100, oversize="skip"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("2 sample(s) alone exceed max_tokens=100 and get a batch of their own")
    assert "left out 1 sample(s)" in messages[1] and len(messages) == 2


def test_batch_size_multiple_and_max_batch_size() -> None:
    lengths = np.full(1000, 16)
    sampler = TokenBudgetBatchSampler(lengths, 16 * 100, batch_size_multiple=8, max_batch_size=60)
    sizes = [len(b) for b in sampler]
    assert all(size % 8 == 0 for size in sizes[:-1])
    assert max(sizes) == 56


def test_oversize_policies() -> None:
    lengths = [10, 10, 500, 10]
    alone = TokenBudgetBatchSampler(lengths, 100, oversize="alone", shuffle=False)
    assert [2] in list(alone)
    skip = TokenBudgetBatchSampler(lengths, 100, oversize="skip")
    assert sorted(i for b in skip for i in b) == [0, 1, 3]
    assert skip.stats().num_skipped == 1 and skip.plan.skipped.tolist() == [2]


def lengths_error_cases() -> list[tuple[Any, type[Exception], str]]:
    return [
        ([], ValueError, "empty lengths"),
        ([3, 0, 4], ValueError, r"lengths\[1\]=0"),
        ([3, -2], ValueError, r"lengths\[1\]=-2"),
        ([3.0, 2.5], ValueError, r"lengths\[1\]=2.5"),
        ([3.0, float("nan")], ValueError, r"lengths\[1\]=nan"),
        (["a", "b"], TypeError, "should hold integers"),
        (np.array([[1, 2], [3, 4]]), ValueError, "one-dimensional"),  # a list of lists is token lists
        ([True, False], TypeError, "should hold integers"),
    ]


@pytest.mark.parametrize(("lengths", "error", "message"), lengths_error_cases())
def test_bad_lengths_are_named(lengths: Any, error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=message):
        TokenBudgetBatchSampler(lengths, 100)


def test_lengths_accept_lists_arrays_and_tensors() -> None:
    expected = list(TokenBudgetBatchSampler([5, 9, 2, 7], 20, seed=1))
    for lengths in (np.array([5, 9, 2, 7], dtype=np.int32), torch.tensor([5, 9, 2, 7]), [5.0, 9.0, 2.0, 7.0]):
        assert list(TokenBudgetBatchSampler(lengths, 20, seed=1)) == expected


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (
            {"max_tokens": 0},
            ValueError,
            "max_tokens should be a positive finite number, but got max_tokens=0",
        ),
        ({"max_tokens": float("inf")}, ValueError, "max_tokens=inf"),
        ({"max_tokens": float("nan")}, ValueError, "max_tokens=nan"),
        ({"max_tokens": "100"}, TypeError, "max_tokens should be a positive number"),
        ({"rank": 2, "num_replicas": 2}, ValueError, "rank should be below num_replicas=2, but got rank=2"),
        ({"rank": -1}, ValueError, "rank should be an integer >= 0"),
        ({"num_replicas": 0}, ValueError, "num_replicas should be an integer >= 1"),
        ({"oversize": "drop"}, ValueError, "oversize should be one of 'error', 'skip', 'alone'"),
        ({"max_batch_size": 0}, ValueError, "max_batch_size"),
        ({"batch_size_multiple": 0}, ValueError, "batch_size_multiple"),
        ({"seed": -1}, ValueError, "seed"),
        ({"cost": "quadratic"}, TypeError, "cost should be a tokenbatch.CostModel"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    arguments: dict[str, Any] = {"max_tokens": 100, **kwargs}
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        TokenBudgetBatchSampler([5, 6, 7], **arguments)


def test_rank_beyond_launcher_world_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="rank should be below num_replicas=2, but got rank=3"):
        len(TokenBudgetBatchSampler([5, 6, 7], 100, rank=3))


def test_load_state_dict_rejects_other_dataset_settings_and_keys() -> None:
    sampler = TokenBudgetBatchSampler([5, 6, 7, 8], 100, seed=1)
    state = sampler.state_dict()
    with pytest.raises(ValueError, match="different dataset"):
        TokenBudgetBatchSampler([5, 6, 7, 9], 100, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="different dataset"):
        TokenBudgetBatchSampler([5, 6, 7], 100, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match=r"seed: saved 1, now 2"):
        TokenBudgetBatchSampler([5, 6, 7, 8], 100, seed=2).load_state_dict(state)
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        sampler.load_state_dict({**state, "extra": 1})
    with pytest.raises(ValueError, match="version"):
        sampler.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match=r"state\['steps_done'\]=99"):
        sampler.load_state_dict({**state, "steps_done": 99})
    # The budget in the state wins over the constructor's: a resumed run keeps its halved budget.
    resumed = TokenBudgetBatchSampler([5, 6, 7, 8], 100, seed=1)
    resumed.load_state_dict({**state, "max_tokens": 50.0})
    assert resumed.max_tokens == 50.0


def test_replan_rejects_bad_arguments_and_stays_unchanged() -> None:
    sampler = TokenBudgetBatchSampler([5, 6, 7, 80], 100, seed=1)
    before = list(sampler)
    with pytest.raises(ValueError, match="steps_done should be at most"):
        sampler.replan(50, steps_done=len(before) + 1)
    with pytest.raises(ValueError, match="max_tokens should be a positive finite number"):
        sampler.replan(0, steps_done=0)
    assert sampler.max_tokens == 100 and list(sampler) == before


@pytest.mark.parametrize("oversize", ["error", "skip"])
def test_a_lower_budget_refuses_or_leaves_out_no_sample_the_sampler_admitted(oversize: str) -> None:
    lengths = [5, 6, 7, 80, 500] if oversize == "skip" else [5, 6, 7, 80]
    sampler = TokenBudgetBatchSampler(lengths, 100, seed=1, oversize=oversize)
    sampler.replan(50, steps_done=0)  # 80 fitted the budget of 100: it gets a batch of its own
    for epoch in range(2):
        sampler.set_epoch(epoch)  # and so in later epochs, planned under the lowered budget
        batches = list(sampler)
        assert [3] in batches and sorted(i for b in batches for i in b) == [0, 1, 2, 3]
        assert sampler.plan.skipped.tolist() == ([4] if oversize == "skip" else [])


def test_a_guarded_dataloader_reading_the_global_plan_itself_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rank=None on 2 processes: a plain DataLoader would give every rank every batch (issue 11, item 7)."""
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import DataLoader

    sampler = TokenBudgetBatchSampler(long_tailed(100), 512, seed=0, num_replicas=2)
    assert len(list(DataLoader(range(100), batch_sampler=sampler))) == 2 * sampler.plan.num_steps  # 1 process
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it for each of 2 processes
    fallback = OOMFallback(sampler, torch.nn.Linear(2, 2))  # the loop is handed the DataLoader: it refuses
    with pytest.raises(ValueError, match=r"but got rank=None: .* every rank would train every sample"):
        next(iter(fallback.iterate(DataLoader(range(100), batch_sampler=sampler))))
    shares = [DataLoader(range(100), batch_sampler=BatchSamplerShard(sampler, 2, r)) for r in range(2)]
    assert sorted(int(i) for share in shares for batch in share for i in batch) == list(range(100))
    assert len(list(sampler)) == 2 * sampler.plan.num_steps  # the global plan itself, as before


# -- passed as sampler= instead of batch_sampler= (issue 29) ------------------------------------


SAMPLER_NOT_BATCH_SAMPLER = (
    r"batch should be a batch of indices, but it was used as one index.*batch_sampler=sampler"
)


@pytest.mark.parametrize("dataset", ["datasets", "list", "range"])
def test_given_as_sampler_the_dataloader_gets_an_error_that_names_batch_sampler(dataset: str) -> None:
    import datasets

    lengths = [5, 3, 8, 2, 7, 4] * 4
    data: Any = {
        "datasets": datasets.Dataset.from_dict({"x": list(range(len(lengths)))}),
        "list": list(range(len(lengths))),
        "range": range(len(lengths)),
    }[dataset]
    sampler = TokenBudgetBatchSampler(lengths, max_tokens=16, seed=1)
    with pytest.raises(TypeError, match=SAMPLER_NOT_BATCH_SAMPLER):
        next(iter(DataLoader(data, sampler=sampler)))  # datasets' own error: int() ... not 'list'
    with pytest.raises(
        ValueError, match=r"should take the sampler as its batch_sampler, but it got it as sampler="
    ):
        next(iter(OOMFallback(sampler, torch.nn.Linear(2, 2)).iterate(DataLoader(data, sampler=sampler))))
    # As batch_sampler=, the batches are lists like any other, whatever reads them.
    batches = list(DataLoader(data, batch_sampler=sampler, collate_fn=list))
    assert sorted(i if isinstance(i, int) else i["x"] for batch in batches for i in batch) == list(
        range(len(lengths))
    )
    first = next(iter(sampler))
    assert first == list(first) and isinstance(first, list)
    assert torch.arange(30)[first].tolist() == first and np.arange(30)[first].tolist() == first
