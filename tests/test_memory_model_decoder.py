"""The analytic estimate for causal LMs against the probe's measured peak of a training step (CPU).

Llama with grouped-query attention and untied embeddings, GPT-2 with its naming, tied embeddings,
dropout and Python GELU; each in eager and sdpa attention, at three shapes: one where the
optimizer step's peak is the largest, one where the vocabulary's fp32 logits dominate, one where
the attention scores weigh (eager keeps them; CPU sdpa keeps them only with attention dropout,
which GPT-2 has and Llama has not).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from tokenbatch import TokenBudgetBatchSampler, auto_budget
from tokenbatch.probe import BudgetCache, MemoryModel
from tokenbatch.probe._auto import budget_in_units
from tokenbatch.probe._measure import measure_peak
from tokenbatch.probe._model import resolve_task
from tokenbatch.probe._search import search_cost

SHAPES = ((1, 16), (16, 32), (2, 256))  # (batch size, length)


def llama(attn: str) -> torch.nn.Module:
    config = LlamaConfig(
        vocab_size=4000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attn_implementation=attn,
    )
    return LlamaForCausalLM(config)


def gpt2(attn: str) -> torch.nn.Module:
    config = GPT2Config(vocab_size=1000, n_embd=64, n_layer=4, n_head=4, n_positions=512)
    config._attn_implementation = attn
    return GPT2LMHeadModel(config)


@pytest.mark.parametrize(
    ("family", "attn", "dtype"),
    [
        (llama, "eager", torch.float32),
        (llama, "sdpa", torch.float32),
        (gpt2, "eager", torch.float32),
        (gpt2, "sdpa", torch.float32),
        # 16-bit: AdamW state in bf16, Llama's eager softmax in fp32, CPU sdpa's math kernel
        # (GPT-2 has attention dropout) computing in fp32
        (llama, "eager", torch.bfloat16),
        (gpt2, "sdpa", torch.bfloat16),
    ],
    ids=["llama-gqa-eager", "llama-gqa-sdpa", "gpt2-eager", "gpt2-sdpa", "llama-gqa-bf16", "gpt2-sdpa-bf16"],
)
def test_predicted_peak_is_within_15_percent_of_the_measured_one(
    family: Any, attn: str, dtype: torch.dtype
) -> None:
    torch.manual_seed(0)
    model = family(attn).to(dtype)
    assert model.config._attn_implementation == attn
    estimate = MemoryModel.from_config(model.config, device="cpu", task="causal-lm", dtype=dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: a second thread only waits for a core on a busy machine
    try:
        measured = {shape: measure_peak(model, *shape).peak_bytes for shape in SHAPES}
    finally:
        torch.set_num_threads(threads)
    ratios = {shape: estimate.predict(*shape) / peak for shape, peak in measured.items()}
    assert all(0.85 <= r <= 1.15 for r in ratios.values()), ratios
    # Not trivially tiny: the batch-dependent terms are most of the largest shape's peak.
    batch, length = SHAPES[-1]
    assert estimate.cost_model().cost(batch, length) > estimate.constant


def test_a_causal_lm_built_in_code_is_estimated_with_its_logits(tmp_path: Path) -> None:
    """No ``config.architectures`` on a model built from its config: its class names the head,
    for the probe's search cost and for ``auto_budget(measure=False)`` alike."""
    torch.manual_seed(0)
    model = llama("eager")
    assert not model.config.architectures
    causal = MemoryModel.from_config(model.config, device="cpu", task="causal-lm")
    assert resolve_task(model.config) == "sequence-classification"
    assert resolve_task(model.config, model=model) == "causal-lm"
    assert search_cost(model, 1) == causal.token_cost()
    lengths = [16, 40, 64, 128] * 8
    sampler = TokenBudgetBatchSampler(lengths, max_tokens="auto")
    limit = 256 * 2**20
    result = auto_budget(model, sampler, memory_limit=limit, measure=False, cache=BudgetCache(tmp_path / "b"))
    expected = budget_in_units(causal, sampler.cost, np.asarray(lengths), limit, 0.1)
    assert result.estimate == pytest.approx(expected, rel=1e-12)
