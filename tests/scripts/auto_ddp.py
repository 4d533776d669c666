"""Launched on 2 processes (torchrun, gloo) by tests/test_probe_auto.py: do the ranks agree on "auto"?

Usage: torchrun --nproc_per_node 2 auto_ddp.py OUT_DIR. Each rank probes under its own
memory limit (rank 1 less than rank 0) with its own budget cache file; then rank 0's
file remembers rank 0's own budget (as after a run of its own) and rank 1's is gone,
and both resolve again (issue 21: both took rank 0's budget "from the cache"); then
rank 1 fails while rank 0 has its cache; writes ``rank{r}.json``.
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
from tokenbatch.probe import BudgetCache
from tokenbatch.probe._auto import budget_in_units
from tokenbatch.probe._cache import scope

LIMITS = (64 * 2**20, 40 * 2**20)
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(8, 129, 200)]


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
    entry = cache.get(result.key)

    dist.barrier()
    if rank == 0:
        cache.put(result.key, mine, source="probe", **scope(probed.cost, probed.lengths))
    else:
        cache.path.unlink(missing_ok=True)
    dist.barrier()
    again = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    second = auto_budget(model, again, memory_limit=LIMITS[rank], cache=cache)
    report = {
        "probe": {"agreed": result.max_tokens, "source": result.source, "mine": mine, "len": len(probed)},
        "remembered": None if entry is None else entry["max_tokens"],
        "cache_then_probe": {
            "agreed": second.max_tokens,
            "source": second.source,
            "probed": second.probe is not None,
            "mine": None
            if second.probe is None or second.probe.fit is None
            else budget_in_units(second.probe.fit, again.cost, again.lengths, LIMITS[rank], 0.1),
            "len": len(again),
            "remembered": (cache.get(second.key) or {}).get("max_tokens"),
        },
    }
    # Rank 1's memory cannot hold the model (its estimate says so at once), rank 0 has its cache:
    # both stop, neither waits for the other.
    try:
        auto_budget(
            model,
            TokenBudgetBatchSampler(LENGTHS, max_tokens="auto"),
            memory_limit=LIMITS[0] if rank == 0 else 2**16,
            cache=cache,
            measure=False,
        )
    except (RuntimeError, ValueError) as error:
        report["refused"] = f"{type(error).__name__}: {error}"
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
    end_process_group()
