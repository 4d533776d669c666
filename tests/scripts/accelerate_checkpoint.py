"""Run by tests/test_sampler_accelerate.py: accelerate's save_state / load_state mid-epoch, and its options.

Usage: python accelerate_checkpoint.py OUT_DIR (one process), or under
``accelerate launch --num_processes 2`` (gloo on CPU).

For 0 and 2 DataLoader workers, without and with ``OOMFallback`` (halve mode,
one injected out-of-memory error before the checkpoint, so the state holds a
re-plan), a first run trains part of epoch 0, saves with
``accelerator.save_state`` (the sampler registered for checkpointing) and
stops; a second run, built from scratch, loads it with ``load_state`` and
trains the rest of epoch 0 and all of epoch 1. Each rank writes the sample ids
it trained, by run and epoch, and what accelerate's other options did:
``split_batches``, ``dispatch_batches``, ``skip_first_batches`` after
``load_state``, ``use_stateful_dataloader`` with the sampler registered too,
and a second epoch without ``set_epoch``.
"""

from __future__ import annotations

import contextlib
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom

LENGTHS = [3 + (i * 37) % 53 for i in range(240)]
MAX_TOKENS = 320
STOP = 4  # steps trained before the checkpoint


def collate(ids: list[int]) -> dict[str, torch.Tensor]:
    longest = max(LENGTHS[i] for i in ids)
    return {"input_ids": torch.tensor([[i] * longest for i in ids]), "ids": torch.tensor(ids)}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(len(LENGTHS), 4)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed(input_ids).square().mean()


def build(workers: int, **config: Any) -> tuple[Accelerator, TokenBudgetBatchSampler, Any, Any, Any]:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    sampler = TokenBudgetBatchSampler(LENGTHS, MAX_TOKENS, seed=3)
    loader = DataLoader(
        list(range(len(LENGTHS))), batch_sampler=sampler, collate_fn=collate, num_workers=workers
    )
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.register_for_checkpointing(sampler)
    return accelerator, sampler, model, optimizer, loader


def train(run: tuple[Any, ...], guard: bool, save_to: str | None = None) -> list[int]:
    """Train the rest of the sampler's epoch, or ``STOP`` steps and save to ``save_to``: the ids trained."""
    accelerator, sampler, model, optimizer, loader = run
    # grow=False: one re-plan to save and restore (exactly once holds with growth too; the count differs)
    fallback = None
    if guard:
        fallback = OOMFallback(sampler, model, accelerator=accelerator, mode="halve", grow=False)
    trained: list[int] = []
    steps = 0
    for batch in fallback.iterate(loader) if fallback is not None else loader:
        if fallback is None:
            accelerator.backward(model(batch["input_ids"]))
        elif fallback.backward(batch, lambda b: model(b["input_ids"])) is None:
            continue  # dropped and re-planned: its samples come again
        optimizer.step()
        optimizer.zero_grad()
        trained += batch["ids"].tolist()
        steps += 1
        if save_to is not None and steps == STOP:
            accelerator.save_state(save_to)  # calls sampler.state_dict() with no argument
            accelerator.wait_for_everyone()  # the main process wrote it; every rank reads it next
            break
    return trained


def resume_runs(root: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for workers in (0, 2):
        for guard in (False, True):
            name = f"workers={workers},guard={guard}"
            first = build(workers)
            # With the guard, step 1 runs out of memory: halved, re-planned, and in the state.
            oom = inject_oom(first[2], max_tokens=1, times=1, after=1) if guard else contextlib.nullcontext()
            with oom:
                before = train(first, guard, str(root / name))
            replans = len(first[1].state_dict()["replans"])
            second = build(workers)
            second[0].load_state(str(root / name))
            start = second[1].start_step
            rest = train(second, guard)
            second[1].set_epoch(1)
            epoch1 = train(second, guard)
            report[name] = {
                "before": before,
                "rest": rest,
                "epoch1": epoch1,
                "start": start,
                "replans": replans,
            }
    return report


def error_of(action: Any) -> str | None:
    try:
        action()
    except (TypeError, ValueError) as error:
        return f"{type(error).__name__}: {error}"
    return None


def options(root: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # split_batches: refused at prepare (accelerate read batch_size and failed on None).
    report["split"] = error_of(lambda: build(0, split_batches=True))
    # dispatch_batches: refused when iterated, on every rank, before any batch is dealt out.
    report["dispatch"] = error_of(lambda: next(iter(build(0, dispatch_batches=True)[4])))
    # skip_first_batches after load_state: the sampler already resumes; skipping more would lose steps.
    train(build(0), False, str(root / "skip"))
    accelerator, *_, loader = build(0)
    accelerator.load_state(str(root / "skip"))
    report["skip"] = error_of(lambda: next(iter(accelerator.skip_first_batches(loader, STOP))))
    # use_stateful_dataloader and the sampler registered too: on two processes the DataLoader skips again.
    trained = train(build(0, use_stateful_dataloader=True), False, str(root / "stateful"))
    again = build(0, use_stateful_dataloader=True)
    again[0].load_state(str(root / "stateful"))
    report["stateful"] = error_of(lambda: trained.extend(train(again, False)))
    report["stateful_ids"] = trained
    # A second epoch without set_epoch warns (accelerate calls it on one process, not on two).
    accelerator, sampler, *_, loader = build(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [[i for batch in loader for i in batch["ids"].tolist()] for _ in range(3)]
        forgot = [str(w.message) for w in caught if "set_epoch" in str(w.message)]
        caught.clear()
        for epoch in range(3):
            sampler.set_epoch(epoch)
            _ = [batch for batch in loader]
        report["set_epoch"] = {"forgot": forgot, "same": epochs[0] == epochs[1], "called": len(caught)}
    return report


def main(out: str) -> None:
    root = Path(out, "checkpoints")  # one directory for every rank: the main process saves into it
    accelerator = Accelerator(cpu=True)
    report = {"world": accelerator.num_processes, "resume": resume_runs(root), "options": options(root)}
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
