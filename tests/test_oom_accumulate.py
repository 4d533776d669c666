"""OOMFallback under accelerate's gradient accumulation, one process: an OOM late in a group keeps the group.

Each run records which batches went into each optimizer step; replaying those
groups with a plain loop (no guard, no accelerate) must give the run's
parameters, so no gradient was lost or counted twice. The 2-process runs are in
tests/test_oom_steps_distributed.py.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom

quiet()
ROWS = make_rows(64)
LENGTHS = [len(r["input_ids"]) for r in ROWS]
STEPS = 3  # gradient_accumulation_steps
BUDGET = 128  # 8 batches of 93 to 126 padded tokens: groups of steps (0, 1, 2), (3, 4, 5), (6, 7)
LIMIT = 100  # batches above this many padded tokens "run out of memory"
MIDDLE, LAST = 4, 5  # the steps of the second group the OOM hits


def train(mode: str, *, where: str | None = None, step: int = MIDDLE) -> dict[str, Any]:
    """One epoch under ``accelerator.accumulate``; with ``where``, one OOM there at ``step``."""
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=STEPS)
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sampler = TokenBudgetBatchSampler(LENGTHS, BUDGET, seed=0)
    loader = DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode)
    injector = None if where is None else inject_oom(model, LIMIT, where=where, after=step, times=1)
    groups: list[list[list[int]]] = []  # per optimizer step, the batches (sample indices) it trained
    pending: list[list[int]] = []
    for batch in fallback.iterate(loader):
        with accelerator.accumulate(model):
            loss = fallback.backward(batch, loss_fn(model))
            if loss is not None:
                pending.append(batch["idx"].tolist())
                optimizer.step()  # accelerate's optimizer steps at the end of a group only
                optimizer.zero_grad()
                if accelerator.sync_gradients:
                    groups.append(pending)
                    pending = []
    assert pending == []  # the end of the data loader closes the last group
    return {
        "groups": groups,
        "params": flat_params(model),
        "events": fallback.events,
        "injected": None if injector is None else injector.count,
    }


def replay(groups: list[list[list[int]]]) -> torch.Tensor:
    """The parameters of a plain loop over the same groups: each batch's mean loss / STEPS, then a step."""
    model = tiny_bert(0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    forward = loss_fn(model)
    for group in groups:
        for indices in group:
            (forward(collate([ROWS[i] for i in indices])) / STEPS).backward()
        optimizer.step()
        optimizer.zero_grad()
    return flat_params(model)


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    run = train("split")
    assert run["events"] == [] and [len(g) for g in run["groups"]] == [3, 3, 2]
    assert relative(run["params"], replay(run["groups"])) < 1e-6  # the guard accumulates like a plain loop
    return run


def trained_once(run: dict[str, Any]) -> bool:
    return sorted(i for group in run["groups"] for batch in group for i in batch) == list(range(64))


@pytest.mark.parametrize(("where", "step"), [("forward", MIDDLE), ("backward", MIDDLE), ("backward", LAST)])
def test_split_keeps_the_groups_earlier_gradients(reference: dict[str, Any], where: str, step: int) -> None:
    run = train("split", where=where, step=step)
    [event] = run["events"]
    assert run["injected"] == 1 and event.step == step
    assert trained_once(run) and [len(g) for g in run["groups"]] == [3, 3, 2]
    assert relative(run["params"], reference["params"]) < 1e-6


@pytest.mark.parametrize(("where", "step"), [("backward", MIDDLE), ("forward", LAST)])
def test_halve_drops_the_failed_step_only(where: str, step: int) -> None:
    run = train("halve", where=where, step=step)
    [event] = run["events"]
    assert run["injected"] == 1 and event.step == step
    assert trained_once(run)  # the dropped batch's samples are trained later, once
    # The dropped batch counts in accelerate's group; a dropped last batch leaves no optimizer step,
    # and its group's earlier batches go into the next one.
    assert len(run["groups"][1]) == (2 if step == MIDDLE else 2 + STEPS)
    assert relative(run["params"], replay(run["groups"])) < 1e-6
