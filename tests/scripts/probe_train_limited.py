"""Train a tiny BERT under a real address-space limit (RLIMIT_AS) at a given token budget.

Usage: python probe_train_limited.py SPEC_JSON, where the JSON holds ``config``
(BertConfig kwargs), ``seed``, ``lengths``, ``max_tokens``, ``cost``
(CostModel kwargs), ``memory_limit`` (the limit handed to the probe, in bytes
of tensors) and ``max_steps``. Prints one JSON line: ``{"ok": true, ...}`` or
``{"ok": false, "oom": true, ...}``.

RLIMIT_AS caps virtual address space, and a torch process maps hundreds of
MiB (shared libraries, thread stacks, allocator arenas) that it never
touches, so an absolute limit says nothing. We calibrate instead: after a
warm-up step (optimizer state created, kernels loaded) we read our own
VmSize and allow ``VmSize + memory_limit - held`` where ``held`` is what the
weights, buffers and optimizer state already occupy (the probe counts them in
its limit, and they are inside VmSize already). The parent runs us with
MALLOC_MMAP_THRESHOLD_ set, so glibc maps every tensor of 64 KiB or more on
its own and unmaps it when freed; with glibc's default sliding threshold,
freed blocks up to 32 MiB stay in the heap and the address space grows to
about twice the live tensor bytes, which is glibc's fragmentation, not the
model's memory.
"""

from __future__ import annotations

import json
import resource
import sys

import torch


def vm_status(field: str) -> int:
    """A ``Vm*`` line of /proc/self/status (VmSize, VmPeak), in bytes."""
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def main() -> None:
    from transformers import BertConfig, BertForSequenceClassification

    from tokenbatch import CostModel, TokenBudgetBatchSampler
    from tokenbatch._probe_step import held_bytes, is_oom

    spec = json.loads(sys.argv[1])
    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    config = BertConfig(**spec["config"])
    config._attn_implementation = "eager"
    model = BertForSequenceClassification(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    lengths = spec["lengths"]
    generator = torch.Generator().manual_seed(spec["seed"])
    data = [torch.randint(0, config.vocab_size, (n,), generator=generator) for n in lengths]
    sampler = TokenBudgetBatchSampler(
        lengths, spec["max_tokens"], cost=CostModel(**spec["cost"]), seed=spec["seed"], oversize="error"
    )

    def step(indices: list[int]) -> None:
        width = max(lengths[i] for i in indices)
        ids = torch.zeros(len(indices), width, dtype=torch.long)
        mask = torch.zeros(len(indices), width, dtype=torch.long)
        for row, i in enumerate(indices):
            ids[row, : lengths[i]] = data[i]
            mask[row, : lengths[i]] = 1
        labels = torch.zeros(len(indices), dtype=torch.long)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step([0])  # warm-up: optimizer state, kernels
    held = held_bytes(model, optimizer)
    base = vm_status("VmSize")
    allowed = base + spec["memory_limit"] - held
    resource.setrlimit(resource.RLIMIT_AS, (allowed, resource.RLIM_INFINITY))
    report = {"ok": True, "oom": False, "steps": 0, "base_vmsize": base, "held": held, "error": None}
    costs = []
    try:
        for indices in sampler:
            costs.append(sampler.cost.cost(len(indices), max(lengths[i] for i in indices)))
            step(indices)
            report["steps"] += 1
            if report["steps"] >= spec["max_steps"]:
                break
    except Exception as error:
        if not is_oom(error):
            raise
        report.update(ok=False, oom=True, error=str(error)[:300])
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    report.update(
        max_batch_cost=max(costs), allowed_growth=allowed - base, peak_growth=vm_status("VmPeak") - base
    )
    print(json.dumps(report))


if __name__ == "__main__":
    main()
