"""The analytic memory model: Korthikanti's counts, attention implementations, and a measured check."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import BertConfig, BertForSequenceClassification, GPT2Config, LlamaConfig, T5Config

import tokenbatch.probe
from tokenbatch import CostModel
from tokenbatch.probe import MemoryModel, find_max_tokens
from tokenbatch.probe._model import resolve_task, stores_attention_scores


def bert(layers: int, **overrides: Any) -> BertConfig:
    return BertConfig(num_hidden_layers=layers, **overrides)


def cost(config: Any, **options: Any) -> CostModel:
    """The batch-dependent terms of the analytic estimate, the one way to get them from a config."""
    return MemoryModel.from_config(config, **options).cost_model()


def per_layer(dtype: torch.dtype, device: str, attn: str, **overrides: Any) -> tuple[float, float]:
    """(linear, quadratic) bytes that one more BERT layer adds."""
    one = MemoryModel.from_config(bert(1, **overrides), dtype=dtype, device=device, attn_implementation=attn)
    two = MemoryModel.from_config(bert(2, **overrides), dtype=dtype, device=device, attn_implementation=attn)
    return two.linear - one.linear, two.quadratic - one.quadratic


def test_one_layer_reproduces_korthikanti_for_fp16_on_cuda() -> None:
    # sbh(34 + 5as/h): 34 bytes per token and hidden unit, 5 bytes per token pair and head.
    linear, quadratic = per_layer(torch.float16, "cuda", "eager")
    assert linear == 34 * 768 + 16  # + LayerNorm's fp32 mean and rstd, 2 x 2 x 4 bytes
    assert quadratic == 5 * 12


def test_fp32_on_cpu_keeps_dtype_sized_dropout_masks() -> None:
    linear, quadratic = per_layer(torch.float32, "cpu", "eager")
    assert linear == 10 * 4 * 768 + 2 * 4 * 3072 + 16
    assert quadratic == 3 * 4 * 12
    no_dropout = per_layer(
        torch.float32, "cpu", "eager", attention_probs_dropout_prob=0.0, hidden_dropout_prob=0.0
    )
    assert no_dropout == (8 * 4 * 768 + 2 * 4 * 3072 + 16, 4 * 12)


def test_which_implementations_store_the_scores() -> None:
    for attn in ("flash_attention_2", "flash_attention_3", "flex_attention"):
        assert not stores_attention_scores(attn, device="cuda", attention_dropout=0.1)
        assert per_layer(torch.bfloat16, "cuda", attn)[1] == 0
    assert stores_attention_scores("eager", device="cuda")
    assert not stores_attention_scores("sdpa", device="cuda", attention_dropout=0.1)
    assert stores_attention_scores("sdpa", device="cpu", attention_dropout=0.1)
    assert not stores_attention_scores("sdpa", device="cpu", attention_dropout=0.0)
    assert not stores_attention_scores("sdpa", device="cpu", training=False, attention_dropout=0.1)
    # Only the padding mask stays quadratic without stored scores, once per model, not per layer.
    flash = cost(BertConfig(), attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    sdpa = cost(BertConfig(), attn_implementation="sdpa", dtype=torch.bfloat16)
    eager = cost(BertConfig(), attn_implementation="eager", dtype=torch.bfloat16)
    assert flash.quadratic == 0 and sdpa.quadratic == 3 and eager.quadratic == 12 * 5 * 12 + 2


def test_from_config_reads_attn_implementation_and_defaults_to_sdpa() -> None:
    config = BertConfig()
    assert cost(config) == cost(config, attn_implementation="sdpa")
    config._attn_implementation = "eager"
    assert cost(config) == cost(config, attn_implementation="eager")
    assert cost(config, pad_to_multiple_of=8).pad_to_multiple_of == 8


def test_inference_needs_far_less_than_training() -> None:
    train = MemoryModel.from_config(BertConfig(), attn_implementation="eager")
    infer = MemoryModel.from_config(BertConfig(), attn_implementation="eager", training=False)
    assert infer.linear < train.linear / 10 and infer.quadratic < train.quadratic / 5
    # Inference holds the weights alone; training adds AdamW's 8 bytes per parameter under the
    # activations, and the gradients and the update's temporaries at the optimizer step.
    assert infer.constant * 3 == train.constant and infer.step_peak == 0
    assert train.step_peak > train.constant * 4 / 3


def test_decoders_and_heads() -> None:
    gpt2 = MemoryModel.from_config(
        GPT2Config(), attn_implementation="sdpa", task="auto", dtype=torch.bfloat16
    )
    assert gpt2.quadratic == 3 and gpt2.linear > 0  # GPT2Config names no architecture: classification
    lm = MemoryModel.from_config(
        GPT2Config(), attn_implementation="sdpa", task="causal-lm", dtype=torch.bfloat16
    )
    assert lm.linear - gpt2.linear == pytest.approx(50257 * (2 + 12), rel=1e-9)
    llama = LlamaConfig(hidden_size=512, intermediate_size=1376, num_attention_heads=8, num_hidden_layers=2)
    mha = MemoryModel.from_config(llama, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    llama.num_key_value_heads = 2
    gqa = MemoryModel.from_config(llama, attn_implementation="flash_attention_2", dtype=torch.bfloat16)
    assert mha.linear - gqa.linear == 2 * 2 * 2 * (512 - 128)  # k and v narrower, 2 layers, 2 bytes
    assert mha.constant > gqa.constant
    assert resolve_task(BertConfig(architectures=["BertForMaskedLM"])) == "masked-lm"
    assert resolve_task(GPT2Config(architectures=["GPT2LMHeadModel"])) == "causal-lm"


def test_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="encoder-decoder"):
        MemoryModel.from_config(T5Config())
    with pytest.raises(ValueError, match="attn_implementation should be one of"):
        MemoryModel.from_config(BertConfig(), attn_implementation="fast")
    with pytest.raises(ValueError, match="device should be one of"):
        MemoryModel.from_config(BertConfig(), device="mps")
    with pytest.raises(ValueError, match="no room for activations"):
        MemoryModel.from_config(BertConfig()).budget(2**20)


def test_estimate_is_within_15_percent_of_the_measured_fit() -> None:
    """The analytic terms against the probe's fit for a small BERT in fp32 on CPU."""
    config = BertConfig(
        vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # small ops: a second thread only waits for a core on a busy machine
    try:
        # The fit is exact to a few percent at any room; a smaller limit means smaller, faster steps.
        measured = find_max_tokens(model, max_len=256, memory_limit=112 * 2**20).fit
    finally:
        torch.set_num_threads(threads)
    estimate = MemoryModel.from_config(config, device="cpu")
    assert measured is not None
    assert estimate.linear == pytest.approx(measured.linear, rel=0.15)
    assert estimate.quadratic == pytest.approx(measured.quadratic, rel=0.15)
    per_sequence = estimate.cost_model().sample_cost(256)
    assert float(per_sequence) == pytest.approx(float(measured.cost_model().sample_cost(256)), rel=0.15)


def test_the_estimate_is_the_cost_model_plus_the_constant() -> None:
    config = GPT2Config(n_layer=2)
    model = MemoryModel.from_config(config, dtype=torch.bfloat16, pad_to_multiple_of=8)
    # The cost model is the memory model's batch-dependent terms; the constant stays outside it.
    assert model.cost_model() == CostModel(model.linear, model.quadratic, model.per_sample, 8)
    assert model.predict(2, 10) == max(model.step_peak, model.constant + model.cost_model().cost(2, 10))
    assert model.predict(64, 512) == model.constant + model.cost_model().cost(64, 512) > model.step_peak
    # MemoryModel.from_config is the one entry point: the earlier ones are gone, not aliased.
    assert not hasattr(CostModel, "from_config")
    for name in ("estimate_memory", "MemoryEstimate", "MemoryFit"):
        assert not hasattr(tokenbatch.probe, name)
    with pytest.raises(ValueError, match="pad_to_multiple_of should be"):
        MemoryModel.from_config(config, pad_to_multiple_of=0)
