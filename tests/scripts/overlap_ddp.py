"""Overlapped gradient all-reduce under the guard, on 2 or 3 real processes (torchrun, gloo, torch DDP).

Usage: python -m torch.distributed.run --nproc_per_node N overlap_ddp.py OUT_DIR

Run by tests/test_oom_overlap.py. Every case trains a small sequence
classifier (embedding, three blocks, a head) for one epoch from the same
seed with torch DDP, buckets of 1 KB (so that most gradients are all-reduced
one by one, during the backward pass), and writes to ``OUT_DIR/rank{r}.pt``
what the test checks: the sample ids trained, the events, the error, the
final parameters, the collectives the guard's overlapped path issued.
Out-of-memory errors are real ``torch.OutOfMemoryError``s raised from a
layer's forward pre-hook, or from autograd through a gradient hook on the
layer's output, when the batch costs more than ``LIMIT`` padded tokens.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import PAD, VOCAB, collate, make_rows, quiet

from tokenbatch import OOMFallback, SampleTooLargeError, TokenBudgetBatchSampler
from tokenbatch.oom import RankFailedError

BUDGET, LIMIT, SAMPLES = 256, 200, 96
LAYERS = {"early": "embed", "middle": "blocks.1", "last": "head"}


class Classifier(nn.Module):
    """Embedding, three tanh blocks, a mean over the real tokens, a head; ``extra`` used only on rank 1."""

    def __init__(self, *, extra: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 32, padding_idx=PAD)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3))
        self.extra = nn.Linear(32, 32) if extra else None
        self.head = nn.Linear(32, 6)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(input_ids)
        for block in self.blocks:
            hidden = block(hidden)
        if self.extra is not None and torch.distributed.get_rank() == 1:
            hidden = hidden + self.extra(hidden)  # find_unused_parameters: used on one rank only
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        return self.head((hidden * mask).sum(1) / mask.sum(1))


class Injector:
    """A real out-of-memory error from one layer, in forward or in backward, on some ranks."""

    def __init__(self, model: nn.Module, layer: str, where: str, ranks: list[int], kind: str = "oom") -> None:
        self.cost, self.count, self.where, self.kind = 0.0, 0, where, kind
        self.due = torch.distributed.get_rank() in ranks
        model.get_submodule(LAYERS[layer]).register_forward_hook(self.hook)

    def error(self) -> Exception:
        if self.kind == "error":
            return ValueError(f"not an OOM: rank {torch.distributed.get_rank()} in {self.where}")
        message = f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in {self.where})"
        return torch.OutOfMemoryError(message)

    def raise_now(self, *_: Any) -> None:
        self.count += 1
        raise self.error()

    def hook(self, module: nn.Module, args: Any, output: torch.Tensor) -> None:
        if not self.due or self.cost <= LIMIT or (self.kind == "error" and self.count):
            return
        if self.where == "forward":
            self.raise_now()
        elif output.requires_grad:
            output.register_hook(self.raise_now)


def train(case: dict[str, Any]) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    rank = torch.distributed.get_rank()
    rows = make_rows(SAMPLES)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], BUDGET, seed=0, rank=rank)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)  # type: ignore[arg-type]
    model = ddp = DistributedDataParallel(
        Classifier(extra=case.get("unused", False)),
        bucket_cap_mb=0.001,
        find_unused_parameters=case.get("unused", False),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    fallback = OOMFallback(sampler, model, mode=case.get("mode", "split"), overlap=case.get("overlap", True))
    injector = None
    if "layer" in case:
        injector = Injector(ddp.module, case["layer"], case["where"], case["ranks"], case.get("kind", "oom"))
    dtype = torch.bfloat16 if case.get("bf16") else torch.float16 if case.get("fp16") else None
    # fp16 as accelerate does it: the scaled loss goes backward, the step unscales (and may skip).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if case.get("fp16") else None

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if injector is not None:
            injector.cost = float(batch["attention_mask"].numel())
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            logits = model(batch["input_ids"], batch["attention_mask"])
        loss = nn.functional.cross_entropy(logits.float(), batch["labels"])
        return loss if scaler is None else scaler.scale(loss)

    rounds: list[Any] = []
    reducer_round = fallback._passes.begin_round  # record the overlapped attempts (white-box, read-only)

    def counting(*args: Any, **kwargs: Any) -> Any:
        made = reducer_round(*args, **kwargs)
        if made is not None:
            rounds.append(made)
        return made

    fallback._passes.begin_round = counting  # type: ignore[method-assign]
    accumulate = case.get("accumulate", 1)
    trained: list[int] = []
    error = None
    start = time.perf_counter()
    try:
        for number, batch in enumerate(fallback.iterate(loader)):
            if case.get("plain"):  # torch DDP as usual, no guard
                loss: torch.Tensor | None = loss_fn(batch)
                assert loss is not None
                loss.backward()
            else:
                loss = fallback.backward(batch, loss_fn)
            if loss is not None:
                trained += batch["idx"].tolist()
                if (number + 1) % accumulate == 0 and scaler is not None:
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()
                elif (number + 1) % accumulate == 0:
                    optimizer.step()
                    optimizer.zero_grad()
    except (ValueError, RankFailedError, SampleTooLargeError) as exc:
        error = {"type": type(exc).__name__, "message": str(exc)}
    return {
        "trained": trained,
        "events": [e.as_dict() for e in fallback.events],
        "injected": None if injector is None else injector.count,
        "error": error,
        "overlapped_attempts": len(rounds),
        "units": len(rounds[0].reducer.units) if rounds else 0,
        "units_early": sum(r.issued_early for r in rounds),
        "params": torch.cat([p.detach().reshape(-1).double() for p in ddp.module.parameters()]),
        "seconds": time.perf_counter() - start,
    }


def cases(world: int) -> dict[str, dict[str, Any]]:
    """Reference runs without OOM, then OOM in every layer, pass and mode, on one rank and on all."""
    found: dict[str, dict[str, Any]] = {}
    for mode in ("split", "halve"):
        found[f"plain_{mode}"] = {"mode": mode, "plain": True}
        found[f"guard_{mode}"] = {"mode": mode}
    found["guard_no_overlap"] = {"overlap": False}
    found["plain_accumulate"] = {"plain": True, "accumulate": 2}
    found["guard_accumulate"] = {"accumulate": 2}
    found["plain_unused"] = {"plain": True, "unused": True}
    found["guard_unused"] = {"unused": True}
    found["plain_bf16"] = {"plain": True, "bf16": True}
    found["guard_bf16"] = {"bf16": True}
    found["plain_fp16"] = {"plain": True, "fp16": True}
    found["guard_fp16"] = {"fp16": True}
    for mode in ("split", "halve"):
        for where in ("forward", "backward"):
            for layer in LAYERS:
                case = {"mode": mode, "where": where, "layer": layer}
                found[f"{mode}_{where}_{layer}_one"] = {**case, "ranks": [1]}
                found[f"{mode}_{where}_{layer}_all"] = {**case, "ranks": list(range(world))}
    found["split_backward_middle_one_accumulate"] = {
        "where": "backward",
        "layer": "middle",
        "ranks": [world - 1],
        "accumulate": 2,
    }
    found["split_forward_early_one_unused"] = {
        "where": "forward",
        "layer": "early",
        "ranks": [1],
        "unused": True,
    }
    found["error_backward_middle"] = {"where": "backward", "layer": "middle", "ranks": [1], "kind": "error"}
    return found


def main() -> None:
    quiet()
    logging.basicConfig(level=logging.ERROR)
    torch.distributed.init_process_group("gloo")
    out = Path(sys.argv[1])
    world = torch.distributed.get_world_size()
    results = {name: train(case) for name, case in cases(world).items()}
    torch.save(results, out / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
    from teardown import end_process_group

    end_process_group()
