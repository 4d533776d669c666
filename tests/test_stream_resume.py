"""Resuming a TokenBudgetStream: state_dict, torchdata's StatefulDataLoader, datasets' own state, refusals."""

from __future__ import annotations

import io
import itertools
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
from torchdata.stateful_dataloader import StatefulDataLoader

from tokenbatch import CostModel, TokenBudgetStream
from tokenbatch.stream._source import Snapshots

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from stream_common import ids, long_tailed, make_examples, run_readers

sys.path.pop(0)

EXAMPLES = make_examples(long_tailed(2500, seed=21))
SETTINGS: dict[str, Any] = {"max_tokens": 1024, "length": "length", "buffer_size": 200, "seed": 4}


def ids_of(batch: list[dict[str, int]]) -> list[int]:
    return [e["i"] for e in batch]


def datasets_source(shards: int = 4, counter: list[int] | None = None) -> Any:
    import datasets

    data = datasets.Dataset.from_list(EXAMPLES).to_iterable_dataset(num_shards=shards)
    if counter is not None:

        def count(example: dict[str, int]) -> dict[str, int]:
            counter.append(example["i"])
            return example

        data = data.map(count)
    return data


@pytest.mark.parametrize("source", ["list", "function", "datasets"])
@pytest.mark.parametrize("where", ["start", "early", "middle", "final round", "end"])
def test_resume_yields_exactly_the_batches_left(source: str, where: str) -> None:
    data: Any = {"list": EXAMPLES, "function": lambda: iter(EXAMPLES), "datasets": datasets_source()}[source]
    full = ids(TokenBudgetStream(data, **SETTINGS))
    step = {"start": 0, "early": 1, "middle": len(full) // 2, "final round": len(full) - 2, "end": len(full)}[
        where
    ]
    stream = TokenBudgetStream(data, **SETTINGS)
    first = ids(itertools.islice(iter(stream), step))
    state = stream.state_dict()
    buffer = io.BytesIO()
    torch.save(state, buffer)  # a checkpoint file, loaded the safe way
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = TokenBudgetStream(data, **SETTINGS)
    resumed.load_state_dict(state)
    assert resumed.state_dict() == state  # a saved state survives until the pass starts
    assert first + ids(resumed) == full


