"""DDP step time: the guard's overlapped all-reduce and its average-after path against plain DDP.

Two processes (``torch.distributed.run``, gloo, CPU unless ``--device cuda``)
train two models with three arms, interleaved in rounds so that the shared
machine's noise hits every arm alike:

- ``plain DDP``: ``loss.backward()`` on the DDP model, DDP's own bucketed
  all-reduce overlapping backward (no guard);
- ``guard, overlap``: ``OOMFallback(..., overlap=True)``, the default: the
  guard's all-reduces issued from backward hooks, in an order a failed rank
  still completes;
- ``guard, after``: ``OOMFallback(..., overlap=False)``: forward and backward
  under ``no_sync()``, gradients averaged after the step.

Models: all-MiniLM-L6-v2 (the packaged one, 22.7 M parameters) on batches of
random token ids, and a wide MLP (four 2048 x 2048 layers, 16.8 M parameters,
tiny batches) where communication dominates. Each step is forward, backward
and an SGD step; the figures are medians of per-step wall times and their
ratios to plain DDP, measured side by side in the same run.

Run: ``python -m benchmarks.ddp_overlap [--quick]``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

ARMS = ("plain DDP", "guard, overlap", "guard, after")
COLUMNS = ("model", "parameters", "arm", "steps timed", "median step ms", "vs plain DDP")


def _minilm(device: Any) -> tuple[Any, dict[str, Any], Callable[[Any, dict[str, Any]], Any]]:
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(common.minilm_path(), num_labels=6)
    generator = torch.Generator().manual_seed(0)
    rows, length = 8, 64
    batch = {
        "input_ids": torch.randint(1000, 20000, (rows, length), generator=generator),
        "attention_mask": torch.ones(rows, length, dtype=torch.long),
        "labels": torch.randint(0, 6, (rows,), generator=generator),
    }
    return model.to(device), {k: v.to(device) for k, v in batch.items()}, lambda m, b: m(**b).loss


def _wide_mlp(device: Any) -> tuple[Any, dict[str, Any], Callable[[Any, dict[str, Any]], Any]]:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(2048, 2048), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(2048, 6))
    rows = 4
    batch = {  # an attention_mask so that the guard can read the batch's rows and lengths
        "x": torch.randn(rows, 2048),
        "attention_mask": torch.ones(rows, 1, dtype=torch.long),
        "labels": torch.randint(0, 6, (rows,)),
    }
    loss = nn.CrossEntropyLoss()
    return (
        model.to(device),
        {k: v.to(device) for k, v in batch.items()},
        lambda m, b: loss(m(b["x"]), b["labels"]),
    )


MODELS = {"all-MiniLM-L6-v2": _minilm, "wide MLP": _wide_mlp}


def measure(
    build: Callable[[Any], Any], *, rank: int, world: int, rounds: int, steps: int, device: Any
) -> dict[str, Any]:
    """Every arm on one model: ``rounds`` interleaved chunks of ``steps`` timed steps each."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler

    model, batch, loss_of = build(device)
    ddp = DistributedDataParallel(model, device_ids=[rank] if device.type == "cuda" else None)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-4)
    rows, width = batch["attention_mask"].shape
    total = (rounds * steps + 2) * len(ARMS)
    guards = {}
    for arm, overlap in (("guard, overlap", True), ("guard, after", False)):
        with warnings.catch_warnings():  # every length the same, on purpose: one batch shape
            warnings.simplefilter("ignore")
            sampler = TokenBudgetBatchSampler([width] * rows * total * world, rows * width, seed=0, rank=rank)
        guards[arm] = OOMFallback(sampler, ddp, mode="split", overlap=overlap)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(arm: str) -> None:
        if arm == "plain DDP":
            loss_of(ddp, batch).backward()
        else:
            guards[arm].backward(batch, lambda b: loss_of(ddp, b))
        optimizer.step()
        optimizer.zero_grad()

    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for arm in ARMS:  # warm-up: first-touch allocations, gloo connections
        step(arm)
    for number in range(rounds):
        for arm in ARMS if number % 2 == 0 else ARMS[::-1]:
            for _ in range(steps):
                dist.barrier()
                sync()
                start = time.perf_counter()
                step(arm)
                sync()
                times[arm].append(time.perf_counter() - start)
    return {"parameters": sum(p.numel() for p in model.parameters()), "times": times}


def worker(out: Path, rounds: int, steps: int, device_name: str) -> None:
    """One rank: every model, every arm; rank 0 writes the raw times."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    dist.init_process_group("nccl" if device_name == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank) if device_name == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    results = {
        name: measure(build, rank=rank, world=world, rounds=rounds, steps=steps, device=device)
        for name, build in MODELS.items()
    }
    if rank == 0:
        (out / "ddp_overlap_raw.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def summarize(raw: dict[str, Any]) -> list[dict[str, Any]]:
    """Per model and arm: the median step time and its ratio to plain DDP's."""
    rows = []
    for name, result in raw.items():
        medians = {arm: statistics.median(t) for arm, t in result["times"].items()}
        for arm in ARMS:
            rows.append(
                {
                    "model": name,
                    "parameters": f"{result['parameters'] / 1e6:.1f} M",
                    "arm": arm,
                    "steps timed": len(result["times"][arm]),
                    "median step ms": 1000 * medians[arm],
                    "vs plain DDP": medians[arm] / medians["plain DDP"],
                }
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.parser("ddp_overlap", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="gloo on CPU, or NCCL")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args(argv)
    rounds = args.rounds or (2 if args.quick else 6)
    steps = args.steps or (3 if args.quick else 5)
    if args.worker is not None:
        worker(args.worker, rounds, steps, args.device)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    command += ["-m", "benchmarks.ddp_overlap", "--worker", str(args.out), "--device", args.device]
    command += ["--rounds", str(rounds), "--steps", str(steps)]
    started = time.perf_counter()
    subprocess.run(command, env=env, cwd=common.REPO, check=True, timeout=1800)
    raw_path = args.out / "ddp_overlap_raw.json"
    raw = json.loads(raw_path.read_text())
    raw_path.unlink()
    rows = summarize(raw)
    cores = os.cpu_count()
    md = (
        f"2 processes ({args.device}, {'gloo' if args.device == 'cpu' else 'NCCL'}) on {cores} cores, "
        f"one thread each; {rounds} interleaved rounds of {steps} steps per arm (forward, backward, "
        f"SGD step); {time.perf_counter() - started:.0f} s in all.\n\n"
        + common.markdown_table(
            rows, ["model", "parameters", "arm", "steps timed", "median step ms", "vs plain DDP"]
        )
    )
    common.write_results("ddp_overlap", args.out, {"rows": rows, "raw": raw}, md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
