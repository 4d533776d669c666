"""What one out-of-memory error costs an epoch, and what the OOM guard costs when none happens.

Two measurements on all-MiniLM-L6-v2 (a real pretrained BERT) fine-tuned on
the emotion data (or a synthetic stand-in when the data is not beside the
checkout), on CPU:

1. **Recovery**, one process: an epoch with one OOM injected in the middle
   (``tokenbatch.testing.inject_oom``, a real ``torch.OutOfMemoryError``),
   against the same epoch without it, for ``OOMFallback`` in ``split`` and
   ``halve`` mode, and for the seed's approach: accelerate's
   ``find_executable_batch_size`` around the whole training function (fixed
   batch size, model loaded inside), which starts again from scratch.
2. **Guard overhead**, two processes (torchrun, gloo, DDP through
   ``accelerator.prepare``): each batch is trained once through
   ``fallback.backward`` and once through the plain ``accelerator.backward``
   loop, in alternating order, and the paired step times are compared.

Run: ``python -m benchmarks.oom_recovery [--quick]``.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file by torchrun: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import torch

from benchmarks.common import REPO, data_dir, markdown_table, minilm_path, parser, read_jsonl, write_results

NAME = "oom_recovery"
_VOCABULARY = (
    "i feel so really just not that like very much today when about still know think good bad happy sad "
    "angry afraid love surprised little bit more time people day life going get want something way"
)
WORDS = _VOCABULARY.split()


def rows(count: int, seed: int = 0) -> tuple[list[dict[str, Any]], str]:
    """``count`` emotion training rows (shuffled), or synthetic ones like them; and which it was."""
    root = data_dir()
    rng = np.random.default_rng(seed)
    if root is not None:
        data = read_jsonl(root / "emotion" / "train.jsonl")
        picked = rng.permutation(len(data))[:count]
        return [data[i] for i in picked], "emotion"
    lengths = np.clip(rng.lognormal(np.log(17), 0.5, count).astype(int), 2, 66)
    texts = [" ".join(rng.choice(WORDS, n)) for n in lengths]
    return [{"text": t, "label": int(rng.integers(6))} for t in texts], "synthetic"


def setup(count: int) -> tuple[list[dict[str, Any]], Any, str]:
    """Tokenized rows (``input_ids``, ``attention_mask``, ``label``) and a padding collator."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    from transformers import AutoTokenizer, DataCollatorWithPadding

    texts, source = rows(count)
    tokenizer = AutoTokenizer.from_pretrained(minilm_path())
    encoded = tokenizer([r["text"] for r in texts], truncation=True, max_length=128)
    data = [
        {"input_ids": ids, "attention_mask": mask, "label": r["label"]}
        for ids, mask, r in zip(encoded["input_ids"], encoded["attention_mask"], texts, strict=True)
    ]
    return data, DataCollatorWithPadding(tokenizer), source


def load_model() -> torch.nn.Module:
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model: torch.nn.Module = AutoModelForSequenceClassification.from_pretrained(minilm_path(), num_labels=6)
    return model


def forward(model: torch.nn.Module) -> Any:
    return lambda batch: model(**batch).loss


# -- 1. recovery from one OOM, one process -----------------------------------------------------


def run_tokenbatch(
    data: list[dict[str, Any]],
    collator: Any,
    budget: float,
    mode: str,
    oom_at: int | None,
    micro_tokens: float | None = None,
) -> dict[str, Any]:
    """One epoch under ``OOMFallback``; the model is loaded before the clock starts.

    ``micro_tokens`` starts split mode at that micro-batch budget, as a
    resumed run (``fallback.load_state_dict``) or a remembered budget (``fallback.start_from``) would.
    """
    from torch.utils.data import DataLoader

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler
    from tokenbatch.testing import inject_oom

    model = load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in data], budget, seed=0)
    loader: DataLoader[Any] = DataLoader(data, batch_sampler=sampler, collate_fn=collator)  # type: ignore[arg-type]
    fallback = OOMFallback(sampler, model, mode=mode)
    if micro_tokens is not None:
        fallback.start_from(micro_tokens)
    if oom_at is not None:
        inject_oom(model, 0, after=oom_at, times=1)
    steps: list[float] = []
    start, cpu = time.perf_counter(), time.process_time()
    for batch in fallback.iterate(loader):
        began = time.perf_counter()
        if fallback.backward(batch, forward(model)) is not None:
            optimizer.step()
            optimizer.zero_grad()
        steps.append(time.perf_counter() - began)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {
        "seconds": seconds,
        "cpu_seconds": cpu,
        "steps": len(steps),
        "step_seconds": steps,
        "events": [e.as_dict() for e in fallback.events],
        "max_tokens": fallback.max_tokens,
    }


