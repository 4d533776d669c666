"""Padding-free batching side by side: tokenbatch's packs beside TRL's, transformers' and axolotl's.

For the emotion and IMDB train sets (all-MiniLM-L6-v2 token lengths, IMDB
untruncated, up to 3127 tokens; shuffled once, IMDB's rows are sorted by
label) and a long-tailed lognormal set (20000 lengths, median 300, up to
8000), one budget per data set, ``B`` tokens per batch and rank (2048 on
emotion, 4096 on IMDB, 8192 on lognormal: each above the longest example),
one epoch on 1 and on 2 ranks, the batchings a user has today:

- ``trl_bfd``: TRL's ``packing=True``: ``trl.pack_dataset(strategy="bfd")`` at
  TRL's default ``max_length=1024`` (examples over it truncated), the packed
  rows shuffled and ``B / 1024`` of them per batch (``per_device_train_batch_size``),
  flattened into one row by TRL's padding-free collator; the same rows every epoch;
- ``trl_padding_free``: TRL's ``padding_free=True`` without packing (TRL then
  requires ``max_length=None``): random batches of a fixed count ``b``;
- ``flattening_grouped``: ``transformers.DataCollatorWithFlattening`` with
  ``group_by_length`` (``LengthGroupedSampler``), batches of ``b``;
- ``axolotl_multipack``: axolotl's ``MultipackBatchSampler`` (sample packing)
  as its trainer makes it: a ``RandomSampler``, one bin of ``B`` tokens per
  batch, its defaults (``bin_size=200``, ``group_size=100000``, ``drop_last``),
  ``len()`` taken first (it trims every epoch to the fewest batches of 4
  random packings); needs ``pip install axolotl --no-deps numba``, else its row says why;
- ``tokenbatch_padded``: :class:`tokenbatch.TokenBudgetBatchSampler`, padded
  batches of similar lengths under ``B`` padded tokens;
- ``tokenbatch_packed``: the same sampler with ``CostModel(packing="varlen")``:
  packs of whole examples under ``B`` real tokens.

The fixed count ``b`` is sized as the padding benchmark sizes a fixed batch:
the largest ``b`` whose worst batch fits ``B``, here the ``b`` longest
examples of the data set (``LengthGroupedSampler`` also gets the largest
``b`` whose own worst batch over the epoch fits, ``flattening_grouped_own_fit``).
On 2 ranks the fixed methods' batches go round robin to the ranks, as
accelerate's ``BatchSamplerShard`` deals them; tokenbatch plans its steps for 2.

Measured, from epoch 0 (planning time: the median of 3 epochs):

- ``fill``: real tokens per batch / ``B``, the mean over batches (the padded
  method's real tokens too);
- ``truncated``: the share of the data set's tokens cut off;
- ``steps`` per epoch, and ``once``: the share of examples trained exactly once;
- ``balance_L``, ``balance_L2`` (2 ranks): per step, the largest rank's work
  over the mean rank's, averaged over steps: tokens in its rows (padded
  tokens for padded batches), and attention pairs (the sum of each
  example's ``L^2`` in a pack, rows x longest^2 padded);
- ``planning_s``: the time to make one epoch's batches from the lengths
  (``trl_bfd``: ``pack_dataset`` once, ``pack_s``; axolotl: its ``len()`` too);
- ``tokens_per_s`` (not with ``--quick``): real tokens per second training a
  small Llama (2 layers, hidden 128, vocabulary 8192, sdpa attention, which
  masks each example of a pack off from the others over the whole row) on
  CPU, 2 processes (torchrun, gloo, DDP), on the same evenly spaced steps of
  each method's epoch, the methods interleaved, the median of 3 rounds.

``benchmarks/gpu.py`` runs the training part on a GPU with flash-attention's
varlen kernel where it is installed (:func:`gpu_rows`).

Run: ``python -m benchmarks.packing [--quick]``.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import common
from tokenbatch import CostModel, TokenBudgetBatchSampler

TRL_MAX_LENGTH = 1024  # SFTConfig's default max_length
PACKED = CostModel(packing="varlen")
METHODS = (
    "trl_bfd",
    "trl_padding_free",
    "flattening_grouped",
    "flattening_grouped_own_fit",
    "axolotl_multipack",
    "tokenbatch_padded",
    "tokenbatch_packed",
)
TRAINED = ("trl_bfd", "trl_padding_free", "flattening_grouped", "axolotl_multipack")
TRAINED += ("tokenbatch_padded", "tokenbatch_packed")
AXOLOTL_INSTALL = "pip install axolotl --no-deps numba"


@dataclass
class Dataset:
    name: str
    lengths: np.ndarray
    source: str
    budget: int


@dataclass
class Epoch:
    """One epoch of a method: each batch's examples and the tokens of each that reach the model."""

    batches: list[np.ndarray]
    tokens: list[np.ndarray]
    padded: bool = False
    truncated: int = 0


