"""The memory estimate under FSDP2 against the measured peak of one training step on each rank (CPU, gloo).

Llama with grouped-query attention (``benchmarks/decoder_memory.py``'s three sizes, sdpa, fp32,
random weights) sharded as accelerate's FSDP2 plugin shards it: ``fully_shard`` on each decoder
layer, on the input embeddings and on the root (which keeps the LM head and the final norm), on
2 processes under ``torchrun``, AdamW. Per shape, after a warm-up step:

* measured: each rank's peak as the probe measures it (``tokenbatch.probe._measure``): the torch
  profiler's count of PyTorch's CPU allocations during forward + backward, then the AdamW step,
  plus the bytes the rank holds before (its shards of the weights and of AdamW's state); the
  larger phase, the larger rank. The model's output is kept through backward, as the probe does;
* predicted: ``MemoryModel.from_config(config, device="cpu", task="causal-lm", shards=2)``;
* divided only: the unsharded estimate with weights, gradients and state halved and nothing
  for what FSDP all-gathers, to show what that costs.

Usage: ``python -m benchmarks.fsdp_memory [--quick] [--out DIR]`` (``--quick``: the two smaller
sizes, a few minutes). Not part of ``python -m benchmarks``; ``benchmarks.report`` shows its
results when present.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import common

MiB = 2**20
SIZES = {  # name: (hidden, layers, heads, key/value heads, vocabulary), as benchmarks/decoder_memory.py
    "small": (64, 2, 4, 2, 8000),
    "medium": (256, 4, 8, 2, 16000),
    "large": (512, 4, 8, 2, 32000),
}
SHAPES = ((1, 16), (16, 32), (2, 512), (1, 1024))  # (batch size, length)
PROCESSES = 2


def config(size: str) -> Any:
    from transformers import LlamaConfig

    h, layers, heads, kv, vocab = SIZES[size]
    result = LlamaConfig(
        vocab_size=vocab,
        hidden_size=h,
        intermediate_size=int(h * 8 / 3) // 8 * 8,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max(length for _, length in SHAPES),
    )
    result._attn_implementation = "sdpa"
    return result


def worker(size: str, out: str) -> None:
    """Under torchrun: shard the model, measure each shape on this rank, write ``out/rank<r>.json``."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaForCausalLM

    from tokenbatch.probe._measure import _cpu_phase_peaks, synthetic_batch

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config(size))
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model.model.embed_tokens)
    fully_shard(model)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def held() -> int:
        """Bytes of this rank's storages: its shards of the weights, gradients and optimizer state."""
        storages: dict[int, int] = {}
        tensors = [*model.parameters(), *model.buffers()]
        tensors += [p.grad for p in model.parameters() if p.grad is not None]
        tensors += [v for state in optimizer.state.values() for v in state.values()]
        for tensor in tensors:
            if isinstance(tensor, torch.Tensor):
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                storage = local.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def passes(batch: dict[str, torch.Tensor]) -> None:
        output = model(**batch)  # kept through backward, as the probe does
        output.loss.backward()

    def step() -> None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    warm = synthetic_batch(model, 1, 8, torch.Generator().manual_seed(0))
    passes(warm)
    step()
    rows = []
    for batch_size, length in SHAPES:
        batch = synthetic_batch(model, batch_size, length, torch.Generator().manual_seed(0))
        base = held()
        peak_first, net_first, peak_second = _cpu_phase_peaks(lambda b=batch: passes(b), step)
        rows.append(
            {
                "shape": f"{batch_size}x{length}",
                "held": base,
                "forward_backward": base + peak_first,
                "optimizer_step": base + net_first + peak_second,
            }
        )
    params = sum(p.numel() for p in model.parameters())  # the whole model's: DTensors count all shards
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps({"params": params, "rows": rows}))
    dist.destroy_process_group()


def measure(size: str) -> tuple[int, list[dict[str, Any]]]:
    """Run the worker on ``PROCESSES`` processes: the parameters, and per shape the larger rank's figures."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(common.REPO), env.get("PYTHONPATH")) if p)
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += ["--nproc_per_node", str(PROCESSES), "-m", "benchmarks.fsdp_memory", "--worker", size, out]
        subprocess.run(command, env=env, check=True, capture_output=True, text=True)
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(PROCESSES)]
    per_shape = zip(*(rank["rows"] for rank in ranks), strict=True)
    larger = [max(rows, key=lambda r: max(r["forward_backward"], r["optimizer_step"])) for rows in per_shape]
    return ranks[0]["params"], larger


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        worker(*argv[1:3])
        return 0
    import torch

    from tokenbatch.probe import MemoryModel

    parser = common.parser("fsdp_memory", __doc__.splitlines()[0] if __doc__ else "fsdp_memory")
    args = parser.parse_args(argv)
    sizes = ("small", "medium") if args.quick else tuple(SIZES)
    rows = []
    for size in sizes:
        estimate = MemoryModel.from_config(config(size), device="cpu", task="causal-lm", shards=PROCESSES)
        whole = MemoryModel.from_config(config(size), device="cpu", task="causal-lm")
        params, shapes = measure(size)
        for (batch_size, length), measured in zip(SHAPES, shapes, strict=True):
            peak = max(measured["forward_backward"], measured["optimizer_step"])
            divided = float(
                max(
                    whole.step_peak / PROCESSES,
                    whole.constant / PROCESSES + whole.cost_model().cost(batch_size, length),
                )
            )
            rows.append(
                {
                    "size": size,
                    "params_m": round(params / 1e6, 2),
                    "shape": measured["shape"],
                    "held_mib": measured["held"] / MiB,
                    "measured_mib": peak / MiB,
                    "predicted_mib": estimate.predict(batch_size, length) / MiB,
                    "predicted_over_measured": estimate.predict(batch_size, length) / peak,
                    "divided_only_over_measured": divided / peak,
                }
            )
        print(f"[fsdp_memory] {size}: done", flush=True)
    ratios = [r["predicted_over_measured"] for r in rows]
    divided = [r["divided_only_over_measured"] for r in rows]
    summary = (
        f"Predicted (`MemoryModel.from_config(config, device='cpu', task='causal-lm', shards={PROCESSES})`) "
        f"against the larger rank's measured peak of one training step under FSDP2 on {PROCESSES} CPU "
        f"processes (torch {torch.__version__}, gloo; fully_shard per decoder layer, on the embeddings and "
        f"the root): predicted/measured {min(ratios):.3f} to {max(ratios):.3f} over {len(rows)} rows. "
        f"Dividing weights, gradients and state alone, with nothing for what FSDP all-gathers: "
        f"{min(divided):.3f} to {max(divided):.3f}."
    )
    columns = list(rows[0])
    common.write_results(
        "fsdp_memory",
        args.out,
        {"processes": PROCESSES, "rows": rows, "summary": summary},
        summary + "\n\n" + common.markdown_table(rows, columns),
    )
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
