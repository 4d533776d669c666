"""The measurements of ``benchmarks.gpu``: models built without the hub, synthetic data, timed training.

Every function here may fail on a machine nobody has looked at;
``benchmarks.gpu`` runs each inside a section that records why it could not.
``tiny=True`` shrinks the models and lengths so that the same code runs on a
CPU in seconds (the tests use it; its numbers mean nothing).
"""

from __future__ import annotations

import contextlib
import math
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks import common
from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom


@dataclass(frozen=True)
class Setup:
    """What every measurement shares: the device, the data's lengths, the limits."""

    device: torch.device
    lengths: np.ndarray
    max_length: int
    seconds: float
    """How long each timed training runs."""
    tiny: bool
    simulated_limit: float | None = None
    """CPU only: padded tokens above which a batch 'runs out of memory' (injected), as a GPU would."""


def make_lengths(count: int, max_length: int, seed: int = 0) -> np.ndarray:
    """IMDB-like review lengths: log-normal around a quarter of ``max_length``, a long tail cut at it."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(math.log(max_length / 4), 0.7, count).astype(np.int64)
    return np.clip(lengths, 8, max_length)


def build_model(name: str, *, tiny: bool, device: torch.device) -> torch.nn.Module:
    """``"bert-base"`` from its config (no weights needed, none downloaded), or the packaged MiniLM."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, BertConfig

    torch.manual_seed(0)
    if name == "bert-base":
        config = BertConfig(num_labels=6)  # bert-base: 12 layers, hidden 768, 110 M parameters
    else:
        config = AutoConfig.from_pretrained(common.minilm_path(), num_labels=6, local_files_only=True)
    if tiny:
        config.update({"num_hidden_layers": 2, "hidden_size": 32, "num_attention_heads": 2})
        config.intermediate_size = 37
    if name == "bert-base" or tiny:  # initialised where it will train: much faster on a GPU than on the CPU
        with device:
            return AutoModelForSequenceClassification.from_config(config)
    model = AutoModelForSequenceClassification.from_pretrained(
        common.minilm_path(), num_labels=6, local_files_only=True
    )
    return model.to(device)


def collate(lengths: np.ndarray, device: torch.device) -> Callable[[list[int]], dict[str, torch.Tensor]]:
    """Right-padded random token ids for the given sample indices (as DataCollatorWithPadding pads)."""

    def batch(indices: list[int]) -> dict[str, torch.Tensor]:
        rows = lengths[np.asarray(indices)]
        width = int(rows.max())
        generator = torch.Generator().manual_seed(int(indices[0]))
        ids = torch.randint(1000, 20000, (len(rows), width), generator=generator)
        mask = (torch.arange(width)[None, :] < torch.as_tensor(rows)[:, None]).long()
        labels = torch.randint(0, 6, (len(rows),), generator=generator)
        moved = {"input_ids": ids * mask, "attention_mask": mask, "labels": labels}
        return {k: v.to(device, non_blocking=True) for k, v in moved.items()}

    return batch


@contextlib.contextmanager
def autocast(device: torch.device, precision: str) -> Iterator[None]:
    """fp32 (nothing), or bf16 / fp16 autocast on the device."""
    if precision == "fp32":
        yield
        return
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    with torch.autocast(device.type, dtype=dtype):
        yield


def precision_for(device: torch.device) -> str:
    """bf16 where the device has it, else fp16 (with a GradScaler)."""
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "fp16"
    return "bf16"


def memory(device: torch.device) -> dict[str, Any]:
    """Peak allocated bytes since the last reset, and as a fraction of the device's memory."""
    if device.type != "cuda":
        return {"peak_memory_bytes": None, "peak_memory_fraction": None}
    peak = torch.cuda.max_memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    return {"peak_memory_bytes": peak, "peak_memory_fraction": peak / total}


