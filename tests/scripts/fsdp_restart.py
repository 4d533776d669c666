"""Run by tests/test_fsdp.py under ``torchrun --max-restarts``: docs/restarts.md's FSDP loop, out of memory.

Usage: fsdp_restart.py OUT MODE (``halve`` or ``split``)

A tiny model sharded by FSDP2 (``fully_shard`` on each layer and on the root, gloo on CPU),
trained two epochs by the guard, with a checkpoint every ``EVERY`` steps (``save_checkpoint``)
and the budget remembered beside the checkpoints and in the budget cache (``remember_budget``,
after ``load_state``). The "machine's memory" (``inject_oom``) runs out on one rank, once per
attempt, in the passes, where the guard stops the job for a restart:

- halve (``--max-restarts 2``): attempt 0, rank 0 in a forward pass (the first batch costing more
  than ``LIMITS[0]`` after ``AFTER`` model calls); attempt 1, the memory smaller (``LIMITS[1]``),
  rank 1 in a backward pass; attempt 2 trains under the twice-lowered budget and finishes.
- split (``--max-restarts 1``): attempt 0, rank 0 in a forward pass; attempt 1 runs every batch
  over the lowered budget as micro-batches, the ranks agreeing on how many passes each step
  takes, and recovers in place, without a restart, from two errors on rank 1 that come before
  any collective of their step: the micro-batch split running out of memory once (from the
  ``weight`` function, which the split calls), and ``optimizer.step()`` once.

accelerate on CPU keeps to DDP whatever its FSDP plugin says (it shards only on GPUs), so the
model is sharded here by hand and enters accelerate's checkpoints through ``Sharded`` (a full
state dict); the sampler's DataLoader is accelerate's.

The model's loss holds a per-sample marker, ``marker(ids) * rows / len(ids)`` summed, with rows
the whole batch's row count: whatever micro-batches a batch runs as, each of its samples adds
exactly 1 to its marker's gradient (averaged over the 2 ranks, times the learning rate of 2).
So in the final model ``-marker[i]`` is how many times sample ``i`` was trained in the steps
that the model kept. Each rank appends to ``OUT/rank<r>.jsonl``, flushed line by line.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler
from tokenbatch.integrations.accelerate import finish, last_checkpoint, save_checkpoint
from tokenbatch.probe import BudgetCache, BudgetKey, auto_budget, remember_budget
from tokenbatch.testing import inject_oom

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
LENGTHS = [3 + (i * 7) % 10 for i in range(160)]  # 3 to 12 tokens
MAX_TOKENS = 96
LIMITS = (80, 44)  # padded tokens a batch may have on this "machine", in attempt 0, then from attempt 1 on
AFTER = 4  # model calls let through before the injected error, on the rank that fails
EPOCHS = 2
EVERY = 3  # steps between checkpoints


def collate(ids: list[int]) -> dict[str, torch.Tensor]:
    longest = max(LENGTHS[i] for i in ids)
    return {
        "input_ids": torch.tensor([[1 + i % 40] * longest for i in ids]),
        "ids": torch.tensor(ids),
        "rows": torch.full((len(ids),), float(len(ids))),
    }


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(41, 8)
        self.hidden = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 1)
        self.marker = torch.nn.Embedding(len(LENGTHS), 1)
        torch.nn.init.zeros_(self.marker.weight)

    def forward(self, input_ids: torch.Tensor, ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        fit = self.head(torch.tanh(self.hidden(self.embed(input_ids)))).mean().square()
        return fit + (self.marker(ids).squeeze(-1) * rows).sum() / len(ids)


class Sharded:
    """The FSDP2 model in accelerate's checkpoints, as a full state dict (SGD keeps no state)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict[str, Any]:  # on every process: save_state asks each one
        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_model_state_dict(self.model, state, options=StateDictOptions(full_state_dict=True))


class FlakyOptimizer(torch.optim.SGD):
    """SGD whose ``fail_at``-th step runs out of memory before it changes anything."""

    fail_at: int | None = None
    steps = 0

    def step(self, closure: Any = None) -> Any:
        self.steps += 1
        if self.steps == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB (injected)")
        return super().step(closure)


class FlakyWeight:
    """The micro-batches' weight by samples, running out of memory on its ``fail_at``-th call."""

    def __init__(self, fail_at: int | None) -> None:
        self.fail_at, self.calls = fail_at, 0

    def __call__(self, piece: dict[str, torch.Tensor]) -> float:
        self.calls += 1
        if self.calls == self.fail_at:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 MiB (injected)")
        return float(len(piece["ids"]))


