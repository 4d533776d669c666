"""The analytic memory estimate for causal LMs against the measured peak of one training step (CPU).

For Llama with grouped-query attention (untied embeddings, SwiGLU, RMSNorm, RoPE, no dropout)
and GPT-2 (``n_embd``/``n_head``/``n_layer``/``n_positions``, tied embeddings, dropout 0.1,
Python ``gelu_new``), at three sizes, in eager and sdpa attention, built from configs with
random weights:

* predicted: ``MemoryModel.from_config(config, device="cpu", task="causal-lm").predict(B, L)``,
  the larger of the optimizer step's peak and weights + AdamW state + the batch's activations,
  the vocabulary's logits with the loss's fp32 buffers included;
* measured: the probe's own measurement (``tokenbatch.probe._measure.measure_peak``): the torch
  profiler's count of PyTorch's CPU allocations during one forward + backward + AdamW step on a
  worst-case batch after a warm-up step, plus the bytes already held; the larger of its two
  phases (forward + backward, optimizer step). It is exact and repeatable to the byte, where the
  process's RSS keeps freed heap pages and would show the largest step run so far;
* under a memory limit: for the longest shape of the small and medium models, the same step
  in a fresh process (``MALLOC_MMAP_THRESHOLD_=65536``: every tensor of 64 KiB or more gets its
  own mapping, given back when freed, so address space tracks tensor bytes), after a warm-up
  step, in a fork under ``RLIMIT_AS`` set to its address space plus 1.15x, then 0.85x, the
  predicted room (predicted peak minus the weights and optimizer state already held): whether
  the step trains. The step keeps the model's output (its logits) through backward, as the
  probe does; a loop that keeps only the loss frees one ``B*L*V`` tensor earlier;
* the largest term of the estimate at that shape: the optimizer step, the logits (``B*L*V``
  in fp32 four times: logits, log-softmax, its gradient and the loss's), the attention
  scores (``B*H*L*L``) or the layers' other activations.

With ``--dtype bfloat16`` the models train in bf16 (weights, activations and AdamW state; the
loss upcasts the logits to fp32), without the limit trials, and the results are the variant
``decoder_memory-bfloat16``.

Usage: ``python -m benchmarks.decoder_memory [--quick] [--dtype D] [--out DIR]`` (``--quick``: the two
smaller sizes, a few minutes on a shared 2-core CPU; 15-20 without). Not part of
``python -m benchmarks``, whose quick suite must stay near a minute a benchmark;
``benchmarks.report`` shows its results when present.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from benchmarks import common

MiB = 2**20
# name: (hidden, layers, heads, key/value heads (Llama), vocabulary)
SIZES = {
    "small": (64, 2, 4, 2, 8000),
    "medium": (256, 4, 8, 2, 16000),
    "large": (512, 4, 8, 2, 32000),
}
SHAPES = ((1, 16), (16, 32), (2, 512), (1, 1024))  # (batch size, length)
LIMIT_SIZES = ("small", "medium")  # a large model's trials take minutes on a shared CPU
LIMIT_FACTORS = (1.15, 0.85)


def build(family: str, size: str, attn: str) -> Any:
    """A causal LM of ``family`` and ``size`` with random weights (seed 0)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    h, layers, heads, kv, vocab = SIZES[size]
    torch.manual_seed(0)
    if family == "llama-gqa":
        config = LlamaConfig(
            vocab_size=vocab,
            hidden_size=h,
            intermediate_size=int(h * 8 / 3) // 8 * 8,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            max_position_embeddings=max(length for _, length in SHAPES),
        )
        config._attn_implementation = attn
        return LlamaForCausalLM(config)
    config = GPT2Config(
        vocab_size=vocab,
        n_embd=h,
        n_layer=layers,
        n_head=heads,
        n_positions=max(length for _, length in SHAPES),
        bos_token_id=0,
        eos_token_id=0,
    )
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


def largest_term(estimate: Any, logits_per_token: float, batch: int, length: int) -> str:
    """Which part of the estimate is the largest at this shape."""
    line = estimate.constant + estimate.cost_model().cost(batch, length)
    if estimate.step_peak >= line:
        return "optimizer step"
    tokens = batch * length
    parts = {
        "logits": logits_per_token * tokens,
        "scores": estimate.quadratic * batch * length**2,
        "layers": (estimate.linear - logits_per_token) * tokens,
    }
    name = max(parts, key=parts.__getitem__)
    return f"{name} ({parts[name] / (line - estimate.constant):.0%})"


def limit_trials(spec: dict[str, Any]) -> None:
    """In a fresh interpreter started with ``MALLOC_MMAP_THRESHOLD_=65536``: build the model, warm
    it up, then run one step of ``spec["shape"]`` in a fork per room of ``spec["rooms"]`` under
    ``RLIMIT_AS`` = the fork's address space + that room; print whether each trained, as JSON.

    A fresh process, so that no freed heap of earlier steps hides inside its address space."""
    import accelerate.utils.memory  # noqa: F401  (is_oom asks it; not to be imported under the limit)
    import torch

    from tokenbatch import is_oom
    from tokenbatch.probe._measure import synthetic_batch

    torch.set_num_threads(1)
    model = build(spec["family"], spec["size"], spec["attention"]).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step(size: int, length: int) -> None:
        batch = synthetic_batch(model, size, length, torch.Generator().manual_seed(0))
        output = model(**batch)  # kept through backward, its logits too, as the probe does
        output.loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def trial(room: float) -> dict[str, Any]:
        base = common.vm_status("VmSize")
        resource.setrlimit(resource.RLIMIT_AS, (base + int(room), resource.RLIM_INFINITY))
        try:
            step(*spec["shape"])
        except Exception as error:
            if not is_oom(error):
                raise
            return {"ok": False}
        return {"ok": True}

    step(1, 8)  # warm-up: AdamW's state exists, as in measure_peak
    gc.collect()
    print(json.dumps([common.in_fork(functools.partial(trial, room)) for room in spec["rooms"]]))


