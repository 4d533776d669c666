"""Property tests of TokenBudgetStream over lengths, budgets, buffers, 1-8 ranks, 0-3 workers and resumes.

Ranks and DataLoader workers are simulated in one process: one thread per
(rank, worker), the ranks' agreement a barrier (tests/scripts/stream_common.py).
For every case: each example read is yielded exactly once or counted (left out,
skipped); every batch fits the budget (or is one example too large alone);
every rank yields the same number of batches; the batches are a function of
(seed, epoch); and a resume from any step yields exactly the batches left.
The same holds of packs (a packed ``CostModel``: whole examples in one row,
each pack costed as a pack), on 1 and 2 ranks.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenbatch import CostModel, TokenBudgetStream

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))
from stream_common import fake_worker_info, ids, make_examples, run_readers

sys.path.pop(0)

COSTS = [CostModel(), CostModel(quadratic=1 / 64), CostModel(pad_to_multiple_of=8)]
PACKED = [
    CostModel(packing="varlen"),
    CostModel(quadratic=1 / 64, pad_to_multiple_of=8, packing="varlen"),
    CostModel(quadratic=1 / 64, packing="full"),
    CostModel.attention(48, pad_to_multiple_of=8, packing="full"),
]
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def cases(draw: st.DrawFn, packed: bool = False) -> dict[str, Any]:
    lengths = draw(st.lists(st.integers(1, 120), max_size=600))
    world = draw(st.integers(1, 2) if packed else st.integers(1, 8))
    uneven = draw(st.booleans())
    case = {
        "lengths": lengths,
        "world": world,
        # Uneven parts: a datasets.IterableDataset with shards of random sizes, split by shards.
        "shards": draw(st.lists(st.integers(0, 40), min_size=world, max_size=3 * world)) if uneven else None,
        "workers": 0 if uneven else draw(st.integers(0, 3)),
        "buffer_size": draw(st.integers(1, 96)),
        "max_tokens": draw(st.sampled_from([60, 150, 400, 2000])),
        "cost": draw(st.sampled_from(PACKED if packed else COSTS)),
        "oversize": draw(st.sampled_from(["alone", "skip"])),
        "buckets": draw(st.sampled_from([1, 4, 16])),
        "seed": draw(st.integers(0, 3)),
        "epoch": draw(st.integers(0, 2)),
    }
    if uneven:
        shards = case["shards"]
        case["shards"] = shards[
            : len(shards) - len(shards) % world
        ]  # split_dataset_by_node assigns whole shards
        case["lengths"] = [n for size in case["shards"] for n in lengths[:size]] or lengths[:0]
    return case


def source(case: dict[str, Any]) -> Any:
    examples = make_examples(case["lengths"])
    if case["shards"] is None:
        return examples
    import datasets

    pieces, start = [], 0
    for size in case["shards"]:
        pieces.append(examples[start : start + size])
        start += size

    def generate(pieces: list[list[dict[str, int]]]) -> Any:
        for piece in pieces:
            yield from piece

    features = datasets.Features({"i": datasets.Value("int64"), "length": datasets.Value("int64")})
    return datasets.IterableDataset.from_generator(generate, features=features, gen_kwargs={"pieces": pieces})


def maker(case: dict[str, Any], data: Any) -> Any:
    def make(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        stream = TokenBudgetStream(
            data,
            case["max_tokens"],
            cost=case["cost"],
            length="length",
            buffer_size=case["buffer_size"],
            seed=case["seed"],
            num_replicas=case["world"],
            rank=rank,
            oversize=case["oversize"],
            buckets=case["buckets"],
            agree=agree,
        )
        stream.set_epoch(case["epoch"])
        return stream

    return make


def run(case: dict[str, Any], data: Any, **kwargs: Any) -> tuple[list[list[Any]], list[list[Any]]]:
    with mock.patch("tokenbatch.stream._dataset.get_worker_info", fake_worker_info):
        return run_readers(maker(case, data), case["world"], case["workers"], **kwargs)


def check_batches(case: dict[str, Any], batches: list[list[list[Any]]], streams: list[list[Any]]) -> None:
    cost, budget = case["cost"], case["max_tokens"]
    yielded = [e["i"] for rank in batches for lane in rank for batch in lane for e in batch]
    assert len(yielded) == len(set(yielded)), "an example was yielded twice"
    examples = make_examples(case["lengths"])
    for rank in batches:
        for lane in rank:
            for batch in lane:
                assert batch, "an empty batch"
                assert all(e == examples[e["i"]] for e in batch), "an example not as it was read"
                # Padded: rows x the longest; packed: the pack's row and attention, as the cost model says.
                spent = cost.batch_cost([e["length"] for e in batch])
                assert spent <= budget or len(batch) == 1
                if len(batch) == 1 and spent > budget:
                    assert case["oversize"] == "alone"
    # Every rank yields the same number of batches: worker w of each rank as many as the others'.
    for lane in range(len(batches[0])):
        assert len({len(rank[lane]) for rank in batches}) == 1
    # Exactly once of what was read: the rest is counted.
    runs = [stream._run for rank in streams for stream in rank]
    read = sum(r.read for r in runs)
    assert read == len(yielded) + sum(r.skipped + r.left_out for r in runs)
    assert all(r.phase == "done" for r in runs)
    if all(r.exhausted for r in runs):
        assert read == len(case["lengths"])
    if case["oversize"] == "alone":
        assert not any(r.skipped for r in runs)


def exactly_once_within_budget_equal_counts(case: dict[str, Any]) -> None:
    data = source(case)
    batches, streams = run(case, data)
    check_batches(case, batches, streams)
    again, _ = run(case, data)
    assert [[ids(lane) for lane in rank] for rank in batches] == [
        [ids(lane) for lane in rank] for rank in again
    ]


def resume_from_any_step_yields_exactly_the_batches_left(case: dict[str, Any], step: int) -> None:
    data = source(case)
    full, _ = run(case, data)
    first, streams = run(case, data, take=step)
    # Through JSON: a state holds only plain values (as a checkpoint file would).
    states = [[json.loads(json.dumps(stream.state_dict())) for stream in rank] for rank in streams]
    make = maker(case, data)

    def resumed(rank: int, lane: int, agree: Any) -> TokenBudgetStream:
        stream = make(rank, lane, agree)
        stream.load_state_dict(states[rank][lane])
        return stream

    with mock.patch("tokenbatch.stream._dataset.get_worker_info", fake_worker_info):
        rest, _ = run_readers(resumed, case["world"], case["workers"])
    for rank in range(case["world"]):
        for lane in range(len(full[rank])):
            assert ids(first[rank][lane]) + ids(rest[rank][lane]) == ids(full[rank][lane])


@SETTINGS
@given(cases())
def test_exactly_once_within_budget_equal_counts(case: dict[str, Any]) -> None:
    exactly_once_within_budget_equal_counts(case)


@SETTINGS
@given(cases(packed=True))
def test_packs_hold_whole_examples_exactly_once_within_budget_equal_counts(case: dict[str, Any]) -> None:
    exactly_once_within_budget_equal_counts(case)


@SETTINGS
@given(cases(), st.integers(0, 30))
def test_resume_from_any_step_yields_exactly_the_batches_left(case: dict[str, Any], step: int) -> None:
    resume_from_any_step_yields_exactly_the_batches_left(case, step)


@SETTINGS
@given(cases(packed=True), st.integers(0, 30))
def test_packs_resume_from_any_step_with_exactly_the_packs_left(case: dict[str, Any], step: int) -> None:
    resume_from_any_step_yields_exactly_the_batches_left(case, step)
