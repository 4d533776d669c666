"""The probe's budget under a real memory limit: a subprocess trains with RLIMIT_AS set.

See tests/scripts/probe_train_limited.py for how the limit is calibrated
against the child's own VmSize, why it runs with MALLOC_MMAP_THRESHOLD_, and
why each budget trains in a fork of one child.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification

from tokenbatch.probe import find_max_tokens

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "probe_train_limited.py"
CONFIG: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 37,
    "max_position_embeddings": 512,
}
LIMIT = 64 * 2**20


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    # Every tensor of 64 KiB or more gets its own mapping, returned to the system when freed,
    # so that address space tracks tensor bytes instead of glibc's heap fragmentation.
    env.update({"OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MALLOC_MMAP_THRESHOLD_": "65536"})
    return env


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status for VmSize")
def test_suggested_budget_trains_under_the_limit_and_twice_it_runs_out() -> None:
    config = BertConfig(**CONFIG)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model's ops are too small to split between threads
    try:
        result = find_max_tokens(BertForSequenceClassification(config), max_len=256, memory_limit=LIMIT)
    finally:
        torch.set_num_threads(threads)
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(8, 257, 300)] + [256] * 30
    cost = {k: getattr(result.cost, k) for k in ("linear", "quadratic", "per_sample")}

    spec: dict[str, Any] = {
        "config": CONFIG,
        "seed": 0,
        "lengths": lengths,
        "cost": cost,
        "memory_limit": LIMIT,
        "max_steps": 6,
        "budgets": [result.max_tokens, 2 * result.max_tokens],
    }
    # One child imports torch and transformers once and trains each budget in a fork of itself.
    child = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(spec)],
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert child.returncode == 0, child.stderr[-3000:]
    at_budget, at_double = json.loads(child.stdout.strip().splitlines()[-1])
    assert at_budget["ok"] and at_budget["steps"] == 6, at_budget
    # The run really used its budget: the costliest batch comes first and nearly fills it.
    assert at_budget["max_batch_cost"] > 0.8 * result.max_tokens
    assert at_budget["peak_growth"] <= at_budget["allowed_growth"]
    assert at_double["oom"] and "can't allocate memory" in at_double["error"], at_double
    assert at_double["steps"] == 0  # the first (costliest) step already fails
