"""Launched on 2 or 3 processes (gloo) by tests/test_stream_distributed.py; writes what each rank saw.

Usage: torchrun --standalone --nproc_per_node N stream_distributed.py OUT_DIR

Every scenario builds the stream with the defaults (world size and rank from
the process group) and runs an all-reduce per batch, as a DDP backward would,
so the stream's own agreement interleaves with the training's collectives.
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from tokenbatch import CostModel, TokenBudgetStream

N = 2999  # not a multiple of 2 or 3: the parts differ by one example
SETTINGS: dict[str, Any] = {
    "max_tokens": 1024,
    "cost": CostModel(quadratic=1 / 512),
    "length": "length",
    "buffer_size": 128,
    "seed": 5,
}

PACKED = CostModel.attention(512, packing="full")  # packs: scores over the whole row


def lengths(n: int, seed: int) -> list[int]:
    values = np.random.default_rng(seed).lognormal(np.log(40), 0.9, n)
    return np.clip(np.round(values), 2, 300).astype(int).tolist()


def examples(n: int = N, seed: int = 0) -> list[dict[str, int]]:
    return [{"i": i, "length": n} for i, n in enumerate(lengths(n, seed))]


def uneven_shards(world: int) -> Any:
    """A datasets.IterableDataset of 2 shards per rank whose sizes differ a lot between ranks."""
    import datasets

    data = examples(3000, seed=1)
    sizes = [100 + 250 * s for s in range(2 * world)]  # split_dataset_by_node gives rank r shards r, r+W
    pieces, start = [], 0
    for size in sizes:
        pieces.append(data[start : start + size])
        start += size

    def generate(pieces: list[list[dict[str, int]]]) -> Any:
        for piece in pieces:
            yield from piece

    return datasets.IterableDataset.from_generator(generate, gen_kwargs={"pieces": pieces}), start


def train(loader: Any, limit: int | None = None) -> list[list[int]]:
    """The batches' indices, with a gradient-like all-reduce after each."""
    seen = []
    for batch in itertools.islice(loader, limit):
        seen.append([e["i"] for e in batch])
        dist.all_reduce(torch.ones(3))
    return seen


def with_accelerate(out: Path) -> dict[str, Any]:
    """The documented accelerate way: the stream's DataLoader stays out of prepare; a state file per rank."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    model, optimizer = accelerator.prepare(model, optimizer)

    def loop(stream: TokenBudgetStream, limit: int | None = None) -> list[list[int]]:
        loader = DataLoader(stream, batch_size=None, collate_fn=lambda batch: batch)
        seen = []
        for batch in itertools.islice(loader, limit):
            x = torch.tensor([[float(e["length"])] for e in batch], device=accelerator.device)
            accelerator.backward(model(x).mean())  # DDP's gradient all-reduce
            optimizer.step()
            optimizer.zero_grad()
            seen.append([e["i"] for e in batch])
        return seen

    stream = TokenBudgetStream(examples(), **SETTINGS)
    first = loop(stream, limit=5)
    checkpoint = out / "checkpoint"
    accelerator.save_state(str(checkpoint))
    own = checkpoint / f"stream_rank{accelerator.process_index}.pt"
    torch.save(stream.state_dict(), own)  # each rank its own position
    accelerator.wait_for_everyone()  # rank 0 has written the shared files
    resumed = TokenBudgetStream(examples(), **SETTINGS)
    accelerator.load_state(str(checkpoint))
    resumed.load_state_dict(torch.load(own, weights_only=True))
    result: dict[str, Any] = {"batches": first + loop(resumed)}
    result["full"] = loop(TokenBudgetStream(examples(), **SETTINGS))

    # Registered with accelerate, every rank would load the main process's state: refused on load.
    registered = TokenBudgetStream(examples(), **SETTINGS)
    accelerator.register_for_checkpointing(registered)
    loop(registered, limit=3)
    accelerator.save_state(str(out / "registered"))
    accelerator.wait_for_everyone()
    try:
        accelerator.load_state(str(out / "registered"))
        result["registered_error"] = None
    except ValueError as error:
        result["registered_error"] = str(error)
    return result


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"rank": rank, "world": world}

    stream = TokenBudgetStream(examples(), **SETTINGS)
    loader = DataLoader(stream, batch_size=None, collate_fn=lambda batch: batch)
    report["epochs"] = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        report["epochs"].append(train(loader))

    shards, total = uneven_shards(world)
    stream = TokenBudgetStream(shards, **SETTINGS)
    report["uneven"] = train(stream)
    run = stream._run
    assert run is not None
    report["uneven_counts"] = {"read": run.read, "left_out": run.left_out, "exhausted": run.exhausted}
    report["uneven_total"] = total

    stream = TokenBudgetStream(examples(), **SETTINGS)
    first = train(stream, limit=7)
    state = json.loads(json.dumps(stream.state_dict()))
    resumed = TokenBudgetStream(examples(), **SETTINGS)
    resumed.load_state_dict(state)
    report["resumed"] = first + train(resumed)

    # Packs (a whole-row packed cost): one epoch, and a resume after 7 steps.
    packed = {**SETTINGS, "cost": PACKED}
    report["packed"] = train(TokenBudgetStream(examples(), **packed))
    stream = TokenBudgetStream(examples(), **packed)
    first = train(stream, limit=7)
    resumed = TokenBudgetStream(examples(), **packed)
    resumed.load_state_dict(json.loads(json.dumps(stream.state_dict())))
    report["packed_resumed"] = first + train(resumed)

    report["accelerate"] = with_accelerate(Path(out))

    Path(out, f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