def run_seed(
    data: list[dict[str, Any]], collator: Any, batch_size: int, oom_at: int | None
) -> dict[str, Any]:
    """The seed's approach: the whole training function under ``find_executable_batch_size``."""
    from accelerate.utils import find_executable_batch_size
    from torch.utils.data import DataLoader

    from tokenbatch.testing import inject_oom

    fired = [0]
    tries: list[int] = []

    @find_executable_batch_size(starting_batch_size=batch_size)  # type: ignore[untyped-decorator]
    def train(batch_size: int) -> None:
        tries.append(batch_size)
        model = load_model()  # the whole function reruns after an OOM: model, optimizer, epoch
        optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
        generator = torch.Generator().manual_seed(0)
        loader: DataLoader[Any] = DataLoader(
            data,  # type: ignore[arg-type]
            batch_size=batch_size,
            shuffle=True,
            generator=generator,
            collate_fn=collator,
        )
        injector = (
            inject_oom(model, 0, after=oom_at, times=1) if oom_at is not None and not fired[0] else None
        )
        try:
            for batch in loader:
                loss = model(**batch).loss
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        finally:
            fired[0] += 0 if injector is None else injector.count

    start, cpu = time.perf_counter(), time.process_time()
    train()
    return {
        "seconds": time.perf_counter() - start,
        "cpu_seconds": time.process_time() - cpu,
        "batch_sizes": tries,
    }


def recovery(data: list[dict[str, Any]], collator: Any, budget: int, repeats: int) -> dict[str, Any]:
    """Median epoch times with and without one OOM in the middle, for each approach, interleaved.

    Two baselines for each approach: the same run without the OOM, and a run
    without OOM that uses from the start the setting the OOM led to (the
    smaller budget, the smaller batch size): the first counts everything the
    OOM changed, the second only what recovering mid-epoch cost.
    """
    from tokenbatch import TokenBudgetBatchSampler

    num_steps = len(TokenBudgetBatchSampler([len(r["input_ids"]) for r in data], budget, seed=0))
    batch_size = math.ceil(len(data) / num_steps)  # the seed's fixed batch size: as many steps
    middle = num_steps // 2
    # An untimed run first: it warms up the libraries and tells the budget the OOM leads to.
    recovered = run_tokenbatch(data, collator, budget, "split", middle)["max_tokens"]
    smaller = int(batch_size * 0.9)  # find_executable_batch_size's default reduction
    runs: dict[str, Any] = {
        "tokenbatch, no OOM": lambda: run_tokenbatch(data, collator, budget, "split", None),
        "split, OOM": lambda: run_tokenbatch(data, collator, budget, "split", middle),
        "split, recovered": lambda: run_tokenbatch(data, collator, budget, "split", None, recovered),
        "halve, OOM": lambda: run_tokenbatch(data, collator, budget, "halve", middle),
        "halve, recovered": lambda: run_tokenbatch(data, collator, recovered, "halve", None),
        "seed, no OOM": lambda: run_seed(data, collator, batch_size, None),
        "seed, OOM": lambda: run_seed(data, collator, batch_size, middle),
        "seed, recovered": lambda: run_seed(data, collator, smaller, None),
    }
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    names = list(runs)
    for repeat in range(repeats):
        for name in names[repeat % len(names) :] + names[: repeat % len(names)]:  # rotate the order
            results[name].append(runs[name]())
            print(f"  {name}: {results[name][-1]['seconds']:.1f} s", file=sys.stderr, flush=True)
    wall = {name: statistics.median(r["seconds"] for r in rs) for name, rs in results.items()}
    cpu = {name: statistics.median(r["cpu_seconds"] for r in rs) for name, rs in results.items()}
    table = []
    for name, label, base in (
        ("split", "OOMFallback split", "tokenbatch, no OOM"),
        ("halve", "OOMFallback halve", "tokenbatch, no OOM"),
        ("seed", "find_executable_batch_size (seed)", "seed, no OOM"),
    ):
        oom, again, last = f"{name}, OOM", f"{name}, recovered", results[f"{name}, OOM"][-1]
        table.append(
            {
                "approach": label,
                "no OOM s": wall[base],
                "one OOM s": wall[oom],
                "ratio": wall[oom] / wall[base],
                "CPU ratio": cpu[oom] / cpu[base],
                "recovered setting from the start s": wall[again],
                "ratio to it": wall[oom] / wall[again],
                "CPU ratio to it": cpu[oom] / cpu[again],
                "steps": last.get("steps", "-"),
                "after the OOM": f"max_tokens {last['max_tokens']:g}"
                if "max_tokens" in last
                else f"batch size {' -> '.join(map(str, last['batch_sizes']))}",
            }
        )
    return {
        "num_steps": num_steps,
        "seed_batch_size": batch_size,
        "oom_at_step": middle,
        "recovered_max_tokens": recovered,
        "recovered_batch_size": smaller,
        "median_seconds": wall,
        "median_cpu_seconds": cpu,
        "table": table,
        "runs": results,
    }


# -- 2. guard overhead, two processes ---------------------------------------------------------


