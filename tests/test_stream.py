"""Example tests of TokenBudgetStream: sources, lengths, budget, oversize, epochs, workers, refusals."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset

from tokenbatch import CostModel, OversizeSampleError, TokenBudgetBatchSampler, TokenBudgetStream
from tokenbatch.plan import lower_bound_steps

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from stream_common import batch_cost, ids, long_tailed, make_examples

sys.path.pop(0)

QUADRATIC = CostModel(quadratic=1 / 256)


def every_index_once(batches: list[list[int]], n: int) -> bool:
    return sorted(i for batch in batches for i in batch) == list(range(n))


class Counter(IterableDataset[dict[str, int]]):
    """A torch IterableDataset that knows nothing of workers or ranks."""

    def __init__(self, lengths: np.ndarray) -> None:
        self.lengths = lengths

    def __iter__(self) -> Iterator[dict[str, int]]:
        for i, n in enumerate(self.lengths.tolist()):
            yield {"i": i, "length": n}


def test_batches_fit_the_budget_and_hold_every_example_once() -> None:
    lengths = long_tailed(4000, seed=1)
    examples = make_examples(lengths)
    stream = TokenBudgetStream(examples, 2048, cost=QUADRATIC, length="length", buffer_size=500, seed=2)
    batches = list(stream)
    assert every_index_once(ids(batches), len(lengths))
    costs = [batch_cost(b, QUADRATIC) for b in batches]
    assert max(costs) <= 2048
    assert np.mean(costs) / 2048 > 0.9  # batches are full, not merely within budget
    assert len(batches) / lower_bound_steps(lengths, QUADRATIC, 2048) < 1.2
    # With half the data in the buffer, as few steps as the map-style sampler, which sees it all.
    wide = TokenBudgetStream(examples, 2048, cost=QUADRATIC, length="length", buffer_size=2000, seed=2)
    assert len(list(wide)) <= 1.02 * len(TokenBudgetBatchSampler(lengths, 2048, cost=QUADRATIC))


@pytest.mark.parametrize(
    "source",
    ["list", "function", "torch", "datasets", "datasets_map_style"],
)
def test_every_kind_of_source(source: str) -> None:
    import datasets

    lengths = long_tailed(1500, seed=3)
    examples = make_examples(lengths)
    data: Any = {
        "list": examples,
        "function": lambda: iter(examples),
        "torch": Counter(lengths),
        "datasets": datasets.Dataset.from_list(examples).to_iterable_dataset(num_shards=3),
        "datasets_map_style": datasets.Dataset.from_list(examples),
    }[source]
    batches = list(TokenBudgetStream(data, 1024, length="length", buffer_size=200))
    assert every_index_once(ids(batches), len(lengths))
    assert max(batch_cost(b, CostModel()) for b in batches) <= 1024


def test_length_from_token_ids_an_integer_column_or_a_function() -> None:
    lengths = long_tailed(600, seed=4)
    with_ids = [{"i": i, "input_ids": list(range(n))} for i, n in enumerate(lengths.tolist())]
    by_ids = ids(TokenBudgetStream(with_ids, 1024, buffer_size=100))
    by_column = ids(TokenBudgetStream(make_examples(lengths), 1024, length="length", buffer_size=100))
    by_function = ids(
        TokenBudgetStream(with_ids, 1024, length=lambda e: len(e["input_ids"]), buffer_size=100)
    )
    assert by_ids == by_column == by_function
    plain = TokenBudgetStream(lengths.tolist(), 1024, length=int, buffer_size=100)
    assert sorted(n for batch in plain for n in batch) == sorted(lengths.tolist())


def test_pad_to_multiple_of_is_costed_as_the_collator_pads() -> None:
    cost = CostModel(pad_to_multiple_of=64)
    batches = list(TokenBudgetStream(make_examples([1] * 100), 640, cost=cost, length="length"))
    assert [len(b) for b in batches] == [10] * 10  # each example pads to 64 tokens


def test_deterministic_per_seed_and_epoch_and_shuffled_between_epochs() -> None:
    examples = make_examples(long_tailed(2000, seed=5))

    def epoch_batches(seed: int, epoch: int) -> list[list[int]]:
        stream = TokenBudgetStream(examples, 1024, length="length", buffer_size=300, seed=seed)
        stream.set_epoch(epoch)
        return ids(stream)

    assert epoch_batches(0, 0) == epoch_batches(0, 0)
    assert epoch_batches(0, 1) != epoch_batches(0, 0)
    assert epoch_batches(1, 0) != epoch_batches(0, 0)
    stream = TokenBudgetStream(examples, 1024, length="length", buffer_size=300)
    assert ids(stream) == ids(stream)  # iterating again repeats the epoch
    stream.set_epoch(1)
    assert ids(stream) == epoch_batches(0, 1)


def test_ties_shuffle_so_equal_lengths_meet_other_batch_mates() -> None:
    examples = make_examples([10] * 1000)
    first, second = (
        ids(TokenBudgetStream(examples, 100, length="length", buffer_size=1000, seed=s)) for s in (0, 1)
    )
    assert {frozenset(b) for b in first} != {frozenset(b) for b in second}


def test_padding_close_to_the_map_style_sampler_with_a_large_buffer() -> None:
    lengths = long_tailed(20000, seed=6, median=60, top=512)
    budget = 8192.0

    def efficiency(batches: list[np.ndarray]) -> float:
        return float(sum(b.sum() for b in batches) / sum(len(b) * b.max() for b in batches))

    def streamed(buffer_size: int) -> float:
        stream = TokenBudgetStream(lengths.tolist(), budget, length=int, buffer_size=buffer_size)
        return efficiency([np.array(b) for b in stream])

    planned = efficiency([lengths[b] for b in TokenBudgetBatchSampler(lengths, budget)])
    # Padding falls as the buffer grows (its share of the data is what matters), to the
    # map-style figure when the buffer holds everything.
    figures = [streamed(size) for size in (1000, 5000, 20000)]
    assert figures == sorted(figures)
    assert figures[1] > planned - 0.025
    assert figures[2] > planned - 0.002


def test_buckets_given_or_estimated() -> None:
    examples = make_examples(long_tailed(1000, seed=7))
    given = TokenBudgetStream(examples, 1024, length="length", buffer_size=200, buckets=[20, 40, 80])
    assert every_index_once(ids(given), 1000)
    state = given.state_dict()
    assert state["run"]["boundaries"] == [20, 40, 80]
    one = TokenBudgetStream(examples, 1024, length="length", buffer_size=200, buckets=1)
    assert every_index_once(ids(one), 1000)
    estimated = TokenBudgetStream(examples, 1024, length="length", buffer_size=200, buckets=4)
    list(estimated)
    assert 1 <= len(estimated.state_dict()["run"]["boundaries"]) <= 3


def test_oversize_error_names_the_example_and_the_fix() -> None:
    examples = make_examples([5, 5, 500, 5])
    with pytest.raises(OversizeSampleError, match=r"position 2 .*padded length 500.*oversize='alone'"):
        list(TokenBudgetStream(examples, 100, length="length"))


def test_oversize_skip_counts_and_logs(caplog: pytest.LogCaptureFixture) -> None:
    examples = make_examples([5, 500, 5, 600, 5])
    with caplog.at_level(logging.WARNING, logger="tokenbatch.stream"):
        batches = ids(TokenBudgetStream(examples, 100, length="length", oversize="skip"))
    assert sorted(i for b in batches for i in b) == [0, 2, 4]
    assert "left out 2 example(s)" in caplog.text


def test_oversize_alone_gets_a_batch_of_one() -> None:
    examples = make_examples([5, 500, 5, 600, 5] * 20)
    batches = ids(TokenBudgetStream(examples, 100, length="length", oversize="alone", buffer_size=7))
    assert every_index_once(batches, 100)
    long = {i for i, e in enumerate(examples) if e["length"] > 100}
    assert all(len(b) == 1 for b in batches if long & set(b))


def test_empty_and_tiny_sources() -> None:
    assert list(TokenBudgetStream([], 100)) == []
    assert ids(TokenBudgetStream(make_examples([3]), 100, length="length", buffer_size=1)) == [[0]]


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("workers", [1, 2, 3])
def test_dataloader_workers_read_disjoint_parts(workers: int) -> None:
    examples = make_examples(long_tailed(3001, seed=8))
    stream = TokenBudgetStream(examples, 1024, length="length", buffer_size=200)
    loader = DataLoader(
        stream, batch_size=None, collate_fn=lambda b: [e["i"] for e in b], num_workers=workers
    )
    for epoch in range(2):
        stream.set_epoch(epoch)
        assert every_index_once(list(loader), 3001)


def test_collate_fn_gets_a_list_of_examples() -> None:
    examples = [{"input_ids": list(range(n))} for n in long_tailed(300, seed=9).tolist()]

    def collate(batch: list[dict[str, list[int]]]) -> torch.Tensor:
        longest = max(len(e["input_ids"]) for e in batch)
        return torch.tensor([e["input_ids"] + [0] * (longest - len(e["input_ids"])) for e in batch])

    loader = DataLoader(TokenBudgetStream(examples, 512, buffer_size=64), batch_size=None, collate_fn=collate)
    shapes = [tuple(t.shape) for t in loader]
    assert sum(s[0] for s in shapes) == 300
    assert max(s[0] * s[1] for s in shapes) <= 512


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (
            {"max_tokens": 0},
            ValueError,
            r"max_tokens should be a positive finite number, but got max_tokens=0",
        ),
        ({"buffer_size": 0}, ValueError, r"buffer_size should be an integer >= 1, but got buffer_size=0"),
        ({"seed": -1}, ValueError, r"seed should be an integer >= 0, but got seed=-1"),
        ({"oversize": "drop"}, ValueError, r"oversize should be one of 'error', 'skip', 'alone', but got"),
        ({"rank": 2, "num_replicas": 2}, ValueError, r"rank should be below num_replicas=2, but got rank=2"),
        ({"length": 3}, TypeError, r"length should be a column name or a function of the example"),
        ({"cost": "tokens"}, TypeError, r"cost should be a tokenbatch.CostModel, but got cost='tokens'"),
        ({"buckets": [10, 5]}, ValueError, r"buckets should be increasing padded lengths >= 1"),
        ({"buckets": 0}, ValueError, r"buckets should be an integer >= 1, but got buckets=0"),
        ({"agree": 1}, TypeError, r"agree should be a function of a list of floats, but got agree=1"),
    ],
)
def test_bad_arguments_say_what_to_pass(kwargs: dict[str, Any], error: type, match: str) -> None:
    settings: dict[str, Any] = {"max_tokens": 100, **kwargs}
    with pytest.raises(error, match=match):
        TokenBudgetStream([{"input_ids": [1]}], **settings)


@pytest.mark.parametrize(
    ("examples", "match"),
    [
        (iter([{"input_ids": [1]}]), r"examples should be re-iterable .* one-shot iterator"),
        ("text", r"examples should be an iterable of examples .* got examples of type str"),
        ({"input_ids": [1]}, r"examples should be an iterable of examples .* got examples of type dict"),
        (3, r"examples should be an iterable of examples or a function"),
    ],
)
def test_sources_that_cannot_be_read_again_are_refused(examples: Any, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        TokenBudgetStream(examples, 100)


def test_a_generator_is_refused_and_a_function_returning_one_is_read_every_epoch() -> None:
    # What README and docs/streaming.md promise: a generator is refused with the fix, a function works.
    def rows() -> Iterator[dict[str, Any]]:
        yield from ({"i": i, "input_ids": [0] * (1 + i % 7)} for i in range(50))

    with pytest.raises(TypeError, match=r"one-shot iterator of type generator; pass .* a function that"):
        TokenBudgetStream(rows(), 16)
    stream = TokenBudgetStream(rows, 16, buffer_size=8)
    for epoch in range(2):
        stream.set_epoch(epoch)
        assert every_index_once([[e["i"] for e in b] for b in stream], 50)


@pytest.mark.parametrize("returned", [42, None, {"input_ids": [1]}])
def test_a_function_that_returns_no_iterator_is_named(returned: Any) -> None:
    stream = TokenBudgetStream(lambda: returned, 256)
    with pytest.raises(
        TypeError,
        match=r"examples should be a function that returns a new iterator of examples each call, but "
        r"examples\(\) returned .* of type \w+; return an iterator, e.g. lambda: iter\(rows\)",
    ):
        list(stream)


@pytest.mark.parametrize(
    ("examples", "error", "match"),
    [
        (
            [{"input_ids": [1]}, {"text": "x"}],
            KeyError,
            r"length='input_ids' should name a column .* position 1",
        ),
        ([{"input_ids": 2}, {"input_ids": 0}], ValueError, r"padded length >= 1 .* position 1 .* length 0"),
        ([{"input_ids": 2.5}], TypeError, r"column of token ids \(anything with a len\(\)\) or of lengths"),
        (  # a length column that turns into token ids (numpy: "setting an array element with a sequence")
            [{"input_ids": 3}, {"input_ids": [1, 2]}],
            TypeError,
            r"length='input_ids' should name a column of token ids or of integer lengths, not both, but "
            r"the example at position 0 .* input_ids=3 and the example at position 1 .* input_ids=\[1, 2\]",
        ),
        (
            [{"input_ids": [1, 2]}, {"input_ids": 3}],
            TypeError,
            r"not both, but the example at position 0 .* input_ids=\[1, 2\] and the example at position 1",
        ),
    ],
)
def test_bad_lengths_name_the_example(examples: list[Any], error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        list(TokenBudgetStream(examples, 100))


def test_several_ranks_in_dataloader_workers_are_refused() -> None:
    stream = TokenBudgetStream(make_examples([3] * 10), 100, length="length", num_replicas=2, rank=0)
    loader = DataLoader(stream, batch_size=None, num_workers=1)
    with pytest.raises(RuntimeError, match=r"DataLoader worker 0 of 1.*num_workers=0"):
        list(loader)


def test_several_ranks_without_a_process_group_are_refused() -> None:
    stream = TokenBudgetStream(make_examples([3] * 10), 100, length="length", num_replicas=2, rank=1)
    with pytest.raises(RuntimeError, match=r"no torch.distributed process group is initialised"):
        list(stream)


def test_accelerate_dispatching_from_process_zero_is_refused() -> None:
    from accelerate import PartialState
    from accelerate.data_loader import DataLoaderDispatcher

    PartialState(cpu=True)
    stream = TokenBudgetStream(make_examples([3] * 10), 100, length="length", num_replicas=2, rank=0)
    dispatcher = DataLoaderDispatcher(stream, batch_size=None, collate_fn=lambda b: torch.zeros(len(b)))
    with pytest.raises(RuntimeError, match=r"DataLoaderDispatcher, which reads on process 0 only"):
        list(dispatcher)


def test_accelerate_iterable_dataset_shard_is_refused() -> None:
    from accelerate import PartialState
    from accelerate.data_loader import prepare_data_loader

    PartialState(cpu=True)
    stream = TokenBudgetStream(make_examples([3] * 10), 100, length="length", num_replicas=2, rank=0)
    # What prepare builds on process 0 of 2 with dispatch_batches=False: a DataLoaderShard over an
    # IterableDatasetShard of the stream.
    loader = DataLoader(stream, batch_size=1, collate_fn=lambda b: b)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=0, dispatch_batches=False)
    with pytest.raises(
        RuntimeError, match=r"IterableDatasetShard, which reads the whole stream on every process"
    ):
        list(prepared)


def test_a_plain_dataloader_inside_an_accelerate_one_is_not_taken_for_it() -> None:
    """Only accelerate's loader of this stream is refused, not another one being iterated around it.

    The stream goes on to its own checks: here, that no process group is initialised.
    """
    from accelerate import PartialState
    from accelerate.data_loader import DataLoaderDispatcher

    PartialState(cpu=True)
    stream = TokenBudgetStream(make_examples([3] * 10), 100, length="length", num_replicas=2, rank=0)
    outer = DataLoaderDispatcher(torch.arange(2.0), batch_size=1)
    for _ in outer:
        with pytest.raises(RuntimeError, match=r"no torch.distributed process group is initialised"):
            list(DataLoader(stream, batch_size=None))


class _Witness(IterableDataset[torch.Tensor]):
    """Records what accelerate's GradientState says while this dataset's pass runs."""

    def __init__(self) -> None:
        self.seen: list[Any] = []

    def __iter__(self) -> Iterator[torch.Tensor]:
        from accelerate.state import GradientState

        self.seen.append(GradientState().active_dataloader)
        yield torch.zeros(2)


def test_accelerate_still_exposes_what_the_stream_refusal_reads() -> None:
    """The stream refuses accelerate's loaders by public attributes only; this fails if they change.

    ``GradientState().active_dataloader`` is set by ``begin()`` before the DataLoader
    underneath iterates the dataset; the loader's ``.dataset`` is the dataset given to it
    (``DataLoaderDispatcher``) or an ``IterableDatasetShard`` whose ``.dataset`` it is.
    """
    from accelerate import PartialState
    from accelerate.data_loader import (
        DataLoaderDispatcher,
        DataLoaderShard,
        IterableDatasetShard,
        prepare_data_loader,
    )

    PartialState(cpu=True)
    witness = _Witness()
    dispatcher = DataLoaderDispatcher(witness, batch_size=None)
    list(dispatcher)
    assert len(witness.seen) == 1
    assert witness.seen[0] is dispatcher, "GradientState().active_dataloader is not the dispatcher"
    assert isinstance(dispatcher, DataLoaderDispatcher)
    assert dispatcher.dataset is witness

    witness = _Witness()
    loader = DataLoader(witness, batch_size=1)
    prepared = prepare_data_loader(loader, num_processes=2, process_index=0, dispatch_batches=False)
    list(prepared)
    assert isinstance(prepared, DataLoaderShard)
    assert len(witness.seen) == 1
    assert witness.seen[0] is prepared, "GradientState().active_dataloader is not the DataLoaderShard"
    assert isinstance(prepared.dataset, IterableDatasetShard)
    assert prepared.dataset.dataset is witness


def test_accelerate_prepare_on_one_process_yields_the_stream() -> None:
    from accelerate import Accelerator

    examples = make_examples(long_tailed(500, seed=11))
    stream = TokenBudgetStream(examples, 1024, length="length", buffer_size=100)
    loader = DataLoader(stream, batch_size=None, collate_fn=lambda b: torch.tensor([e["i"] for e in b]))
    prepared = Accelerator(cpu=True).prepare(loader)
    assert [b.tolist() for b in prepared] == ids(
        TokenBudgetStream(examples, 1024, length="length", buffer_size=100)
    )


@pytest.mark.filterwarnings("ignore:This DataLoader will create")
def test_persistent_workers_see_set_epoch() -> None:
    examples = make_examples(long_tailed(800, seed=10))
    stream = TokenBudgetStream(examples, 1024, length="length", buffer_size=100)
    collate = ids_of
    loader = DataLoader(stream, batch_size=None, collate_fn=collate, num_workers=1, persistent_workers=True)
    seen = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        seen.append(list(loader))
    reference = TokenBudgetStream(examples, 1024, length="length", buffer_size=100)
    reference.set_epoch(1)
    assert seen[1] == [ids_of(b) for b in reference]
    assert seen[0] != seen[1]


def ids_of(batch: list[dict[str, int]]) -> list[int]:
    return [e["i"] for e in batch]


def test_the_guard_refuses_a_dataloader_that_batches_the_streams_batches_again() -> None:
    """DataLoader(stream) without batch_size=None: each batch in a list of its own (issue 30)."""
    from tokenbatch import OOMFallback

    stream = TokenBudgetStream(make_examples([5, 3, 8, 2, 7, 4] * 4), 16, length="length", buffer_size=8)
    fallback = OOMFallback(stream, torch.nn.Linear(2, 2))
    message = r"batch_size should be None in the DataLoader over a TokenBudgetStream, but got batch_size=1"
    with pytest.raises(ValueError, match=message):
        next(iter(fallback.iterate(DataLoader(stream, collate_fn=list))))
    assert next(iter(fallback.iterate(DataLoader(stream, batch_size=None, collate_fn=list))))


@pytest.mark.parametrize(
    ("median", "top", "budget"),
    [(20, 87, 2048), (230, 3127, 8192)],  # emotion-like tweets; IMDB-like reviews, 15% over 512
)
def test_packs_fill_the_budget_from_a_large_buffer(median: int, top: int, budget: int) -> None:
    lengths = long_tailed(40_000, seed=8, median=median, top=top)
    cost = CostModel(packing="varlen")  # a pack costs its tokens
    stream = TokenBudgetStream(
        make_examples(lengths), budget, cost=cost, length="length", buffer_size=10_000, seed=3
    )
    packs = list(stream)
    assert every_index_once(ids(packs), len(lengths))
    tokens = np.array([sum(e["length"] for e in pack) for pack in packs])
    assert tokens.max() <= budget
    assert tokens.mean() / budget >= 0.97
    # A quarter of the data at a time packs about as tightly as the map-style sampler, which sees it all.
    assert len(packs) <= 1.01 * len(TokenBudgetBatchSampler(lengths, budget, cost=cost))


@pytest.mark.parametrize("budget", [2641.0, 4099.5, 16384.0])
def test_whole_row_packs_never_exceed_the_budget(budget: float) -> None:
    # Scores over the whole row: a pack of n examples costs (its row)**2 where padded rows would cost
    # n * longest**2, so a pack planned as padded rows could cost several times the budget.
    lengths = long_tailed(6000, seed=9, median=60, top=700)
    cost = CostModel.attention(256, pad_to_multiple_of=8, packing="full")
    assert cost.batch_cost([700]) <= budget  # the longest fits alone, just, at the smallest budget
    stream = TokenBudgetStream(lengths.tolist(), budget, cost=cost, length=int, buffer_size=1000, seed=1)
    packs = list(stream)
    assert sorted(n for pack in packs for n in pack) == sorted(lengths.tolist())
    costs = np.array([cost.batch_cost(pack) for pack in packs])
    assert costs.max() <= budget
    assert max(len(pack) for pack in packs) > 1 and costs.mean() / budget > 0.9


def test_packs_come_in_rounds_of_one_buffer() -> None:
    lengths = long_tailed(3000, seed=2)
    stream = TokenBudgetStream(
        make_examples(lengths), 1024, cost=CostModel(packing="varlen"), length="length", buffer_size=400
    )
    held = []
    for _ in stream:
        run = stream._run
        assert run is not None
        held.append(len(run.buffer) + sum(len(slots) for slots in run.formed))
        if run.phase == "stream":  # packs formed, and the examples they wait with, are one buffer
            assert held[-1] <= 400
    assert run.read == len(lengths) and run.phase == "done"
