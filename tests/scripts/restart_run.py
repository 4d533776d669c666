"""Run by tests/test_restarts.py under torchrun: docs/restarts.md's accelerate loop, killed and preempted.

Usage: restart_run.py OUT RUN [VICTIM:STEP:AFTER]

The loop: halve mode, ``inject_oom`` as the machine's memory on every attempt (one OOM early in
epoch 0 lowers the budget for good), a checkpoint every ``EVERY`` steps with ``save_checkpoint``,
and SIGTERM handled as docs/restarts.md says: ``accelerator.set_trigger()`` in the handler,
``accelerator.check_trigger()`` at every step boundary, a checkpoint and a clean exit when any
process was signalled. Each run starts from ``last_checkpoint`` when there is one.

With ``VICTIM:STEP:AFTER``, under ``torchrun --max-restarts 2``, each attempt meets one fault:

0. rank VICTIM SIGKILLs itself inside the forward pass of epoch 0's step STEP;
1. rank 0 SIGKILLs itself in the middle of its second checkpoint, after the model's files and
   before the registered objects';
2. after its AFTER-th step, rank 0 sends SIGTERM to torchrun (its parent), which forwards it to
   both workers, and waits until it has its own. Rank 1 blocks SIGTERM from its start, so the
   signal never reaches it: it stops because the ranks agree, not because it heard anything.

Each rank appends to ``OUT/RUN-rank<r>.jsonl``, flushed line by line so that a SIGKILL loses
nothing written: the start (the checkpoint resumed, its position, the budget, a checksum of
the model, the partial folders found), every step trained (epoch, step, sample ids), every
checkpoint saved (rank 0), a stop, the end. ``RESTART_NAIVE=1`` checkpoints as
docs/checkpoints.md did before restarts.md: ``save_state`` over one folder, which a kill in the
middle of a save leaves half new.
"""

from __future__ import annotations

import os
import signal
import sys

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
FAULTS = sys.argv[3] if __name__ == "__main__" and len(sys.argv) > 3 else ""
if FAULTS and ATTEMPT == 2 and os.environ.get("RANK") == "1":
    # Before torch starts any thread, so that every thread inherits the mask: the process never
    # takes the SIGTERM torchrun forwards (it stays pending until the process exits).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402

# The data and model of accelerate_checkpoint.py (beside this script): 240 ids of lengths 3 to 55.
from accelerate_checkpoint import LENGTHS, Model, collate  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from tokenbatch import OOMFallback, TokenBudgetBatchSampler  # noqa: E402
from tokenbatch.integrations.accelerate import finish, last_checkpoint, save_checkpoint  # noqa: E402
from tokenbatch.testing import inject_oom  # noqa: E402

MAX_TOKENS = 320
LIMIT = 250  # padded tokens a batch may have on this "machine": one OOM early in epoch 0
EPOCHS = 2
EVERY = 4  # steps between checkpoints
NAIVE = os.environ.get("RESTART_NAIVE") == "1"


class Tripwire:
    """Registered for checkpointing before the guard: ``armed`` kills this process inside ``save_state``."""

    armed = False

    def state_dict(self) -> dict[str, Any]:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


class Log:
    def __init__(self, path: Path, **fields: Any) -> None:
        self.handle = open(path, "a", buffering=1)  # noqa: SIM115 - open for the whole run
        self.fields = fields

    def write(self, **record: Any) -> None:
        self.handle.write(json.dumps({**self.fields, **record, "time": time.time()}) + "\n")
        self.handle.flush()


def checksum(model: torch.nn.Module) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def train(accelerator: Accelerator, out: Path, run: str) -> None:
    attempt, rank = ATTEMPT, accelerator.process_index
    log = Log(out / f"{run}-rank{rank}.jsonl", run=run, attempt=attempt, rank=rank)
    victim, kill_at, signal_after = map(int, FAULTS.split(":")) if FAULTS else (-1, -1, -1)
    sampler = TokenBudgetBatchSampler(LENGTHS, MAX_TOKENS, seed=3)
    loader = DataLoader(list(range(len(LENGTHS))), batch_sampler=sampler, collate_fn=collate)
    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode="halve", grow=False)
    tripwire = Tripwire()
    accelerator.register_for_checkpointing(tripwire)
    accelerator.register_for_checkpointing(fallback)

    checkpoints = out / "checkpoints"
    resumed = (checkpoints if checkpoints.is_dir() else None) if NAIVE else last_checkpoint(checkpoints)
    if resumed is not None:
        accelerator.load_state(str(resumed))
    log.write(
        event="start",
        partial={path.name: sorted(os.listdir(path)) for path in checkpoints.glob(".*.partial")},
        world=accelerator.num_processes,
        resumed=None if resumed is None else resumed.name,
        epoch=sampler.epoch,
        step=fallback.steps_done,
        max_tokens=fallback.max_tokens,
        events=len(fallback.events),
        checksum=checksum(model),
    )
    heard: list[tuple[int, int]] = []

    def on_sigterm(signum: int, frame: Any) -> None:
        heard.append((sampler.epoch, fallback.steps_done))
        accelerator.set_trigger()

    signal.signal(signal.SIGTERM, on_sigterm)
    saves = trained_here = 0

    def save() -> None:
        nonlocal saves
        saves += 1
        tripwire.armed = bool(FAULTS) and attempt == 1 and rank == 0 and saves == 2
        if NAIVE:
            accelerator.save_state(str(checkpoints))
            accelerator.wait_for_everyone()
            name = checkpoints.name
        else:
            name = save_checkpoint(accelerator, checkpoints).name
        if rank == 0:
            log.write(
                event="saved",
                name=name,
                epoch=sampler.epoch,
                step=fallback.steps_done,
                checksum=checksum(model),
            )

    inject_oom(model, max_tokens=LIMIT)  # the machine's memory: the same on every attempt
    for epoch in range(sampler.epoch, EPOCHS):
        sampler.set_epoch(epoch)
        for batch in fallback.iterate(loader):
            step = fallback.steps_done
            dies = attempt == 0 and rank == victim and (epoch, step) == (0, kill_at)

            def loss(b: dict[str, torch.Tensor], dies: bool = dies) -> torch.Tensor:
                if dies:
                    os.kill(os.getpid(), signal.SIGKILL)  # a worker dies in the middle of a step
                return model(b["input_ids"])  # type: ignore[no-any-return]

            if fallback.backward(batch, loss) is not None:
                fallback.step(optimizer)
                optimizer.zero_grad()
                log.write(event="step", epoch=epoch, step=step, ids=batch["ids"].tolist())
                trained_here += 1
                if attempt == 2 and rank == 0 and trained_here == signal_after:
                    os.kill(os.getppid(), signal.SIGTERM)  # the scheduler preempts the job: torchrun first
                    deadline = time.monotonic() + 60  # until torchrun has forwarded it here: a known step
                    while not heard and time.monotonic() < deadline:
                        time.sleep(0.01)
                if fallback.steps_done % EVERY == 0:
                    save()
            if accelerator.check_trigger():  # SIGTERM on any process: True on all, at this same step
                save()
                log.write(
                    event="stopped",
                    epoch=sampler.epoch,
                    step=fallback.steps_done,
                    trained=trained_here,
                    heard=heard,
                )
                return
    save()  # the end too: a job run again after it finished trains nothing
    log.write(event="done", max_tokens=fallback.max_tokens, events=len(fallback.events))


def main(out: str, run: str, faults: str = "") -> None:
    accelerator = Accelerator(cpu=True)
    train(accelerator, Path(out), run)
    finish(accelerator)


if __name__ == "__main__":
    main(*sys.argv[1:])