def overhead_worker(out: Path, count: int, budget: int, pairs: int) -> None:
    """Under torchrun: each batch trained once guarded and once plain, alternating; rank 0 writes times."""
    torch.set_num_threads(1)
    from accelerate import Accelerator
    from torch.utils.data import DataLoader

    from tokenbatch import OOMFallback, TokenBudgetBatchSampler

    accelerator = Accelerator(cpu=True)
    data, collator, source = setup(count)
    model = load_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-5)
    sampler = TokenBudgetBatchSampler([len(r["input_ids"]) for r in data], budget, seed=0)
    loader: DataLoader[Any] = DataLoader(data, batch_sampler=sampler, collate_fn=collator)  # type: ignore[arg-type]
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator)
    loss_fn = forward(model)
    times: dict[str, list[float]] = {"guarded": [], "plain": []}
    for index, batch in enumerate(loader):
        if index >= pairs + 1:
            break
        for name in ("guarded", "plain") if index % 2 == 0 else ("plain", "guarded"):
            accelerator.wait_for_everyone()  # both ranks start the step together
            began = time.perf_counter()
            if name == "guarded":
                fallback.backward(batch, loss_fn)
            else:
                accelerator.backward(loss_fn(batch))
            optimizer.step()
            optimizer.zero_grad()
            if index > 0:  # the first pair warms up
                times[name].append(time.perf_counter() - began)
    if accelerator.is_main_process:
        out.write_text(
            json.dumps({"times": times, "source": source, "world_size": accelerator.num_processes})
        )
    accelerator.wait_for_everyone()


def overhead(count: int, budget: int, pairs: int) -> dict[str, Any]:
    """Launch the 2-process overhead measurement and summarise it."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "overhead.json"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error",
        }
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            __file__,
            "--worker",
            str(out),
            str(count),
            str(budget),
            str(pairs),
        ]
        subprocess.run(command, env=env, check=True, timeout=1800)
        result = json.loads(out.read_text())
    guarded, plain = result["times"]["guarded"], result["times"]["plain"]
    ratios = [g / p for g, p in zip(guarded, plain, strict=True)]
    return {
        "pairs": len(ratios),
        "median_step_s_guarded": statistics.median(guarded),
        "median_step_s_plain": statistics.median(plain),
        "median_paired_ratio": statistics.median(ratios),
        "total_ratio": sum(guarded) / sum(plain),
        "overhead_percent": 100 * (statistics.median(ratios) - 1),
        "times": result["times"],
    }


COLUMNS = [
    "approach",
    "no OOM s",
    "one OOM s",
    "ratio",
    "CPU ratio",
    "recovered setting from the start s",
    "ratio to it",
    "CPU ratio to it",
    "steps",
    "after the OOM",
]


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parser(NAME, __doc__.splitlines()[0]).parse_args(argv)
    torch.set_num_threads(1)
    count, repeats, pairs = (48, 1, 1) if args.smoke else (48, 1, 3) if args.quick else (480, 3, 30)
    budget = 512
    data, collator, source = setup(count)
    print(f"recovery: {count} {source} rows, max_tokens={budget}, {repeats} repeat(s)", file=sys.stderr)
    rec = recovery(data, collator, budget, repeats)
    print(f"overhead: 2 processes, {pairs} paired steps", file=sys.stderr)
    ovh = overhead(48 * (pairs + 2), budget, pairs)  # about 24 rows a batch, 2 ranks
    markdown = f"""## One OOM in the middle of an epoch (1 process, CPU, all-MiniLM-L6-v2, {source} data)

{count} samples, max_tokens={budget} ({rec["num_steps"]} steps; the seed's fixed batch size
{rec["seed_batch_size"]} gives as many); one `torch.OutOfMemoryError` injected in the forward pass
of step {rec["oom_at_step"]}. Epoch times are medians of {repeats} interleaved run(s) each; the
ratios are also given in this process's CPU time, which the other jobs sharing this machine
disturb less than the wall clock. tokenbatch epochs are timed after the model is loaded; the
seed's time is its whole training function, which loads the model inside and again after the OOM.
"ratio" compares with the same run without OOM; "ratio to it" with a run that uses from the
start the setting the OOM led to (max_tokens {rec["recovered_max_tokens"]:g}, batch size
{rec["recovered_batch_size"]}), so it counts only what recovering in the middle of the epoch cost.

{markdown_table(rec["table"], COLUMNS)}

## Guard overhead without OOM (2 processes, gloo, DDP via accelerate)

{ovh["pairs"]} batches, each trained once through `fallback.backward` and once through the plain
`accelerator.backward` loop in alternating order: median step {ovh["median_step_s_guarded"]:.3f} s
guarded vs {ovh["median_step_s_plain"]:.3f} s plain; median paired ratio
{ovh["median_paired_ratio"]:.3f} ({ovh["overhead_percent"]:+.1f}%), total-time ratio {ovh["total_ratio"]:.3f}.
"""
    results = {"data": source, "num_samples": count, "max_tokens": budget, "recovery": rec, "overhead": ovh}
    write_results(NAME, args.out, results, markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        overhead_worker(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
