"""What one decoder layer of the real model class keeps for backward, counted on the ``meta`` device.

:meth:`~tokenbatch.probe.MemoryModel.from_config` asks this module, for a
causal LM, instead of guessing from the config's ``model_type`` how the
layers compute (gated MLP or not, RMSNorm in fp32, eager softmax in fp32
or in the activations' dtype, GELU written in Python). It builds the
config's own ``AutoModelForCausalLM`` class twice, with 1 and with 2 hidden
layers, on the ``meta`` device (shapes and dtypes, no memory, no
arithmetic), runs one forward at three short lengths under
:func:`torch.autograd.graph.saved_tensors_hooks`, and adds up the bytes of
the distinct storages autograd saves for backward, weights and buffers left
out. That is the activation memory the estimate models, and it is exact for
what the model's Python code does::

    saved(2 layers, L) - saved(1 layer, L) = one layer's  c + linear*L + quadratic*L**2

solved over ``L = 8, 16, 32`` (one sequence). Embeddings, the attention
mask, the rotary tables and the head are outside the layers and cancel. Two
runs per model: eager attention, and a stand-in for the fused kernels
(sdpa, flash, flex) that keeps what they keep: q, k, v, the output and a
fp32 log-sum-exp per row and head, no ``L x L`` scores. The model runs in
``eval`` mode with gradients on: dropout off (the estimate adds dropout's
masks itself, 1 byte on CUDA and the activations' dtype on CPU, which a
``meta`` run cannot tell apart). The parameters of the two models give the
exact parameter count and the largest parameter. The stand-in is registered
in transformers' ``AttentionInterface`` under the name
``tokenbatch_fused_calibration``, the one trace this leaves.

It takes well under a second per config after transformers' model module is
imported, and results are remembered per (config, dtype). When the class
cannot be built (custom code, a config transformers does not know, a
forward that the ``meta`` device does not support), :func:`calibrate`
returns ``None`` and logs why; the caller falls back to its analytic rule.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_LENGTHS = (8, 16, 32)
_FUSED_STAND_IN = "tokenbatch_fused_calibration"
# what was counted, per (config class, config, dtype): the same estimate is asked for several times
_remembered: dict[tuple[str, str, torch.dtype], LayerBytes] = {}


@dataclass(frozen=True)
class LayerBytes:
    """Bytes one decoder layer keeps for backward, without dropout, and the model's parameters."""

    eager_linear: float
    """Per token, eager attention."""
    eager_quadratic: float
    """Per pair of tokens in a sequence, eager attention (the scores it keeps, in every head)."""
    fused_linear: float
    """Per token, a fused attention kernel (no scores kept)."""
    parameters: int
    """Elements of all the model's parameters (tied ones once)."""
    largest: int
    """Elements of the largest parameter."""


class _FusedAttention(torch.autograd.Function):
    """Saves what fused attention kernels keep for backward: q, k, v, the output and the log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        out = query.new_empty(query.shape[:-1] + value.shape[-1:])
        lse = query.new_empty(query.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:  # pragma: no cover
        raise RuntimeError("the calibration's attention stand-in runs forward only")


def _fused_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    # transformers repeats k and v to every head for sdpa with a padding mask (a padded batch)
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = _FusedAttention.apply(query, key, value)  # type: ignore[no-untyped-call]
    return out.transpose(1, 2).contiguous(), None


def _register_stand_in() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(_FUSED_STAND_IN, _fused_attention)


def _with_layers(config: Any, n: int) -> Any:
    config = copy.deepcopy(config)
    config.num_hidden_layers = n
    layer_types = getattr(config, "layer_types", None)  # one entry per layer (sliding or full attention)
    if isinstance(layer_types, list) and layer_types:
        config.layer_types = [layer_types[i % len(layer_types)] for i in range(n)]
    return config


def _saved_bytes(model: torch.nn.Module, length: int) -> int:
    """Bytes of the distinct storages a forward saves for backward, weights and buffers excluded."""
    held = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers()]}
    seen: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage._cdata not in held:
            seen[storage._cdata] = storage.nbytes()
        return tensor

    ids = torch.zeros(1, length, dtype=torch.long, device="meta")
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        # a mask: without one transformers looks for packed sequences, reading values meta tensors lack
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return sum(seen.values())


def _layer_terms(models: list[torch.nn.Module]) -> tuple[float, float]:
    """One layer's (linear, quadratic) bytes: the 2-layer model's saved bytes less the 1-layer one's."""
    n = np.array(_LENGTHS, dtype=np.float64)
    one_layer = [_saved_bytes(models[1], length) - _saved_bytes(models[0], length) for length in _LENGTHS]
    design = np.stack([np.ones_like(n), n, n**2], axis=1)
    _, linear, quadratic = np.linalg.solve(design, np.array(one_layer, dtype=np.float64))
    # whole bytes per token and per pair, up to the solve's rounding
    return max(round(float(linear), 6), 0.0), max(round(float(quadratic), 6), 0.0)


def _calibrate(base: Any, dtype: torch.dtype) -> LayerBytes:
    from transformers import AutoModelForCausalLM

    _register_stand_in()
    terms: dict[str, tuple[float, float]] = {}
    models: list[torch.nn.Module] = []
    for attn in ("eager", _FUSED_STAND_IN):
        models = []
        for n in (1, 2):
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    _with_layers(base, n), dtype=dtype, attn_implementation=attn
                )
            models.append(model.eval())  # dropout off; the estimate adds its masks
        terms[attn] = _layer_terms(models)
    one, two = (sum(p.numel() for p in model.parameters()) for model in models)
    if two <= one:  # the class reads its depth from another attribute: nothing was counted
        raise ValueError(f"{type(models[1]).__name__} did not grow with config.num_hidden_layers")
    return LayerBytes(
        eager_linear=terms["eager"][0],
        eager_quadratic=terms["eager"][1],
        fused_linear=terms[_FUSED_STAND_IN][0],
        parameters=one + (int(base.num_hidden_layers) - 1) * (two - one),
        largest=max(p.numel() for p in models[1].parameters()),
    )


def calibrate(config: Any, dtype: torch.dtype) -> LayerBytes | None:
    """One decoder layer's saved bytes and the model's parameters, from its class on ``meta``;
    ``None`` (logged) when the class cannot be built or run there."""
    try:
        key = (type(config).__qualname__, config.to_json_string(use_diff=False), dtype)
        if key not in _remembered:
            if len(_remembered) >= 64:
                _remembered.clear()
            _remembered[key] = _calibrate(config, dtype)
        return _remembered[key]
    except Exception as error:  # any failure of someone else's model code means: use the analytic rule
        logger.warning(
            "tokenbatch: no calibration of %s on the meta device (%s: %s); using the analytic rule",
            type(config).__name__,
            type(error).__name__,
            error,
        )
        return None