def load(quick: bool) -> list[Dataset]:
    """emotion and IMDB (real where the data folder has them, else synthetic stand-ins), and a lognormal set.

    ``quick``: small synthetic stand-ins, so that the smoke test tokenizes nothing.
    """
    found = []
    for name, budget, count, shape in (
        ("emotion", 2048, 400, (20, 0.5, 3, 87)),
        ("imdb", 4096, 200, (230, 0.75, 10, 3127)),
    ):
        root = None if quick else common.data_dir()
        if root is not None:
            rows = common.read_jsonl(root / name / "train.jsonl")
            order = np.random.default_rng(0).permutation(len(rows))
            lengths = common.token_lengths([rows[i]["text"] for i in order], 100_000)
            source = f"{name} train set, all-MiniLM-L6-v2 tokens (untruncated), shuffled once"
        else:
            median, sigma, low, high = shape
            rng = np.random.default_rng(len(name))
            n = count if quick else 16000
            lengths = np.clip(np.rint(rng.lognormal(math.log(median), sigma, n)), low, high).astype(np.int64)
            why = "--quick" if quick else "no data dir found"
            source = f"SYNTHETIC {name}-like ({why}): {n} lognormal lengths, median {median}, {low}..{high}"
        found.append(Dataset(name, lengths, source, budget))
    # Long-tailed lengths no tokenizer made: a lognormal set, as in the padding benchmark.
    rng = np.random.default_rng(7)
    n = 400 if quick else 20000
    lengths = np.clip(np.rint(rng.lognormal(math.log(300), 0.9, n)), 10, 8000).astype(np.int64)
    source = f"synthetic: {n} lognormal lengths, median 300, sigma 0.9, 10..8000"
    found.append(Dataset("lognormal", lengths, source, 8192))
    return found


# -- the batchings ------------------------------------------------------------------------------


def fixed_count(lengths: np.ndarray, budget: float) -> int:
    """The largest count ``b`` whose worst batch, the ``b`` longest examples together, fits ``budget``."""
    longest = np.cumsum(np.sort(lengths)[::-1])
    return max(1, int(np.searchsorted(longest, budget, side="right")))


def _cut(order: np.ndarray, size: int, lengths: np.ndarray) -> Epoch:
    batches = [order[i : i + size] for i in range(0, len(order), size)]
    return Epoch(batches, [lengths[b] for b in batches])


def trl_padding_free(lengths: np.ndarray, budget: float, epoch: int, size: int) -> Epoch:
    """Random batches of ``size`` (Trainer's ``RandomSampler``), flattened by TRL's padding-free collator."""
    return _cut(np.random.default_rng([0, epoch]).permutation(len(lengths)), size, lengths)


def flattening_grouped(lengths: np.ndarray, budget: float, epoch: int, size: int) -> Epoch:
    """``LengthGroupedSampler`` batches of ``size``, flattened by ``DataCollatorWithFlattening``."""
    import torch
    from transformers.trainer_pt_utils import LengthGroupedSampler

    generator = torch.Generator().manual_seed(epoch)
    sampler = LengthGroupedSampler(size, lengths=lengths.tolist(), generator=generator)
    return _cut(np.fromiter(iter(sampler), np.int64, len(lengths)), size, lengths)


def own_fit(lengths: np.ndarray, budget: float, start: int) -> int:
    """The largest size, from ``start``, whose ``LengthGroupedSampler`` epoch 0 fits ``budget`` throughout."""
    size = start
    while size < len(lengths):
        epoch = flattening_grouped(lengths, budget, 0, size + 1)
        if max(int(t.sum()) for t in epoch.tokens) > budget:
            break
        size += 1
    return size


