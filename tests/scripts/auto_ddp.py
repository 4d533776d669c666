"""Launched on 2 processes (torchrun, gloo) by tests/test_probe_auto.py: do the ranks agree on "auto"?

Usage: torchrun --nproc_per_node 2 auto_ddp.py OUT_DIR. Each rank probes under its own
memory limit (rank 1 less than rank 0) with its own budget cache file, then
resolves again from a cache only rank 0 holds; writes ``rank{r}.json``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is run

from teardown import end_process_group
from transformers import BertConfig, BertForSequenceClassification

from tokenbatch import TokenBudgetBatchSampler, auto_budget
from tokenbatch.probe import BudgetCache, BudgetKey
from tokenbatch.probe._auto import budget_in_units

LIMITS = (64 * 2**20, 40 * 2**20)
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(8, 129, 200)]
KEY = BudgetKey("tiny-ddp", "cpu:test", 1, "float32", 2)


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=1000,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
    )
    config._attn_implementation = "eager"
    model = BertForSequenceClassification(config)
    cache = BudgetCache(out / f"cache{rank}.json")

    probed = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(model, probed, memory_limit=LIMITS[rank], cache=cache)
    assert result.probe is not None and result.probe.fit is not None
    mine = budget_in_units(result.probe.fit, probed.cost, probed.lengths, LIMITS[rank], 0.1)
    probed_file = cache.path.exists()

    if rank == 0:
        cache.put(KEY, 1500.0, source="oom")
    dist.barrier()
    remembered = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    from_cache = auto_budget(model, remembered, memory_limit=LIMITS[rank], cache=cache, key=KEY)
    report = {
        "probe": {"agreed": result.max_tokens, "source": result.source, "mine": mine, "len": len(probed)},
        "wrote_cache": probed_file,
        "cache": {"agreed": from_cache.max_tokens, "source": from_cache.source, "len": len(remembered)},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()
