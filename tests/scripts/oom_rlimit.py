"""Recover from a real CPU allocator failure, run by tests/test_oom_rlimit.py.

Usage: MALLOC_MMAP_THRESHOLD_=131072 python oom_rlimit.py OUT.json

The script measures how much address space one forward and backward pass of
a full batch and of a half batch take, then lowers ``RLIMIT_AS`` to halfway
between them, so that the largest planned batch cannot be allocated while
half of it can. It then trains one epoch in each mode under that limit and
writes what happened, then four epochs in each mode with growth (``grow=True``).
(A fixed malloc mmap threshold keeps freed activation memory going back to
the system, so the measurements repeat.)
"""

from __future__ import annotations

import json
import logging
import resource
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import VOCAB, collate, quiet

from tokenbatch import OOMFallback, TokenBudgetBatchSampler, is_oom

WIDTH = 512
ROWS = 16  # a full batch: ROWS x WIDTH tokens
BUDGET = ROWS * WIDTH


def address_space(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def model_and_data() -> tuple[torch.nn.Module, list[dict[str, Any]]]:
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=37,
        max_position_embeddings=WIDTH,
        num_labels=6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="eager",  # attention scores in memory: B x heads x L x L
    )
    rng = np.random.default_rng(0)
    rows = [
        {
            "input_ids": rng.integers(1, VOCAB, int(rng.integers(WIDTH - 32, WIDTH + 1))).tolist(),
            "label": int(rng.integers(6)),
            "idx": i,
        }
        for i in range(40)
    ]
    return BertForSequenceClassification(config), rows


def step_memory(model: torch.nn.Module, rows: int) -> int:
    """Address space one forward and backward of ``rows`` x WIDTH tokens adds at its peak."""
    ids = torch.randint(1, VOCAB, (rows, WIDTH))
    before = address_space("VmSize")
    model(input_ids=ids, labels=torch.zeros(rows, dtype=torch.long)).loss.backward()
    model.zero_grad(set_to_none=True)
    return address_space("VmPeak") - before


def train(mode: str, messages: list[str], *, grow: bool = False, epochs: int = 1) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    model, rows = model_and_data()
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in rows], BUDGET, seed=0)
    loader = DataLoader(rows, batch_sampler=sampler, collate_fn=collate)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fallback = OOMFallback(sampler, model, mode=mode, grow=grow)
    trained: list[int] = []

    def loss_fn(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        try:
            return model(**{k: v for k, v in batch.items() if k != "idx"}).loss
        except Exception as error:
            messages.append(f"{type(error).__name__}|{is_oom(error)}|{str(error).splitlines()[0]}")
            raise

    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for batch in fallback.iterate(loader):
            if fallback.backward(batch, loss_fn) is not None:
                trained += batch["idx"].tolist()
                optimizer.step()
                optimizer.zero_grad()
    return {
        "trained": trained,
        "num_samples": len(rows),
        "epochs": epochs,
        "events": [e.as_dict() for e in fallback.events],
        "growth_events": [e.as_dict() for e in fallback.growth_events],
        "max_tokens": fallback.max_tokens,
    }


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record.getMessage())


def main() -> None:
    quiet()
    handler = _Collect()
    logging.getLogger("tokenbatch.oom").addHandler(handler)
    logging.getLogger("tokenbatch.oom").setLevel(logging.DEBUG)
    model, _ = model_and_data()
    step_memory(model, 2)  # warm up: lazy imports, first allocations
    half = step_memory(model, ROWS // 2)
    full = step_memory(model, ROWS)
    limit = address_space("VmSize") + (half + full) // 2
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    result: dict[str, Any] = {"half_bytes": half, "full_bytes": full, "limit": limit}
    # The limit has to bite: a full batch must now fail for real, outside any guard.
    try:
        step_memory(model, ROWS)
        result["full_batch_error"] = None
    except RuntimeError as error:
        result["full_batch_error"] = str(error).splitlines()[0]
    del model
    for mode in ("split", "halve"):
        messages: list[str] = []
        result[mode] = train(mode, messages)  # plain halving
        result[mode]["forward_errors"] = messages
    for mode in ("split", "halve"):  # growth back towards the real limit, over more steps
        messages = []
        result[f"{mode}_grow"] = train(mode, messages, grow=True, epochs=4)
        result[f"{mode}_grow"]["forward_errors"] = messages
    result["log"] = handler.records
    Path(sys.argv[1]).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