class TrlBfd:
    """TRL's bfd packing: the data set packed once into rows of ``max_length``, rows shuffled per epoch."""

    def __init__(self, lengths: np.ndarray, max_length: int = TRL_MAX_LENGTH) -> None:
        import datasets
        from trl import pack_dataset

        datasets.disable_progress_bar()
        # Each token is its example's index, so that a packed row says whose tokens it holds.
        table = datasets.Dataset.from_dict({"input_ids": [[i] * int(n) for i, n in enumerate(lengths)]})
        start = time.perf_counter()
        packed = pack_dataset(table, max_length, strategy="bfd")
        self.pack_s = time.perf_counter() - start
        self.rows: list[np.ndarray] = []
        self.row_tokens: list[np.ndarray] = []
        for ids, pieces in zip(packed["input_ids"], packed["seq_lengths"], strict=True):
            starts = np.cumsum([0, *pieces[:-1]])
            self.rows.append(np.asarray(ids, np.int64)[starts])
            self.row_tokens.append(np.asarray(pieces, np.int64))
        self.truncated = int(lengths.sum() - sum(int(t.sum()) for t in self.row_tokens))

    def epoch(self, budget: float, epoch: int) -> Epoch:
        per_batch = max(1, int(budget // TRL_MAX_LENGTH))
        order = np.random.default_rng([0, epoch]).permutation(len(self.rows))
        groups = [order[i : i + per_batch] for i in range(0, len(order), per_batch)]
        batches = [np.concatenate([self.rows[r] for r in g]) for g in groups]
        tokens = [np.concatenate([self.row_tokens[r] for r in g]) for g in groups]
        return Epoch(batches, tokens, truncated=self.truncated)


def axolotl_missing() -> str | None:
    """Why axolotl's multipack sampler cannot be imported here, or None."""
    try:
        import axolotl.utils.samplers.multipack  # noqa: F401
    except Exception as error:  # ImportError, or whatever its import chain raises
        return f"{type(error).__name__}: {error} (install: {AXOLOTL_INSTALL})"
    return None


class Multipack:
    """axolotl's ``MultipackBatchSampler`` as its trainer makes it (see the module)."""

    def __init__(self, lengths: np.ndarray, budget: int) -> None:
        import logging

        import torch
        from axolotl.utils.samplers.multipack import MultipackBatchSampler
        from torch.utils.data import RandomSampler

        logging.getLogger("axolotl").setLevel(logging.WARNING)
        self.lengths = lengths
        generator = torch.Generator().manual_seed(0)
        self.sampler = MultipackBatchSampler(
            RandomSampler(range(len(lengths)), generator=generator),
            batch_size=1,
            batch_max_len=budget,
            lengths=lengths,
            bin_size=200,
            group_size=100_000,
            num_processes=1,
            drop_last=True,
        )
        start = time.perf_counter()
        len(self.sampler)  # what its trainer does first: the epoch length, from 4 packings
        self.len_s = time.perf_counter() - start

    def epoch(self, epoch: int) -> Epoch:
        self.sampler.set_epoch(epoch)
        batches = [np.asarray([i for bin_ in batch for i in bin_], np.int64) for batch in self.sampler]
        return Epoch(batches, [self.lengths[b] for b in batches])


def tokenbatch_epoch(
    lengths: np.ndarray, budget: float, cost: CostModel, world: int
) -> Callable[[int], Epoch]:
    sampler = TokenBudgetBatchSampler(lengths, budget, cost=cost, seed=0, num_replicas=world)

    def make(epoch: int) -> Epoch:
        sampler.set_epoch(epoch)
        plan = sampler.plan
        batches = [plan.order[a:b] for a, b in zip(plan.offsets[:-1], plan.offsets[1:], strict=True)]
        return Epoch(batches, [lengths[b] for b in batches], padded=cost.packing is None)

    return make


# -- measuring ------------------------------------------------------------------------------------


def work(epoch: Epoch) -> tuple[np.ndarray, np.ndarray]:
    """Each batch's tokens in its rows and attention pairs (padded: rows x longest, rows x longest^2)."""
    if epoch.padded:
        rows = np.array([len(t) for t in epoch.tokens], np.float64)
        longest = np.array([t.max() for t in epoch.tokens], np.float64)
        return rows * longest, rows * longest**2
    return (
        np.array([t.sum() for t in epoch.tokens], np.float64),
        np.array([(t.astype(np.float64) ** 2).sum() for t in epoch.tokens]),
    )


def balance(values: np.ndarray, world: int) -> tuple[float, float]:
    """Mean and worst, over full steps, of the largest rank's ``values`` over the mean rank's."""
    steps = len(values) // world
    if world == 1 or steps == 0:
        return 1.0, 1.0
    per_step = values[: steps * world].reshape(steps, world)
    ratio = per_step.max(axis=1) / np.maximum(per_step.mean(axis=1), 1e-12)
    return float(ratio.mean()), float(ratio.max())


def measure(epoch: Epoch, lengths: np.ndarray, budget: float, world: int) -> dict[str, Any]:
    seen = np.bincount(np.concatenate(epoch.batches), minlength=len(lengths))
    real = np.array([t.sum() for t in epoch.tokens], np.float64)
    tokens, pairs = work(epoch)
    mean_l, worst_l = balance(tokens, world)
    mean_l2, worst_l2 = balance(pairs, world)
    return {
        "fill": float(real.mean() / budget),
        "max_batch_over_budget": float(tokens.max() / budget),
        "truncated": epoch.truncated / float(lengths.sum()),
        "steps": -(-len(epoch.batches) // world),
        "once": float(np.mean(seen == 1)),
        "balance_L": mean_l,
        "balance_L2": mean_l2,
        "worst_step_L": worst_l,
        "worst_step_L2": worst_l2,
    }


def timed(make: Callable[[int], Epoch], repeats: int = 3) -> tuple[Epoch, float]:
    """Epoch 0, and the median time of making epochs 1..repeats."""
    first = make(0)
    times = []
    for epoch in range(1, repeats + 1):
        start = time.perf_counter()
        make(epoch)
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def plan_rows(dataset: Dataset, quick: bool) -> tuple[list[dict[str, Any]], dict[str, Epoch]]:
    """A row per method and world size, and each method's epoch 0 on 2 ranks (for the training part)."""
    lengths, budget = dataset.lengths, dataset.budget
    size = fixed_count(lengths, budget)
    own = own_fit(lengths, budget, size) if not quick else size
    bfd = TrlBfd(lengths)
    missing = "left out with --quick (its import takes seconds)" if quick else axolotl_missing()
    multipack = None if missing else Multipack(lengths, budget)
    rows: list[dict[str, Any]] = []
    epochs: dict[str, Epoch] = {}
    for world in (1, 2):
        makers: dict[str, tuple[Callable[[int], Epoch] | None, str]] = {
            "trl_bfd": (
                lambda e: bfd.epoch(budget, e),
                f"rows of {TRL_MAX_LENGTH} x {budget // TRL_MAX_LENGTH}",
            ),
            "trl_padding_free": (lambda e: trl_padding_free(lengths, budget, e, size), f"{size} examples"),
            "flattening_grouped": (
                lambda e: flattening_grouped(lengths, budget, e, size),
                f"{size} examples",
            ),
            "flattening_grouped_own_fit": (
                (lambda e: flattening_grouped(lengths, budget, e, own), f"{own} examples")
                if own != size
                else (None, "same as flattening_grouped")
            ),
            "axolotl_multipack": (
                (multipack.epoch, f"1 bin of {budget}") if multipack else (None, f"not importable: {missing}")
            ),
            "tokenbatch_padded": (tokenbatch_epoch(lengths, budget, CostModel(), world), "budget (padded)"),
            "tokenbatch_packed": (tokenbatch_epoch(lengths, budget, PACKED, world), "budget"),
        }
        for method, (make, batch) in makers.items():
            row: dict[str, Any] = {
                "dataset": dataset.name,
                "budget": budget,
                "processes": world,
                "method": method,
                "batch": batch,
            }
            if make is None:
                rows.append({**row, "skipped": batch})
                continue
            epoch, seconds = timed(make)
            row.update(measure(epoch, lengths, budget, world), planning_s=seconds)
            if method == "trl_bfd":
                row["pack_s"] = bfd.pack_s  # once per run: the same packs every epoch
            if method == "axolotl_multipack" and multipack is not None:
                row["len_s"] = multipack.len_s
            rows.append(row)
            if world == 2 and method in TRAINED:
                epochs[method] = epoch
    return rows, epochs


# -- training throughput ---------------------------------------------------------------------------


def pick_steps(epoch: Epoch, world: int, count: int) -> list[list[list[int]]]:
    """``count`` evenly spaced full steps of ``epoch``: per step, per rank, the tokens of each example."""
    steps = len(epoch.tokens) // world
    chosen = np.unique(np.linspace(0, steps - 1, min(count, steps)).round().astype(int))
    return [[epoch.tokens[s * world + r].tolist() for r in range(world)] for s in chosen]


def model_config(vocab: int = 8192, hidden: int = 128, layers: int = 2, attention: str = "sdpa") -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(hidden * 2.75),
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 32),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        use_cache=False,
        attn_implementation=attention,
    )


def make_batch(tokens: list[int], padded: bool, vocab: int, device: Any, seed: int) -> dict[str, Any]:
    """A batch of random ids: padded rows (attention mask), or one flattened row (position ids)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    if padded:
        longest = max(tokens)
        ids = torch.randint(3, vocab, (len(tokens), longest), generator=generator)
        mask = (torch.arange(longest)[None] < torch.tensor(tokens)[:, None]).long()
        labels = ids.masked_fill(mask == 0, -100)
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device), "labels": labels.to(device)}
    total = sum(tokens)
    ids = torch.randint(3, vocab, (1, total), generator=generator)
    positions = torch.cat([torch.arange(n) for n in tokens])[None]
    labels = ids.masked_fill(positions == 0, -100)  # no example predicts the next one's first token
    cu = torch.tensor([0, *np.cumsum(tokens).tolist()], dtype=torch.int32)
    return {
        "input_ids": ids.to(device),
        "position_ids": positions.to(device),
        "labels": labels.to(device),
        "cu_seq_lens_q": cu.to(device),
        "cu_seq_lens_k": cu.to(device),
        "max_length_q": max(tokens),
        "max_length_k": max(tokens),
    }


def train_steps(
    model: Any,
    optimizer: Any,
    steps: list[list[list[int]]],
    *,
    padded: bool,
    rank: int,
    vocab: int,
    device: Any,
    sync: Callable[[], None],
    autocast: Any = None,
) -> tuple[float, int]:
    """Seconds for ``steps`` (after one untimed step) and the real tokens over all ranks."""
    import contextlib

    def one(step: list[list[int]], seed: int) -> None:
        batch = make_batch(step[rank], padded, vocab, device, seed)
        with autocast() if autocast else contextlib.nullcontext():
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one(steps[0], 0)
    sync()
    start = time.perf_counter()
    for number, step in enumerate(steps):
        one(step, number + 1)
    sync()
    return time.perf_counter() - start, sum(sum(sum(r) for r in s) for s in steps)


def worker(path: Path) -> None:
    """Under torchrun: train each method's steps in ``path`` (JSON), rounds interleaved; rank 0 writes."""
    import torch
    import torch.distributed as dist
    from transformers import LlamaForCausalLM

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    job = json.loads(path.read_text())
    config = model_config()
    results: dict[str, list[float]] = {}
    for _ in range(job["rounds"]):
        for key, entry in job["runs"].items():
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(LlamaForCausalLM(config))
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            seconds, tokens = train_steps(
                model,
                optimizer,
                entry["steps"],
                padded=entry["padded"],
                rank=rank,
                vocab=config.vocab_size,
                device=torch.device("cpu"),
                sync=dist.barrier,
            )
            results.setdefault(key, []).append(tokens / seconds)
    if rank == 0:
        path.with_suffix(".out.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def throughput(epochs: dict[tuple[str, str], Epoch], steps: int, rounds: int) -> dict[tuple[str, str], float]:
    """Median real tokens/s of each ``(dataset, method)`` epoch's evenly spaced steps, 2 CPU processes."""
    runs = {
        f"{d}/{m}": {"steps": pick_steps(e, 2, steps), "padded": e.padded} for (d, m), e in epochs.items()
    }
    with tempfile.TemporaryDirectory() as folder:
        job = Path(folder) / "job.json"
        job.write_text(json.dumps({"rounds": rounds, "runs": runs}))
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(common.REPO)}
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
        command += ["-m", "benchmarks.packing", "--worker", str(job)]
        subprocess.run(command, env=env, cwd=common.REPO, check=True)
        found = json.loads(job.with_suffix(".out.json").read_text())
    return {tuple(key.split("/")): statistics.median(v) for key, v in found.items()}  # type: ignore[misc]


def gpu_rows(device: Any, lengths: np.ndarray, budget: int, *, tiny: bool) -> dict[str, Any]:
    """For ``benchmarks/gpu.py``: tokens/s of padded and packed batches on one GPU, flash-attention varlen.

    A Llama of 8 layers, hidden 1024 (``tiny``: 1 layer, hidden 32, sdpa), bf16
    autocast, on the same evenly spaced steps of each method's epoch, the
    methods interleaved over 3 rounds (``tiny``: 2 steps, 1 round). Attention is flash-attention 2 where
    ``flash_attn`` imports (the varlen kernel: each example of a pack on its
    own), else sdpa, and the rows say which.
    """
    import torch
    from transformers import LlamaForCausalLM

    try:
        import flash_attn  # noqa: F401

        attention = "flash_attention_2"
    except ImportError as error:
        attention = "sdpa"
        why = f"flash_attn not importable ({error}): sdpa, which attends over each pack's whole row"
    if tiny:  # a check of the script: a tiny model, whatever the device
        attention = "sdpa"
        config = model_config(vocab=256, hidden=32, layers=1)
    else:
        config = model_config(vocab=32000, hidden=1024, layers=8, attention=attention)
    size = fixed_count(lengths, budget)
    epochs = {
        "trl_padding_free": trl_padding_free(lengths, budget, 0, size),
        "tokenbatch_padded": tokenbatch_epoch(lengths, budget, CostModel(), 1)(0),
        "tokenbatch_packed": tokenbatch_epoch(lengths, budget, PACKED, 1)(0),
    }
    bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if bf16 else None
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    found: dict[str, list[float]] = {}
    steps, rounds = (2, 1) if tiny else (8, 3)
    for _ in range(rounds):
        for method, epoch in epochs.items():
            torch.manual_seed(0)
            model = LlamaForCausalLM(config).to(device)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            seconds, tokens = train_steps(
                model,
                optimizer,
                pick_steps(epoch, 1, steps),
                padded=epoch.padded,
                rank=0,
                vocab=config.vocab_size,
                device=device,
                sync=sync,
                autocast=autocast,
            )
            found.setdefault(method, []).append(tokens / seconds)
            del model, optimizer
    rows = []
    for method, values in found.items():
        stats = measure(epochs[method], lengths, budget, 1)
        row = {"method": method, "attention": config._attn_implementation, "budget": budget}
        row.update(
            steps_per_epoch=stats["steps"], fill=stats["fill"], real_tokens_per_s=statistics.median(values)
        )
        rows.append(row)
    return {"rows": rows, **({"note": why} if attention == "sdpa" else {})}


# -- the report ------------------------------------------------------------------------------------

COLUMNS = ["dataset", "processes", "method", "batch", "fill", "truncated", "steps", "once"]
COLUMNS += ["balance_L", "balance_L2", "planning_s", "tokens_per_s"]


def markdown(rows: list[dict[str, Any]], datasets: list[Dataset], note: str) -> str:
    parts = ["Data: " + "; ".join(f"{d.name}: {d.source}, B={d.budget}" for d in datasets) + ".", note]
    shown = []
    for row in rows:
        if "skipped" in row:
            shown.append({**{k: row[k] for k in ("dataset", "processes", "method")}, "batch": row["skipped"]})
        else:
            shown.append(row)
    parts.append(common.markdown_table(shown, COLUMNS))
    return "\n\n".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.parser("packing", __doc__.splitlines()[0] if __doc__ else "")
    parser.add_argument("--worker", type=Path, help=argparse_hidden())
    parser.add_argument("--steps", type=int, default=4, help="training steps per method (not with --quick)")
    args = parser.parse_args(argv)
    if args.worker is not None:
        worker(args.worker)
        return 0
    import transformers

    transformers.logging.set_verbosity_error()
    data = load(args.quick)
    rows: list[dict[str, Any]] = []
    epochs: dict[tuple[str, str], Epoch] = {}
    for dataset in data:
        found, trained = plan_rows(dataset, args.quick)
        rows += found
        epochs.update({(dataset.name, m): e for m, e in trained.items()})
        print(f"[packing] {dataset.name}: planned", flush=True)
    if args.quick:
        note = "--quick: small synthetic data, no axolotl, no training (tokens_per_s)."
    else:
        speeds = throughput(epochs, args.steps, rounds=3)
        for row in rows:
            speed = speeds.get((row["dataset"], row["method"]))
            if speed is not None and row["processes"] == 2:
                row["tokens_per_s"] = speed
        note = (
            f"tokens_per_s: a small Llama (2 layers, hidden 128, vocabulary 8192, sdpa) trained on CPU by 2 "
            f"processes (DDP, gloo), {args.steps} evenly spaced steps of each method's 2-rank epoch, median "
            f"of 3 interleaved rounds: on the 2-process rows."
        )
    results = {"datasets": {d.name: {"source": d.source, "budget": d.budget} for d in data}, "rows": rows}
    common.write_results("packing", args.out, results, markdown(rows, data, note))
    return 0


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    sys.exit(main())
