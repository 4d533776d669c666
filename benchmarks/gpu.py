"""GPU benchmark: emotion fine-tuning with tokenbatch versus fixed random batches, on CUDA.

Only runs where CUDA is present; elsewhere it exits 0 and writes a result
saying it was skipped. For all-MiniLM-L6-v2 on the emotion train set
(synthetic emotion-like text where the data is absent), it trains the seed's
design (random batches of the fixed size with the budget's worst-case
memory) and ``TokenBudgetBatchSampler`` at the same budget, one after the
other on the same device, and reports per epoch: wall time, optimizer steps,
real tokens per second, validation macro-F1, and peak memory as a fraction
of the device's memory. ``--device cpu`` runs the same code on the CPU (for
checking the script, not for its numbers).

Run: ``python -m benchmarks.gpu [--quick]``.
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader

from benchmarks import common
from tokenbatch import CostModel, TokenBudgetBatchSampler
from tokenbatch.compare import fixed_batch_size

WORDS = ("i", "feel", "so", "happy", "sad", "angry", "afraid", "surprised", "loved", "today", "not", "very")


def load_emotion(limit: int | None) -> tuple[list[str], list[int], list[str], list[int], str]:
    """Train and validation texts and labels; a synthetic stand-in where the data is absent."""
    root = common.data_dir()
    if root is not None:
        train = common.read_jsonl(root / "emotion" / "train.jsonl")
        valid = common.read_jsonl(root / "emotion" / "validation.jsonl")
        source = "emotion (dair-ai) train/validation"
    else:
        rng = random.Random(0)
        train, valid = (
            [
                {"text": " ".join(rng.choices(WORDS, k=rng.randint(3, 60))), "label": rng.randrange(6)}
                for _ in range(n)
            ]
            for n in (16000, 2000)
        )
        source = "SYNTHETIC emotion-like text (no data dir found): F1 is meaningless"
    if limit is not None:
        train, valid = random.Random(0).sample(train, min(limit, len(train))), valid[: limit // 4]
    return (
        [r["text"] for r in train],
        [int(r["label"]) for r in train],
        [r["text"] for r in valid],
        [int(r["label"]) for r in valid],
        source,
    )


def _loader(method: str, features: list[dict[str, Any]], budget: int, collate: Any) -> DataLoader[Any]:
    """The DataLoader each design would use: a token-budget batch sampler, or shuffled fixed batches."""
    lengths = np.array([len(f["input_ids"]) for f in features])
    if method == "tokenbatch":
        sampler = TokenBudgetBatchSampler(lengths, budget, seed=0)
        return DataLoader(features, batch_sampler=sampler, collate_fn=collate, num_workers=2)  # type: ignore[arg-type]
    size = fixed_batch_size(lengths, CostModel(), budget)
    generator = torch.Generator().manual_seed(0)
    return DataLoader(
        features,  # type: ignore[arg-type]
        batch_size=size,
        shuffle=True,
        generator=generator,
        collate_fn=collate,
        num_workers=2,
    )


def train_method(
    method: str,
    encoded: dict[str, Any],
    labels: list[int],
    valid: tuple[dict[str, Any], list[int]],
    *,
    budget: int,
    epochs: int,
    device: torch.device,
) -> dict[str, Any]:
    """Fine-tune a fresh model with ``method``'s batches; per-epoch time, tokens/s, F1, peak memory."""
    from sklearn.metrics import f1_score
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    torch.manual_seed(0)
    path = common.minilm_path()
    collate = DataCollatorWithPadding(AutoTokenizer.from_pretrained(path))
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=6).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    features = [
        {"input_ids": ids, "label": label} for ids, label in zip(encoded["input_ids"], labels, strict=True)
    ]
    loader = _loader(method, features, budget, collate)
    lengths = np.array([len(f["input_ids"]) for f in features])
    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    epochs_out = []
    for epoch in range(epochs):
        model.train()
        steps, real_tokens = 0, 0
        if cuda:
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        if isinstance(loader.batch_sampler, TokenBudgetBatchSampler):
            loader.batch_sampler.set_epoch(epoch)
        for cpu_batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in cpu_batch.items()}
            with torch.autocast(device.type, dtype=dtype, enabled=cuda):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            steps += 1
            real_tokens += int(cpu_batch["attention_mask"].sum())
        if cuda:
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - start
        epochs_out.append(
            {
                "epoch": epoch,
                "seconds": seconds,
                "steps": steps,
                "real_tokens_per_s": real_tokens / seconds,
                "macro_f1": _evaluate(model, collate, valid, device, dtype, f1_score),
            }
        )
    peak = torch.cuda.max_memory_allocated(device) if cuda else None
    total = torch.cuda.get_device_properties(device).total_memory if cuda else None
    return {
        "method": method,
        "budget": budget,
        "batch_size": "budget" if method == "tokenbatch" else fixed_batch_size(lengths, CostModel(), budget),
        "epochs": epochs_out,
        "seconds_per_epoch": float(np.median([e["seconds"] for e in epochs_out])),
        "real_tokens_per_s": float(np.median([e["real_tokens_per_s"] for e in epochs_out])),
        "steps_per_epoch": epochs_out[-1]["steps"],
        "final_macro_f1": epochs_out[-1]["macro_f1"],
        "peak_memory_bytes": peak,
        "peak_memory_fraction": None if peak is None or total is None else peak / total,
    }


