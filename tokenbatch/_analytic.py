"""Analytic training memory of a transformers encoder or decoder, from its config, as plain numbers.

It reads a config and returns plain numbers, for
:meth:`tokenbatch.probe.MemoryModel.from_config`, the one entry point.

The estimate counts the bytes autograd keeps alive between forward and
backward, per layer, following Korthikanti et al. (2022), "Reducing
Activation Recomputation in Large Transformer Models", section 4.1: with
16-bit activations, 1-byte dropout masks, no tensor parallelism and no
recomputation, one layer stores ``s*b*h*(34 + 5*a*s/h)`` bytes for ``b``
sequences of ``s`` tokens, hidden size ``h`` and ``a`` heads. Spelled out
with ``e`` bytes per activation element, ``m`` bytes per dropout-mask element
and intermediate size ``I``, per token and layer:

* attention: the projections' input, q, k, v and the context
  (``5*e*h``) plus the output dropout mask (``m*h``);
* MLP: its input (``e*h``), the activation's input and output (``2*e*I``; a
  gated MLP such as SwiGLU keeps ``4*e*I``) and a dropout mask (``m*h``);
* two norms, each keeping its input (``2*e*h``);
* per pair of tokens, eager attention only: the softmax output (``e*a``) and,
  with attention dropout, its mask and output (``(m + e)*a``).

With ``e = 2``, ``m = 1`` and ``I = 4h`` that is Korthikanti's ``34*h``
linear and ``5*a`` quadratic bytes. Two corrections from measuring HF BERT
(:func:`tokenbatch.probe.find_max_tokens`): on CPU, PyTorch's dropout keeps a mask of the
activation's dtype (``m = e``, the fused 1-byte mask exists only on CUDA), so
fp32 BERT on CPU keeps ``10*e*h + 2*e*I`` linear and ``3*e*a`` quadratic
bytes per layer; and the backward pass briefly needs about ``4*e*h`` more per
token at its start, plus the ``B x 1 x L x L`` attention mask transformers
builds for padded batches (``e`` bytes per pair for eager, about ``1 + e``
for sdpa). Measured on tiny and MiniLM-sized BERTs the total is within about
20% of the probe; use the probe when the number matters.

Which attention implementations store the ``L x L`` scores: ``eager`` always
does (``attention_probs`` in every layer). ``flash_attention_2``,
``flash_attention_3``, ``flex_attention`` and ``sdpa`` on CUDA do not: they
keep q, k, v, the output and a per-row log-sum-exp and recompute the scores
in backward. ``sdpa`` on CPU uses its fused kernel only without attention
dropout; training with dropout falls back to the math kernel, which stores
the scores just like eager.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from tokenbatch import _checks

if TYPE_CHECKING:
    import torch

FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
ATTENTION_IMPLEMENTATIONS = ("eager", *FUSED_ATTENTION)
TASKS = ("auto", "base", "sequence-classification", "token-classification", "masked-lm", "causal-lm")
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}
# HF models whose MLP is gated (gate * act(up)) and whose RMSNorm upcasts to fp32 in Python.
_GATED_MODEL_TYPES = (
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
    "gemma",
    "gemma2",
    "gemma3",
    "phi3",
    "olmo",
)


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _dropout(config: Any, *names: str) -> float:
    return float(_get(config, *names, default=0.0))


def resolve_task(config: Any, task: str = "auto") -> str:
    """``task``, or for ``"auto"`` the head ``config.architectures`` names (else sequence classification)."""
    task = _checks.one_of("task", task, TASKS)
    if task != "auto":
        return task
    arch = (getattr(config, "architectures", None) or [""])[0]
    for suffix, name in (
        ("ForMaskedLM", "masked-lm"),
        ("ForCausalLM", "causal-lm"),
        ("LMHeadModel", "causal-lm"),
        ("ForTokenClassification", "token-classification"),
    ):
        if arch.endswith(suffix):
            return name
    return "sequence-classification"


def stores_attention_scores(
    attn_implementation: str, *, device: str = "cuda", training: bool = True, attention_dropout: float = 0.0
) -> bool:
    """Whether ``attn_implementation`` keeps the ``L x L`` attention scores alive for backward."""
    attn_implementation = _checks.one_of(
        "attn_implementation", attn_implementation, ATTENTION_IMPLEMENTATIONS
    )
    if attn_implementation == "eager":
        return True
    # CPU sdpa has a fused kernel only without dropout; with it, the math kernel keeps the scores.
    return attn_implementation == "sdpa" and device == "cpu" and training and attention_dropout > 0


class MemoryTerms(NamedTuple):
    """Peak training memory in bytes: ``constant + B * (linear*L + quadratic*L**2 + per_sample)``."""

    linear: float
    """Bytes per padded token."""
    quadratic: float
    """Bytes per pair of tokens in one sequence (attention scores, attention mask)."""
    per_sample: float
    """Bytes per sequence whatever its length (classification head)."""
    constant: float
    """Bytes for weights, gradients and optimizer state."""
    stores_scores: bool
    """Whether the attention implementation keeps the L x L scores for backward."""


def memory_terms(
    config: Any,
    *,
    dtype: torch.dtype | None = None,
    training: bool = True,
    attn_implementation: str | None = None,
    device: str = "cuda",
    task: str = "auto",
    optimizer: str = "adamw",
) -> MemoryTerms:
    """The training (or inference) memory terms of a transformers model, from its config.

    Args:
        config: a ``transformers.PretrainedConfig`` of an encoder (BERT family)
            or decoder (GPT-2, Llama family) model.
        dtype: the dtype activations are computed in (``torch.float32``, the
            default, ``torch.float16``, ``torch.bfloat16``); weights are assumed in it too.
        training: ``False`` estimates a no-grad forward pass (one layer's
            working set) instead of forward + backward.
        attn_implementation: ``"eager"``, ``"sdpa"``, ``"flash_attention_2"``,
            ... ; ``None`` reads ``config._attn_implementation`` (``"sdpa"``
            when unset, transformers' default).
        device: ``"cuda"`` or ``"cpu"``: dropout masks and sdpa kernels differ.
        task: the head: ``"auto"`` (from ``config.architectures``, else
            sequence classification), ``"base"``, ``"sequence-classification"``,
            ``"token-classification"``, ``"masked-lm"`` or ``"causal-lm"``.
        optimizer: ``"adamw"`` (8 bytes of state per parameter), ``"sgd-momentum"``
            (4) or ``"sgd"`` (0); only affects ``constant``.

    Raises:
        ValueError: an encoder-decoder config, or an unknown option.
    """
    import torch

    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"the analytic estimate handles encoder-only and decoder-only models, but config "
            f"{type(config).__name__} is an encoder-decoder; measure it with find_max_tokens instead"
        )
    device = _checks.one_of("device", str(torch.device(device).type), ("cuda", "cpu"))
    optimizer = _checks.one_of("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES))
    task = resolve_task(config, task)
    if attn_implementation is None:
        attn_implementation = getattr(config, "_attn_implementation", None) or "sdpa"
    h = int(_get(config, "hidden_size", "n_embd", "d_model", "dim"))
    n_layers = int(_get(config, "num_hidden_layers", "n_layer", "num_layers", "n_layers"))
    a = int(_get(config, "num_attention_heads", "n_head", "num_heads", "n_heads"))
    inter = int(_get(config, "intermediate_size", "n_inner", "ffn_dim", "d_ff", default=4 * h))
    kv = int(_get(config, "num_key_value_heads", default=a))
    vocab = int(_get(config, "vocab_size", default=0))
    p_att = _dropout(config, "attention_probs_dropout_prob", "attn_pdrop", "attention_dropout")
    p_hid = _dropout(config, "hidden_dropout_prob", "resid_pdrop", "hidden_dropout")
    gated = getattr(config, "model_type", "") in _GATED_MODEL_TYPES
    e = torch.empty((), dtype=torch.float32 if dtype is None else dtype).element_size()
    m = 1 if device == "cuda" else e  # fused bool dropout mask on CUDA; a dtype-sized mask on CPU
    scores = stores_attention_scores(
        attn_implementation, device=device, training=training, attention_dropout=p_att
    )
    kv_width = h * kv // a

    if training:
        # eager: x, q, k, v (k and v repeated to all heads), the context; fused: x, q, k, v,
        # the kernel's output and its fp32 log-sum-exp per row and head, the context
        attention = 5 * e * h if scores else e * (4 * h + 2 * kv_width) + 4 * a
        mlp = e * h + e * inter * (4 if gated else 2)
        norms = 2 * e * h + 16 if not gated else 2 * (8 + e) * h
        masks = 2 * m * h if p_hid > 0 else 0
        layer_linear = attention + mlp + norms + masks
        layer_quadratic = a * (e + ((m + e) if p_att > 0 else 0)) if scores else 0
        embeddings = e * h + (m * h if p_hid > 0 else 0) + 8
        # + the final hidden state the head keeps, + the backward pass's working set at its start
        linear = n_layers * layer_linear + embeddings + e * h + 4 * e * h
        quadratic = float(n_layers * layer_quadratic)
    else:
        # No-grad forward: nothing is kept between layers, the peak is one layer's working set.
        linear = e * (6 * h + (3 if gated else 2) * inter)
        quadratic = float(2 * e * a) if scores else 0.0
    # transformers' B x 1 x L x L mask for padded batches (flash attention unpads instead).
    if attn_implementation == "eager":
        quadratic += e
    elif attn_implementation in ("sdpa", "flex_attention"):
        quadratic += 1 + e

    per_sample = 0.0
    if task in ("masked-lm", "causal-lm") and vocab:
        # logits, the fp32 log-softmax the loss keeps, and its gradient at the start of backward
        linear += vocab * (e + 12) if training else vocab * (e + 4)
        linear += 3 * e * h if task == "masked-lm" else 0  # BERT's prediction transform
    elif task == "sequence-classification":
        per_sample = float(4 * e * h)  # pooler and classifier on one token per sequence
    elif task == "token-classification":
        linear += 3 * e * int(_get(config, "num_labels", default=2))

    params = _parameter_count(h, n_layers, inter, kv_width, vocab, config, gated)
    per_param = e + (e + OPTIMIZER_STATE_BYTES[optimizer] if training else 0)
    return MemoryTerms(
        linear=float(linear),
        quadratic=quadratic,
        per_sample=per_sample,
        constant=float(params * per_param),
        stores_scores=scores,
    )


def _parameter_count(
    h: int, n_layers: int, inter: int, kv_width: int, vocab: int, config: Any, gated: bool
) -> int:
    """Approximate number of parameters (embeddings, attention, MLP, norms)."""
    positions = int(_get(config, "max_position_embeddings", "n_positions", default=0))
    if _get(config, "rope_theta", "rope_parameters") is not None:
        positions = 0  # rotary embeddings have no weights
    attention = h * (h + 2 * kv_width) + h * h + 4 * h
    mlp = h * inter * (3 if gated else 2) + inter + h
    total = n_layers * (attention + mlp + 4 * h) + (vocab + positions) * h
    return int(np.int64(total))