def under_limit(family: str, size: str, attn: str, shape: tuple[int, int], rooms: list[float]) -> list[str]:
    """``"yes"`` or ``"OOM"`` for each room: see :func:`limit_trials`."""
    spec = {"family": family, "size": size, "attention": attn, "shape": shape, "rooms": rooms}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "benchmarks.decoder_memory", "--child", json.dumps(spec)]
    done = subprocess.run(command, env=env, cwd=common.REPO, capture_output=True, text=True, check=True)
    reports = json.loads(done.stdout.strip().splitlines()[-1])
    crashed = [r["crash"] for r in reports if "crash" in r]
    if crashed:
        raise RuntimeError(f"a limit trial crashed: {crashed[0]}")
    return ["yes" if r["ok"] else "OOM" for r in reports]


def run_model(family: str, size: str, attn: str, dtype: str) -> list[dict[str, Any]]:
    """One row per shape for one model; the longest shape also tried under RLIMIT_AS."""
    import torch

    from tokenbatch.probe import MemoryModel
    from tokenbatch.probe._measure import measure_peak

    model = build(family, size, attn).to(getattr(torch, dtype))
    config = model.config
    options: dict[str, Any] = {"device": "cpu", "dtype": getattr(torch, dtype)}
    estimate = MemoryModel.from_config(config, task="causal-lm", **options)
    base = MemoryModel.from_config(config, task="base", **options)
    logits_per_token = estimate.linear - base.linear
    params = sum(p.numel() for p in model.parameters())
    rows = []
    for batch, length in SHAPES:
        measured = measure_peak(model, batch, length)
        predicted = estimate.predict(batch, length)
        rows.append(
            {
                "family": family,
                "size": size,
                "params_m": params / 1e6,
                "attention": attn,
                "dtype": dtype,
                "shape": f"{batch}x{length}",
                "largest_term": largest_term(estimate, logits_per_token, batch, length),
                "measured_mib": measured.peak_bytes / MiB,
                "forward_backward_mib": measured.forward_backward_bytes / MiB,
                "optimizer_step_mib": measured.optimizer_step_bytes / MiB,
                "predicted_mib": predicted / MiB,
                "predicted_over_measured": predicted / measured.peak_bytes,
            }
        )
    if size in LIMIT_SIZES and dtype == "float32":
        shape = SHAPES[-1]
        room = estimate.predict(*shape) - estimate.constant  # weights + AdamW state are held
        trained = under_limit(family, size, attn, shape, [factor * room for factor in LIMIT_FACTORS])
        for factor, result in zip(LIMIT_FACTORS, trained, strict=True):
            rows[-1][f"trains_at_{factor}x_room"] = result
    print(
        f"{family} {size} {attn}: "
        + ", ".join(f"{r['shape']} {r['predicted_over_measured']:.3f}" for r in rows),
        file=sys.stderr,
        flush=True,
    )
    del model
    gc.collect()
    return rows


def markdown(rows: list[dict[str, Any]], dtype: str) -> str:
    ratios = [r["predicted_over_measured"] for r in rows]
    limit_columns = [f"trains_at_{f}x_room" for f in LIMIT_FACTORS]
    limits = [r for r in rows if limit_columns[0] in r]
    held = sum(r[limit_columns[0]] == "yes" and r[limit_columns[1]] == "OOM" for r in limits)
    under = (
        "Under RLIMIT_AS (longest shape of the small and medium models, in a fork, mmap threshold "
        f"64 KiB): {held} of {len(limits)} trained with 1.15x the predicted room and ran out of "
        "memory with 0.85x."
        if limits
        else "No limit trials in this dtype."
    )
    return (
        f"Predicted (`MemoryModel.from_config(config, device='cpu', task='causal-lm', dtype=torch.{dtype})`) "
        f"against the measured peak of one training step (forward + backward + AdamW step, {dtype} "
        "weights and activations, CPU; the probe's torch-profiler count of PyTorch's allocations), "
        f"random weights, 1 thread. predicted/measured over all {len(rows)} rows: {min(ratios):.3f} "
        f"to {max(ratios):.3f}. {under}\n\n"
        + common.markdown_table(
            rows,
            [
                "family",
                "size",
                "params_m",
                "attention",
                "dtype",
                "shape",
                "largest_term",
                "measured_mib",
                "predicted_mib",
                "predicted_over_measured",
                *limit_columns,
            ],
        )
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark; see the module docstring."""
    parser = common.parser("decoder_memory", __doc__.splitlines()[0] if __doc__ else "decoder_memory")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="weights and activations (bfloat16: no limit trials; results as a variant)",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        limit_trials(json.loads(args.child))
        return 0
    import torch

    torch.set_num_threads(1)  # small ops: a second thread only waits for a core on a busy machine
    sizes = ("small", "medium") if args.quick else tuple(SIZES)
    rows = []
    for family in ("llama-gqa", "gpt2"):
        for size in sizes:
            for attn in ("eager", "sdpa"):
                rows += run_model(family, size, attn, args.dtype)
    text = markdown(rows, args.dtype)
    variant = None if args.dtype == "float32" else args.dtype
    common.write_results("decoder_memory", args.out, {"quick": args.quick, "rows": rows}, text, variant)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