def _evaluate(
    model: Any,
    collate: Any,
    valid: tuple[dict[str, Any], list[int]],
    device: torch.device,
    dtype: Any,
    f1: Any,
) -> float:
    encoded, labels = valid
    model.eval()
    predictions = []
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
        for start in range(0, len(labels), 256):
            features = [{"input_ids": ids} for ids in encoded["input_ids"][start : start + 256]]
            batch = {k: v.to(device) for k, v in collate(features).items()}
            predictions += model(**batch).logits.argmax(-1).tolist()
    return float(f1(labels, predictions, average="macro"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.parser("gpu", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--device", default="cuda", help="cuda (default), or cpu to check the script")
    parser.add_argument("--budget", type=int, default=16384, help="max_tokens (linear cost)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        reason = "CUDA is not available on this machine; the GPU benchmark was skipped"
        print(reason)
        common.write_results("gpu", args.out, {"skipped": True, "reason": reason}, f"Skipped: {reason}.")
        return 0
    from transformers import AutoTokenizer

    device = torch.device(args.device)
    limit = 512 if args.quick else None
    train_texts, train_labels, valid_texts, valid_labels, source = load_emotion(limit)
    tokenizer = AutoTokenizer.from_pretrained(common.minilm_path())
    encoded = tokenizer(train_texts, truncation=True, max_length=512)
    valid = (tokenizer(valid_texts, truncation=True, max_length=512), valid_labels)
    epochs = 1 if args.quick else 3
    rows = [
        train_method(m, encoded, train_labels, valid, budget=args.budget, epochs=epochs, device=device)
        for m in ("random_fixed", "tokenbatch")
    ]
    columns = ["method", "budget", "batch_size", "steps_per_epoch", "seconds_per_epoch"]
    columns += ["real_tokens_per_s", "final_macro_f1", "peak_memory_fraction"]
    speedup = rows[1]["real_tokens_per_s"] / rows[0]["real_tokens_per_s"]
    md = (
        f"Device: {common.machine_info()['cuda'] or args.device}. Data: {source}, "
        f"{len(train_labels)} training samples, {epochs} epoch(s), all-MiniLM-L6-v2 "
        f"({'bf16 autocast' if device.type == 'cuda' else 'float32'}).\n\n"
        f"tokenbatch / fixed random batches, real tokens per second: {speedup:.2f}x.\n\n"
        + common.markdown_table(rows, columns)
    )
    results = {"skipped": False, "device": str(device), "source": source, "speedup": speedup, "rows": rows}
    common.write_results("gpu", args.out, results, md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