@pytest.mark.parametrize("source", ["list", "datasets"])
@pytest.mark.parametrize("where", ["early", "within a round", "after a round", "final round"])
@pytest.mark.parametrize("packing", ["varlen", "full"])
def test_packs_resume_mid_epoch_with_exactly_the_packs_left(source: str, where: str, packing: str) -> None:
    data: Any = {"list": EXAMPLES, "datasets": datasets_source()}[source]
    settings = {**SETTINGS, "cost": CostModel.attention(512, pad_to_multiple_of=8, packing=packing)}
    stream = TokenBudgetStream(data, **settings)
    full, waiting = [], []  # each pack, and how many packs formed wait to be yielded after it
    for pack in stream:
        full.append(ids_of(pack))
        run = stream._run
        assert run is not None
        waiting.append(len(run.formed) if run.phase == "stream" else -1)
    after_round = [step + 1 for step, count in enumerate(waiting) if count == 0]
    within = [step + 1 for step, count in enumerate(waiting) if count > 1]
    step = {"early": 1, "within a round": within[len(within) // 2], "after a round": after_round[1]}.get(
        where, len(full) - 2
    )
    stream = TokenBudgetStream(data, **settings)
    first = ids(itertools.islice(iter(stream), step))
    state = json.loads(json.dumps(stream.state_dict()))  # plain values, as a checkpoint file holds
    resumed = TokenBudgetStream(data, **settings)
    resumed.load_state_dict(state)
    assert first + ids(resumed) == full
    padded = TokenBudgetStream(data, **{**settings, "cost": CostModel.attention(512, pad_to_multiple_of=8)})
    with pytest.raises(ValueError, match="other stream settings"):
        padded.load_state_dict(state)  # a padded stream does not take a packed one's place


def test_a_finished_epoch_resumes_empty_and_the_next_epoch_starts_fresh() -> None:
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    list(stream)
    resumed = TokenBudgetStream(EXAMPLES, **SETTINGS)
    resumed.load_state_dict(stream.state_dict())
    assert list(resumed) == []
    resumed.set_epoch(1)
    reference = TokenBudgetStream(EXAMPLES, **SETTINGS)
    reference.set_epoch(1)
    assert ids(resumed) == ids(reference)


def test_set_epoch_after_load_discards_the_saved_position() -> None:
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    next(iter(stream))
    resumed = TokenBudgetStream(EXAMPLES, **SETTINGS)
    resumed.load_state_dict(stream.state_dict())
    resumed.set_epoch(2)
    reference = TokenBudgetStream(EXAMPLES, **SETTINGS)
    reference.set_epoch(2)
    assert ids(resumed) == ids(reference)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("source", ["list", "datasets"])
@pytest.mark.parametrize("every", [1, 5])
def test_stateful_dataloader_resumes_mid_epoch(workers: int, source: str, every: int) -> None:
    def loader(data: Any) -> StatefulDataLoader:
        stream = TokenBudgetStream(data, **SETTINGS)
        return StatefulDataLoader(
            stream, batch_size=None, collate_fn=ids_of, num_workers=workers, snapshot_every_n_steps=every
        )

    data = EXAMPLES if source == "list" else datasets_source()
    full = list(loader(data))
    first_loader = loader(data)
    batches = iter(first_loader)
    first = list(itertools.islice(batches, 37))
    state = json.loads(json.dumps(first_loader.state_dict()))
    del batches
    second = loader(data)
    second.load_state_dict(state)
    assert first + list(second) == full


def test_datasets_resume_rereads_from_its_own_state_not_from_the_start() -> None:
    reads: list[int] = []
    stream = TokenBudgetStream(datasets_source(counter=reads), **SETTINGS)
    batches = iter(stream)
    first = ids(itertools.islice(batches, 140))
    state = stream.state_dict()
    read = state["run"]["read"]
    assert state["run"]["source_position"] > 0
    reads.clear()
    resumed = TokenBudgetStream(datasets_source(counter=reads), **SETTINGS)
    resumed.load_state_dict(state)
    rest = ids(resumed)
    full = ids(TokenBudgetStream(datasets_source(), **SETTINGS))
    assert first + rest == full
    rereads = len(reads) - (len(EXAMPLES) - read)
    # From the newest datasets state at or before the oldest example still buffered.
    assert 0 <= rereads <= read - state["run"]["source_position"] < read // 2


def test_a_datasets_stream_keeps_few_snapshots_through_an_epoch_never_checkpointed() -> None:
    # Snapshots were pruned only by state_dict(): an epoch never checkpointed kept one per read, here
    # one per refill of a 64-example buffer (about 400 by the end, growing with the epoch).
    examples = make_examples(long_tailed(5000, seed=5))
    settings = {**SETTINGS, "buffer_size": 64}

    def source() -> Any:
        import datasets

        return datasets.Dataset.from_list(examples).to_iterable_dataset(num_shards=4)

    stream = TokenBudgetStream(source(), **settings)
    full, held = [], []
    for batch in stream:
        full.append(ids_of(batch))
        assert stream._run is not None
        held.append(len(stream._run.snapshots))
    assert len(full) > 300 and max(held) <= Snapshots().limit
    for step in (len(full) // 2, len(full) - 3):  # late in the epoch, and in its final round
        first = TokenBudgetStream(source(), **settings)
        done = ids(itertools.islice(iter(first), step))
        resumed = TokenBudgetStream(source(), **settings)
        resumed.load_state_dict(first.state_dict())
        assert done + ids(resumed) == full


def test_snapshots_stay_few_behind_an_example_that_lingers_and_still_cover_it() -> None:
    # The oldest example held stays at position 5 while 2000 more reads come: pruning alone keeps them all.
    snapshots = Snapshots()
    for position in range(10, 20_010, 10):
        snapshots.add(position, {"at": position}, oldest=5)
        assert len(snapshots) <= snapshots.limit
    assert snapshots.before(5) == (0, None)  # nothing at or before 5: from the start of the part
    for oldest in (15, 9_999, 19_995, 20_000):  # then the lingering example leaves
        position, state = snapshots.before(oldest)
        assert position <= oldest and state == {"at": position}
    assert snapshots.before(20_005) == (20_000, {"at": 20_000})  # the newest is always kept


def test_a_sequence_resumes_by_index_without_reading_again() -> None:
    class Counting(list[dict[str, int]]):
        gets = 0

        def __getitem__(self, index: Any) -> Any:
            Counting.gets += 1
            return super().__getitem__(index)

    data = Counting(EXAMPLES)
    stream = TokenBudgetStream(data, **SETTINGS)
    next(iter(stream))
    state = stream.state_dict()
    Counting.gets = 0
    resumed = TokenBudgetStream(data, **SETTINGS)
    resumed.load_state_dict(state)
    next(iter(resumed))
    assert Counting.gets <= SETTINGS["buffer_size"] + 100  # the buffered ones, then the next few


def test_state_of_other_settings_is_refused() -> None:
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    next(iter(stream))
    state = stream.state_dict()
    other = TokenBudgetStream(EXAMPLES, **{**SETTINGS, "max_tokens": 2048})
    with pytest.raises(ValueError, match=r"other stream settings \(max_tokens: saved 1024.0, now 2048.0\)"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"unknown keys \['extra'\]"):
        other.load_state_dict({**state, "extra": 1})
    with pytest.raises(ValueError, match=r"version=0"):
        TokenBudgetStream(EXAMPLES, **SETTINGS).load_state_dict({**state, "version": 0})
    with pytest.raises(TypeError, match=r"state should be a dict"):
        other.load_state_dict([1])  # type: ignore[arg-type]


def test_state_of_another_rank_is_refused_on_load() -> None:
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    next(iter(stream))
    elsewhere = TokenBudgetStream(EXAMPLES, **SETTINGS, num_replicas=2, rank=1, agree=lambda v: v)
    with pytest.raises(
        ValueError, match=r"saved by rank 0 of 1, but this stream is rank 1 of 2: each rank resumes"
    ):
        elsewhere.load_state_dict(stream.state_dict())


def test_state_of_another_dataloader_worker_is_refused() -> None:
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    with mock.patch(
        "tokenbatch.stream._dataset.get_worker_info", lambda: SimpleNamespace(id=1, num_workers=2)
    ):
        next(iter(stream))
    state = stream.state_dict()
    assert state["reader"] == {"rank": 0, "num_replicas": 1, "worker": 1, "num_workers": 2}
    resumed = TokenBudgetStream(EXAMPLES, **SETTINGS)
    resumed.load_state_dict(state)
    with pytest.raises(
        ValueError, match=r"DataLoader worker 1 of 2, but this reader is rank 0 of 1, worker 0 of 1"
    ):
        list(resumed)


def test_simulated_ranks_resume_through_a_final_round_that_splits_batches() -> None:
    # Three ranks whose final round splits batches: the split must not depend on which
    # slots the buffer gave the examples (they differ after a resume).
    lengths = long_tailed(2999, seed=0, median=40, top=300)
    data = make_examples(lengths)
    settings = {**SETTINGS, "buffer_size": 128, "cost": CostModel(quadratic=1 / 512), "seed": 5}

    def make(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        return TokenBudgetStream(data, **settings, num_replicas=3, rank=rank, agree=agree)

    full, _ = run_readers(make, 3)
    for step in (1, 5, 40):
        first, streams = run_readers(make, 3, take=step)
        states = [json.loads(json.dumps(rank[0].state_dict())) for rank in streams]

        def resumed(rank: int, lane: int, agree: Any, states: list[Any] = states) -> TokenBudgetStream:
            stream = make(rank, lane, agree)
            stream.load_state_dict(states[rank])
            return stream

        rest, _ = run_readers(resumed, 3)
        for rank in range(3):
            assert ids(first[rank][0]) + ids(rest[rank][0]) == ids(full[rank][0])


def test_a_source_that_changed_is_refused() -> None:
    stream = TokenBudgetStream(lambda: iter(EXAMPLES), **SETTINGS)
    batches = iter(stream)
    for _ in range(30):
        next(batches)
    state = stream.state_dict()
    shorter = TokenBudgetStream(lambda: iter(EXAMPLES[:100]), **SETTINGS)
    shorter.load_state_dict(state)
    with pytest.raises(ValueError, match=r"cannot resume: rank 0's part \(worker 0\) ended at position 100"):
        list(shorter)


def test_a_shorter_list_is_refused() -> None:
    # A list resumes by index: one shorter than the saved state gave an IndexError.
    stream = TokenBudgetStream(EXAMPLES, **SETTINGS)
    batches = iter(stream)
    for _ in range(30):
        next(batches)
    state = stream.state_dict()
    shorter = TokenBudgetStream(EXAMPLES[:100], **SETTINGS)
    shorter.load_state_dict(state)
    with pytest.raises(
        ValueError,
        match=r"cannot resume: rank 0's part \(worker 0\) ended at position 100, but the state says "
        rf"{state['run']['read']} examples were read; resume with the same examples in the same order",
    ):
        list(shorter)


def test_a_packed_final_round_resumes_from_a_snapshot_not_from_the_start() -> None:
    # Rank 0's part is shorter: the final round starts while rank 1 still reads and a round of its
    # packs, formed from older examples, waits; the source snapshots it keeps must still reach them.
    import datasets

    data = make_examples(long_tailed(5000, seed=3))
    sizes = [1000, 1500, 1000, 1500]  # split_dataset_by_node gives rank r the shards r and r + 2
    starts = np.cumsum([0, *sizes]).tolist()
    pieces = [data[a:b] for a, b in itertools.pairwise(starts)]

    def generate(pieces: list[list[dict[str, int]]]) -> Any:
        for piece in pieces:
            yield from piece

    source = datasets.IterableDataset.from_generator(generate, gen_kwargs={"pieces": pieces})
    settings = {**SETTINGS, "buffer_size": 128, "cost": CostModel(packing="varlen")}

    def make(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        return TokenBudgetStream(source, **settings, num_replicas=2, rank=rank, agree=agree)

    full, _ = run_readers(make, 2)
    for step in range(len(full[1][0]) - 16, len(full[1][0])):
        first, streams = run_readers(make, 2, take=step)
        states = [json.loads(json.dumps(rank[0].state_dict())) for rank in streams]
        run = states[1]["run"]
        oldest = min(p for batch in [run["pending"], *run["final"]] for p in batch)
        # A resume re-reads from a snapshot less than a buffer before the oldest example held.
        assert oldest - settings["buffer_size"] < run["source_position"] <= oldest
        if run["phase"] == "final":
            break
    assert run["phase"] == "final" and not run["exhausted"]

    def resumed(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        stream = make(rank, lane, agree)
        stream.load_state_dict(states[rank])
        return stream

    rest, _ = run_readers(resumed, 2)
    for rank in range(2):
        assert ids(first[rank][0]) + ids(rest[rank][0]) == ids(full[rank][0])