def reset_memory(device: torch.device) -> None:
    import gc

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def train_timed(
    model: torch.nn.Module,
    loader: Any,
    setup: Setup,
    precision: str,
    *,
    fallback: OOMFallback | None = None,
    inject_after: int | None = None,
) -> dict[str, Any]:
    """Train for ``setup.seconds``: real tokens per second, step times, and one injected OOM's cost."""
    device = setup.device
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    injector = None
    if inject_after is not None:  # one real torch.OutOfMemoryError, in forward, at step inject_after
        injector = inject_oom(model, max_tokens=0, times=1, after=inject_after)
    limit = None
    if setup.simulated_limit is not None:  # CPU: out of memory above the limit, as a GPU would be
        limit = inject_oom(model, max_tokens=setup.simulated_limit)

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        with autocast(device, precision):
            loss = model(**batch).loss
        return loss if scaler is None else scaler.scale(loss)

    times, tokens, steps = [], 0, 0
    batches = loader if fallback is None else fallback.iterate(loader)
    started = time.perf_counter()
    try:
        for batch in batches:
            start = time.perf_counter()
            if fallback is None:
                loss_fn(batch).backward()
            elif fallback.backward(batch, loss_fn) is None:
                continue
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
            tokens += int(batch["attention_mask"].sum())
            steps += 1
            if time.perf_counter() - started > setup.seconds:
                break
    finally:
        for hooks in (injector, limit):
            if hooks is not None:
                hooks.remove()
    seconds = sum(times)
    median = statistics.median(times) if times else float("nan")
    result: dict[str, Any] = {
        "steps_timed": steps,
        "real_tokens_per_s": tokens / seconds if seconds else None,
    }
    result["median_step_s"] = median
    if inject_after is not None and fallback is not None and len(times) > inject_after:
        # The failed step: its forward until the error, freeing memory, the micro-batches again.
        result["recovery_s"] = times[inject_after] - median
        result["events"] = [str(e) for e in fallback.events]
    return result


def seed_batch_size(setup: Setup, *, start: int, precision: str, steps: int = 3) -> dict[str, Any]:
    """The seed's search: accelerate's ``find_executable_batch_size`` from ``start`` on batches of max_length.

    As in the seed's script, the model and optimizer are built inside the
    decorated function, so every restart starts from scratch.
    """
    from accelerate.utils import find_executable_batch_size

    tried: list[int] = []
    started = time.perf_counter()

    @find_executable_batch_size(starting_batch_size=start)  # type: ignore[misc]
    def train(batch_size: int) -> int:
        tried.append(batch_size)
        reset_memory(setup.device)
        model = build_model("bert-base", tiny=setup.tiny, device=setup.device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-5)
        hooks = inject_oom(model, setup.simulated_limit) if setup.simulated_limit is not None else None
        worst = collate(np.full(batch_size, setup.max_length), setup.device)
        try:
            for _ in range(steps):  # worst case: every row padded to max_length
                with autocast(setup.device, precision):
                    loss = model(**worst(list(range(batch_size)))).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        finally:
            if hooks is not None:
                hooks.remove()
        return batch_size

    size = train()
    return {
        "start": start,
        "settled_batch_size": size,
        "restarts": len(tried) - 1,
        "seconds_to_settle": time.perf_counter() - started,
        "tried": tried,
    }


def fixed_loader(setup: Setup, batch_size: int) -> DataLoader[Any]:
    """The seed's batches: shuffled, a fixed number of rows, padded to each batch's longest."""
    generator = torch.Generator().manual_seed(0)
    indices = list(range(len(setup.lengths)))
    return DataLoader(
        indices,
        batch_size=batch_size,
        shuffle=True,
        generator=generator,  # type: ignore[arg-type]
        collate_fn=collate(setup.lengths, setup.device),
    )


def budget_loader(setup: Setup, sampler: TokenBudgetBatchSampler) -> DataLoader[Any]:
    indices = list(range(len(setup.lengths)))
    batches = collate(setup.lengths, setup.device)
    return DataLoader(indices, batch_sampler=sampler, collate_fn=batches)  # type: ignore[arg-type]


def probe_budget(model: torch.nn.Module, setup: Setup, precision: str) -> dict[str, Any]:
    """``find_max_tokens`` for this model and precision at ``max_length`` (the probe's budget)."""
    from tokenbatch import find_max_tokens

    limit = None
    if setup.device.type != "cuda":
        # CPU: a limit of its own (the tests), else the probe takes the machine's memory; tiny models a
        # small one, so the probe's search stays short (the simulated limit replaces its budget below).
        limit = 2**26 if setup.tiny else 2**30
    started = time.perf_counter()
    with autocast(setup.device, precision):
        result = find_max_tokens(model, max_len=setup.max_length, lengths=setup.lengths, memory_limit=limit)
    seconds = time.perf_counter() - started
    if setup.simulated_limit is not None:  # the simulated device: its limit in padded tokens, not the CPU's
        return {"max_tokens": 0.9 * setup.simulated_limit, "cost": CostModel(), "probe_s": seconds}
    return {"max_tokens": result.max_tokens, "cost": result.cost, "probe_s": seconds}
