"""Run by tests/test_sampler_accelerate.py: accelerate's save_state / load_state mid-epoch, and its options.

Usage: python accelerate_checkpoint.py OUT_DIR (one process), or under
``accelerate launch --num_processes 2`` (gloo on CPU).

For 0 and 2 DataLoader workers, without and with ``OOMFallback`` (halve mode,
one injected out-of-memory error before the checkpoint, so the state holds a
re-plan), a first run trains part of epoch 0, saves with
``accelerator.save_state`` and stops; a second run, built from scratch, loads
it with ``load_state`` and trains the rest of epoch 0 and all of epoch 1.
With the guard, the guard is what is registered for checkpointing (its state
holds the sampler's at the steps trained); without it, accelerate's
``use_stateful_dataloader=True`` checkpoints the DataLoader, which knows what
it gave the loop. Each rank writes the sample ids it trained, by run and
epoch, and what the set-ups that cannot be exact did: the sampler itself
registered (its own count runs ahead of the loop), ``split_batches``,
``dispatch_batches``, ``skip_first_batches`` after ``load_state``,
``use_stateful_dataloader`` with the sampler registered too, and a second
epoch without ``set_epoch``, in a loop over the DataLoader and in the README's
loop (``fallback.iterate``).
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


def build(
    workers: int, *, register: str = "fallback", **config: Any
) -> tuple[Accelerator, TokenBudgetBatchSampler, Any, Any, Any, OOMFallback]:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(**config))
    sampler = TokenBudgetBatchSampler(LENGTHS, MAX_TOKENS, seed=3)
    loader = DataLoader(
        list(range(len(LENGTHS))), batch_sampler=sampler, collate_fn=collate, num_workers=workers
    )
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # grow=False: one re-plan to save and restore (exactly once holds with growth too; the count differs)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode="halve", grow=False)
    if register == "fallback":
        accelerator.register_for_checkpointing(fallback)
    elif register == "sampler":
        accelerator.register_for_checkpointing(sampler)
    return accelerator, sampler, model, optimizer, loader, fallback


def train(run: tuple[Any, ...], guard: bool, save_to: str | None = None) -> list[int]:
    """Train the rest of the sampler's epoch, or ``STOP`` steps and save to ``save_to``: the ids trained."""
    accelerator, _, model, optimizer, loader, fallback = run
    trained: list[int] = []
    steps = 0
    for batch in fallback.iterate(loader) if guard else loader:
        if not guard:
            accelerator.backward(model(batch["input_ids"]))
        elif fallback.backward(batch, lambda b: model(b["input_ids"])) is None:
            continue  # dropped and re-planned: its samples come again
        optimizer.step()
        optimizer.zero_grad()
        trained += batch["ids"].tolist()
        steps += 1
        if save_to is not None and steps == STOP:
            accelerator.save_state(save_to)
            accelerator.wait_for_everyone()  # the main process wrote it; every rank reads it next
            break
    return trained


def resume_runs(root: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for workers in (0, 2):
        for guard in (False, True):
            name = f"workers={workers},guard={guard}"
            # The guard's recipe: register the fallback. Without it: accelerate's stateful DataLoader.
            how: dict[str, Any] = (
                {"register": "fallback"}
                if guard
                else {
                    "register": "nothing",
                    "use_stateful_dataloader": True,
                }
            )
            first = build(workers, **how)
            # With the guard, step 1 runs out of memory: halved, re-planned, and in the state.
            oom = inject_oom(first[2], max_tokens=1, times=1, after=1) if guard else contextlib.nullcontext()
            with oom:
                before = train(first, guard, str(root / name))
            replans = len(first[5].state_dict()["sampler"]["replans"])
            second = build(workers, **how)
            second[0].load_state(str(root / name))
            start = second[1].start_step if guard else None
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
    except (TypeError, ValueError) as error:  # the refusals
        return f"{type(error).__name__}: {error}"
    return None


def options(root: Path) -> dict[str, Any]:
    report: dict[str, Any] = {}
    # The sampler registered itself, as a DataLoader that reads ahead feeds it: refused at save_state.
    for workers in (0, 2):
        for guard in (False, True):
            run = build(workers, register="sampler")
            report[f"sampler,workers={workers},guard={guard}"] = error_of(
                lambda run=run, guard=guard: train(run, guard, str(root / "refused"))
            )
    # split_batches: accelerate refuses it at prepare (the sampler has no fixed batch size to split).
    report["split"] = error_of(lambda: build(0, split_batches=True))
    # dispatch_batches: refused when iterated, on every rank, before any batch is dealt out.
    report["dispatch"] = error_of(lambda: next(iter(build(0, dispatch_batches=True)[4])))
    # skip_first_batches after load_state: the sampler already resumes; skipping more would lose steps.
    train(build(0), True, str(root / "skip"))
    accelerator, *_, loader, _ = build(0)
    accelerator.load_state(str(root / "skip"))
    report["skip"] = error_of(lambda: next(iter(accelerator.skip_first_batches(loader, STOP))))
    # use_stateful_dataloader and the sampler registered too: the DataLoader resumes the sampler itself
    # (one process: the same state twice, fine), and on two processes would skip again: refused.
    stateful = {"register": "sampler", "use_stateful_dataloader": True}
    trained: list[int] = []
    report["stateful"] = error_of(
        lambda: trained.extend(train(build(0, **stateful), False, str(root / "st")))
    )
    if report["stateful"] is None:
        again = build(0, **stateful)
        again[0].load_state(str(root / "st"))
        trained.extend(train(again, False))
    report["stateful_ids"] = trained
    # A second epoch without set_epoch warns (accelerate calls it on one process, not on two).
    accelerator, sampler, *_, loader, _ = build(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = [[i for batch in loader for i in batch["ids"].tolist()] for _ in range(3)]
        forgot = [str(w.message) for w in caught if "set_epoch" in str(w.message)]
        caught.clear()
        for epoch in range(3):
            sampler.set_epoch(epoch)
            _ = [batch for batch in loader]
        report["set_epoch"] = {"forgot": forgot, "same": epochs[0] == epochs[1], "called": len(caught)}
    # The README's loop (the guard, fallback.step) with its set_epoch line left out: the guard keeps
    # the sampler's epoch on one process too, so every epoch is epoch 0 again, and the warning says so.
    accelerator, sampler, model, optimizer, loader, fallback = build(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        epochs = []
        for _ in range(3):
            trained = []
            for batch in fallback.iterate(loader):
                if fallback.backward(batch, lambda b: model(b["input_ids"])) is not None:
                    fallback.step(optimizer)
                    optimizer.zero_grad()
                    trained += batch["ids"].tolist()
            epochs.append(trained)
        report["set_epoch_guard"] = {
            "forgot": [str(w.message) for w in caught if "set_epoch" in str(w.message)],
            "same": epochs[0] == epochs[1] == epochs[2],
            "epoch": sampler.epoch,
        }
    return report


def main(out: str) -> None:
    root = Path(out, "checkpoints")  # one directory for every rank: the main process saves into it
    accelerator = Accelerator(cpu=True)
    report = {"world": accelerator.num_processes, "resume": resume_runs(root), "options": options(root)}
    Path(out, f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main(sys.argv[1])
