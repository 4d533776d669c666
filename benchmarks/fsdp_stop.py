"""From out of memory on one rank under FSDP2 to every rank stopped, and to training again after a restart.

Two processes under ``torchrun`` (gloo, CPU), a small model sharded by ``fully_shard`` (each layer
and the root), halve mode; rank 1 runs out of memory (``inject_oom``) in a forward pass, or in a
backward pass, of its ``STEP``-th step. Rank 0 is then inside one of FSDP's collectives.

- ``tokenbatch``: the guard records the lowered budget (``remember_budget``) and ends rank 1 with
  status 75 (``tokenbatch.oom._fsdp``);
- ``raise``: the same loop without the guard, the out-of-memory error left to propagate, as an
  FSDP loop has it today.

Each with and without a Python SIGTERM handler on the workers (docs/restarts.md's loop installs
one: it runs only once the main thread is back in Python). Measured from the failing rank's
timestamp, taken just before it exits or raises: when each worker process is gone (the
benchmark polls their pids every millisecond) and when torchrun has exited (``--max-restarts
0``). With ``--max-restarts 1`` (``tokenbatch``, forward): when the restarted job trains its
first step again, having loaded the last checkpoint. Medians over ``REPEATS`` runs.

Usage: ``python -m benchmarks.fsdp_stop [--quick] [--out DIR]`` (``--quick``: one repeat). Not
part of ``python -m benchmarks``; ``benchmarks.report`` shows its results when present.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

REPEATS = 3
STEP = 3  # rank 1 runs out of memory in this step (0-based), after a checkpoint at step 2
ARMS = [
    ("tokenbatch", "forward", False),
    ("tokenbatch", "backward", False),
    ("tokenbatch", "forward", True),
    ("raise", "forward", False),
    ("raise", "backward", False),
    ("raise", "forward", True),
]


def worker(out: str, arm: str, where: str, handler: str) -> None:
    """Under torchrun: train until rank 1 runs out of memory; timestamps to ``out``."""
    import torch
    import torch.distributed as dist
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler
    from tokenbatch.integrations.accelerate import last_checkpoint, save_checkpoint
    from tokenbatch.probe import BudgetCache, BudgetKey, remember_budget
    from tokenbatch.testing import inject_oom

    accelerator = Accelerator(cpu=True)
    rank, attempt = accelerator.process_index, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    folder = Path(out)
    (folder / f"pid-{attempt}-{rank}").write_text(str(os.getpid()))
    if handler == "1":
        signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as accelerator.set_trigger() would
    lengths = [4 + i % 29 for i in range(256)]
    sampler = TokenBudgetBatchSampler(lengths, 256, seed=0)
    loader = accelerator.prepare(
        DataLoader(
            list(range(len(lengths))),
            batch_sampler=sampler,
            collate_fn=lambda ids: torch.randint(0, 100, (len(ids), max(lengths[i] for i in ids))),
        )
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(100, 64), *(torch.nn.Linear(64, 64) for _ in range(4)), torch.nn.Linear(64, 1)
    )
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode="halve")

    class Sharded:  # the model in accelerate's checkpoints
        def state_dict(self) -> dict[str, Any]:
            return {k: v.full_tensor() for k, v in model.state_dict().items()}

        def load_state_dict(self, state: dict[str, Any]) -> None:
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))

    accelerator.register_for_checkpointing(Sharded())
    accelerator.register_for_checkpointing(fallback)
    if (checkpoint := last_checkpoint(folder / "checkpoints")) is not None:
        accelerator.load_state(str(checkpoint))
    remember_budget(
        fallback, BudgetKey("fsdp_stop", "cpu", 0, "float32", 2), BudgetCache(folder / "budget.json")
    )
    fallback.add_listener(lambda f: (folder / f"oom-{attempt}").write_text(str(time.time())))
    if attempt == 0:
        inject_oom(model, max_tokens=0, where=where, ranks=[1], after=STEP, times=1)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return model(batch).square().mean()

    for batch in fallback.iterate(loader):
        if arm == "raise":
            try:
                loss(batch).backward()
            except torch.OutOfMemoryError:  # the time it reaches Python, as the guard's listener has it
                (folder / f"oom-{attempt}").write_text(str(time.time()))
                raise
            optimizer.step()
        elif fallback.backward(batch, loss) is not None:
            fallback.step(optimizer)
        optimizer.zero_grad()
        (folder / f"step-{attempt}-{rank}").write_text(str(time.time()))
        if not (folder / f"first-{attempt}-{rank}").exists():
            (folder / f"first-{attempt}-{rank}").write_text(str(time.time()))
        if attempt == 0 and fallback.steps_done == STEP - 1:
            save_checkpoint(accelerator, folder / "checkpoints")
        if attempt > 0:
            break  # training again: that is what was measured
    dist.barrier()


def run(arm: str, where: str, handler: bool, restarts: int) -> dict[str, float]:
    """One job; seconds from the failing rank's out-of-memory to each event."""
    with tempfile.TemporaryDirectory() as out:
        folder = Path(out)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "1"}
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--max-restarts",
            str(restarts),
        ]
        command += ["--nproc_per_node", "2", "-m", "benchmarks.fsdp_stop", "--worker", out, arm, where]
        command += ["1" if handler else "0"]
        log = open(folder / "torchrun.log", "w")  # noqa: SIM115 - a pipe could fill and stall torchrun
        launched = time.time()
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        gone: dict[int, float] = {}
        pids: dict[int, int] = {}
        while child.poll() is None:
            for rank in (0, 1):
                if rank not in pids and (folder / f"pid-0-{rank}").exists():
                    text = (folder / f"pid-0-{rank}").read_text()
                    if text:
                        pids[rank] = int(text)
                if rank in pids and rank not in gone and not _alive(pids[rank]):
                    gone[rank] = time.time()
            time.sleep(0.001)
        ended = time.time()
        log.close()
        if not (folder / "oom-0").exists():
            raise RuntimeError(
                f"no out-of-memory logged; torchrun: {(folder / 'torchrun.log').read_text()[-3000:]}"
            )
        oom = float((folder / "oom-0").read_text())
        result = {f"rank {r} gone": gone[r] - oom for r in sorted(gone)}
        result["every rank gone"] = max(gone.values()) - oom
        if restarts:
            result["training again"] = min(float((folder / f"step-1-{r}").read_text()) for r in (0, 1)) - oom
            # For scale: the first start, from torchrun's launch to its first step trained.
            result["first start"] = (
                min(float((folder / f"first-0-{r}").read_text()) for r in (0, 1)) - launched
            )
        else:
            result["torchrun exited"] = ended - oom
        return result


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(") ")[-1][:1] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(*argv[1:5])
        return 0
    parser = common.parser("fsdp_stop", __doc__.splitlines()[0] if __doc__ else "fsdp_stop")
    args = parser.parse_args(argv)
    repeats = 1 if args.quick else REPEATS
    rows = []
    for arm, where, handler in [*ARMS, ("tokenbatch", "forward", None)]:
        restarts = 1 if handler is None else 0
        runs = [run(arm, where, bool(handler), restarts) for _ in range(repeats)]
        row: dict[str, Any] = {
            "on out of memory": "tokenbatch: record, exit 75" if arm == "tokenbatch" else "raise (no guard)",
            "where": where,
            "SIGTERM handler": "restart" if handler is None else ("yes" if handler else "no"),
        }
        for key in runs[0]:
            row[key + " (s)"] = statistics.median(r[key] for r in runs)
        rows.append(row)
        print(f"[fsdp_stop] {row}", flush=True)
    stops = [r["every rank gone (s)"] for r in rows if r["on out of memory"].startswith("tokenbatch")]
    raised = [r["every rank gone (s)"] for r in rows if r["on out of memory"].startswith("raise")]
    again = [r["training again (s)"] for r in rows if "training again (s)" in r]
    first = [r["first start (s)"] for r in rows if "first start (s)" in r]
    summary = (
        f"Out of memory on rank 1 of 2 under FSDP2 (gloo, CPU), medians of {repeats} run(s): every rank "
        f"gone {min(stops):.2f} to {max(stops):.2f} s after it with tokenbatch's stop (the failing rank "
        f"records the budget and exits 75), {min(raised):.2f} to {max(raised):.2f} s with the error raised "
        f"and left to propagate; under torchrun --max-restarts 1 the restarted job trained again "
        f"{again[0]:.1f} s after the out-of-memory (start-up and checkpoint load included; the first start "
        f"took {first[0]:.1f} s from launch to its first step)."
    )
    columns = list(dict.fromkeys(key for row in rows for key in row))
    common.write_results(
        "fsdp_stop",
        args.out,
        {"repeats": repeats, "step": STEP, "rows": rows, "summary": summary},
        summary + "\n\n" + common.markdown_table(rows, columns),
    )
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