class Log:
    def __init__(self, path: Path, **fields: Any) -> None:
        self.handle = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        self.fields = fields

    def write(self, **record: Any) -> None:
        self.handle.write(json.dumps({**self.fields, **record, "time": time.time()}) + "\n")
        self.handle.flush()


def train(accelerator: Accelerator, out: Path, mode: str, log: Log) -> None:
    rank, world = accelerator.process_index, accelerator.num_processes
    sampler = TokenBudgetBatchSampler(LENGTHS, MAX_TOKENS, seed=5)
    loader = accelerator.prepare(
        DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler, collate_fn=collate)
    )
    model = Model()
    for layer in (model.embed, model.hidden, model.head, model.marker):
        fully_shard(layer)
    fully_shard(model)
    body = [p for name, p in model.named_parameters() if not name.startswith("marker")]
    optimizer = FlakyOptimizer(
        [{"params": body, "lr": 0.05}, {"params": list(model.marker.parameters()), "lr": float(world)}]
    )
    in_place = mode == "split" and ATTEMPT == 1 and rank == 1  # the errors recovered from in place
    optimizer.fail_at = 3 if in_place else None
    weight = FlakyWeight(fail_at=2 if in_place else None)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode, weight=weight)
    accelerator.register_for_checkpointing(Sharded(model))
    accelerator.register_for_checkpointing(fallback)
    checkpoints = out / "checkpoints"
    resumed = last_checkpoint(checkpoints)
    if resumed is not None:
        accelerator.load_state(str(resumed))
    key = BudgetKey("fsdp-restart", "cpu", 0, "float32", world)
    remember_budget(fallback, key, BudgetCache(checkpoints / "budget.json"))  # beside the checkpoints
    remember_budget(fallback, key)  # and in the budget cache ($TOKENBATCH_CACHE)
    fallback.add_listener(lambda f: log.write(event="budget", max_tokens=f.max_tokens))
    if ATTEMPT == 0:  # max_tokens="auto" for the sharded model: the estimate for 2 shards, no probe
        from transformers import LlamaConfig

        config = LlamaConfig(vocab_size=8000, hidden_size=64, intermediate_size=168, num_hidden_layers=2)
        auto = auto_budget(
            model, TokenBudgetBatchSampler(LENGTHS, "auto"), config=config, memory_limit=2**30, remember=False
        )
        log.write(event="auto", chose=str(auto), source=auto.source, max_tokens=auto.max_tokens)
    log.write(
        event="start",
        resumed=None if resumed is None else resumed.name,
        epoch=sampler.epoch,
        step=fallback.steps_done,
        max_tokens=fallback.max_tokens,
    )
    if ATTEMPT == 0:  # rank 0, in a forward pass
        injector = inject_oom(model, max_tokens=LIMITS[0], ranks=[0], after=AFTER, times=1)
    elif ATTEMPT == 1 and mode == "halve":  # less memory now: rank 1, in a backward pass
        injector = inject_oom(model, LIMITS[1], where="backward", ranks=[1], after=AFTER, times=1)
    else:  # the memory as it was in the attempt before, on every rank: nothing fails
        injector = inject_oom(model, max_tokens=LIMITS[1] if mode == "halve" else LIMITS[0])
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in fallback.iterate(loader):
            step, calls = fallback.steps_done, injector.calls
            if fallback.backward(batch, lambda b: model(**b)) is not None:
                fallback.step(optimizer)
                optimizer.zero_grad()
                lengths = [LENGTHS[i] for i in batch["ids"].tolist()]
                log.write(
                    event="step",
                    epoch=epoch,
                    step=step,
                    ids=batch["ids"].tolist(),
                    lengths=lengths,
                    passes=injector.calls - calls,
                    max_tokens=fallback.max_tokens,
                )
                if fallback.steps_done % EVERY == 0:
                    name = save_checkpoint(accelerator, checkpoints).name
                    if rank == 0:
                        log.write(event="saved", name=name, epoch=epoch, step=fallback.steps_done)
    marker = model.marker.weight.full_tensor()  # a collective: every rank
    if rank == 0:
        log.write(event="done", marker=marker.squeeze(-1).tolist(), events=len(fallback.events))
    log.write(event="events", events=[e.as_dict() for e in fallback.events], optimizer_steps=optimizer.steps)


def main(out: str, mode: str) -> None:
    accelerator = Accelerator(cpu=True)
    log = Log(Path(out) / f"rank{accelerator.process_index}.jsonl", attempt=ATTEMPT)
    try:
        train(accelerator, Path(out), mode, log)
    except BaseException as error:  # the other rank stopped for a restart: its collectives fail here
        log.write(event="released", error=f"{type(error).__name__}: {str(error)[:200]}")
        raise
    finish(accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
