"""The probe's budget under a real memory limit: a subprocess trains with RLIMIT_AS set.

See tests/scripts/probe_train_limited.py for how the limit is calibrated
against the child's own VmSize, and why it runs with MALLOC_MMAP_THRESHOLD_.
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
    result = find_max_tokens(BertForSequenceClassification(config), max_len=256, memory_limit=LIMIT)
    rng = np.random.default_rng(0)
    lengths = [int(n) for n in rng.integers(8, 257, 300)] + [256] * 30
    cost = {k: getattr(result.cost, k) for k in ("linear", "quadratic", "per_sample")}

    def spec(max_tokens: float) -> str:
        settings: dict[str, Any] = {
            "config": CONFIG, "seed": 0, "lengths": lengths, "max_tokens": max_tokens,
            "cost": cost, "memory_limit": LIMIT, "max_steps": 6,
        }  # fmt: skip
        return json.dumps(settings)

    # Both children at once: most of their time is importing torch and transformers.
    children = [
        subprocess.Popen(
            [sys.executable, str(SCRIPT), spec(budget)],
            env=child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for budget in (result.max_tokens, 2 * result.max_tokens)
    ]
    reports = []
    for child in children:
        out, err = child.communicate(timeout=300)
        assert child.returncode == 0, err[-3000:]
        reports.append(json.loads(out.strip().splitlines()[-1]))
    at_budget, at_double = reports
    assert at_budget["ok"] and at_budget["steps"] == 6, at_budget
    # The run really used its budget: the costliest batch comes first and nearly fills it.
    assert at_budget["max_batch_cost"] > 0.8 * result.max_tokens
    assert at_budget["peak_growth"] <= at_budget["allowed_growth"]
    assert at_double["oom"] and "can't allocate memory" in at_double["error"], at_double
    assert at_double["steps"] == 0  # the first (costliest) step already fails
