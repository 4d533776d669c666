"""One memory model of a training step, ``constant + B * (linear*L + quadratic*L**2 + per_sample)`` bytes.

Two sources give its terms: :meth:`MemoryModel.from_config` estimates them
from a transformers config without running anything, and :func:`fit_memory`
fits them to measured steps (:class:`Measurement`, what
:func:`tokenbatch.probe.find_max_tokens` records). Either way the same
methods turn the model into a :class:`~tokenbatch.CostModel` and a budget.

The analytic estimate
---------------------

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

Decoders (``benchmarks/decoder_memory.py``: Llama with grouped-query
attention and GPT-2, fp32 on CPU, eager and sdpa) add three things. The
causal-LM loss keeps ``4*V`` bytes per token in fp32 beyond the logits
(``e*V``): the log-softmax's output, and at the start of backward its
gradient and the loss's (in 16-bit, the logits' fp32 copy lives only until
the log-softmax has run); with a vocabulary of tens of thousands that is
most of a short sequence's memory. An untied LM head (Llama) is a second
``V x h`` parameter. GPT-2's ``gelu_new`` is written in Python and keeps four
``I``-sized tensors where torch's fused GELU keeps one. And the gradients
are not under the activations: backward frees each layer's activations as it
makes the layer's gradients, so the forward + backward peak holds weights,
optimizer state and activations (the probe's fit finds the same constant on
MiniLM), while the optimizer step holds weights, gradients, state and the
update's temporaries (``step_peak``; single-tensor AdamW on CPU makes two of
the largest parameter's size at a time, foreach AdamW on CUDA one per
parameter). The prediction is the larger of the two.

Causal LMs: the layers counted on the model's own class
--------------------------------------------------------

How a decoder layer computes is in its modeling file, not its config: a
gated MLP or not, RMSNorm upcast to fp32, a GELU written in Python, and for
16-bit eager attention whether the softmax runs in fp32 (transformers 5 does
so for Llama, Qwen2, Mistral, Gemma, GPT-NeoX, OPT and Phi, and keeps that
and its 16-bit copy; GPT-2 does not). A list of model types goes stale, so
for ``task="causal-lm"`` training the layers' terms come from
:func:`tokenbatch.probe._calibrate.calibrate`: the config's own
``AutoModelForCausalLM`` class, built with 1 and with 2 layers on the
``meta`` device, one forward at three short lengths, and the bytes that
autograd saves for backward counted (distinct storages, weights left out).
The difference between the two models is one layer's ``linear*L +
quadratic*L**2``, once with eager attention and once with a stand-in for
the fused kernels (q, k, v, output, fp32 log-sum-exp). It is always on: it
runs no arithmetic and allocates nothing, a fraction of a second per config
(after transformers' modeling module is imported) and remembered per
config and dtype. Dropout is off in it (``eval`` mode): its masks are added
here, 1 byte on CUDA and the activations' dtype on CPU. The parameter count
and the largest parameter are the built models' too. The rest (embeddings,
the head and loss, the backward's working set, what a device's kernels
do: CPU sdpa's fp32 math kernel with attention dropout, FSDP's gathers) is
the analytic rule's. A class that cannot be built (custom code, a config
transformers does not know, a forward ``meta`` tensors cannot run) logs why
and falls back to the analytic rule, whose gated MLP, fp32 norm and fp32
softmax follow ``_GATED_MODEL_TYPES``; encoders and inference use that rule
too.

On CPU, against the probe's measurement (``tests/test_memory_model_decoder.py``:
2-layer models of all those families, fp32 and bf16, eager and sdpa) the
prediction is 0.94 to 1.08 of the measured peak at 1x16, 16x32 and 2x256
tokens. Not counted: while the last layer's attention runs backward, the
gradients of its scores (about 3 bytes per pair and head in fp32, 2 in
bf16, once per step, not per layer) can top the peak; at 1x1024 eager this
leaves 2-layer models at 0.83 to 0.91 of it, a share that shrinks with the
number of layers (4-layer Qwen2 and OPT: 0.89 to 0.94).

Which attention implementations store the ``L x L`` scores: ``eager`` always
does (``attention_probs`` in every layer). ``flash_attention_2``,
``flash_attention_3``, ``flex_attention`` and ``sdpa`` on CUDA do not: they
keep q, k, v, the output and a per-row log-sum-exp and recompute the scores
in backward. ``sdpa`` on CPU uses its fused kernel only without attention
dropout; training with dropout falls back to the math kernel, which stores
the scores just like eager (in fp32, with fp32 copies of q, k and v, for
16-bit inputs).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.probe._calibrate import calibrate

FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
ATTENTION_IMPLEMENTATIONS = ("eager", *FUSED_ATTENTION)
TASKS = ("auto", "base", "sequence-classification", "token-classification", "masked-lm", "causal-lm")
OPTIMIZER_STATE_BYTES = {"adamw": 8, "adam": 8, "sgd-momentum": 4, "sgd": 0, "none": 0}
# Bytes in fp32 per element of the temporaries the optimizer step allocates (Adam's sqrt(exp_avg_sq) / c).
_STEP_TEMPORARY_BYTES = {"adamw": 4, "adam": 4, "sgd-momentum": 0, "sgd": 0, "none": 0}
# The analytic rule's HF models whose MLP is gated (gate * act(up)), whose RMSNorm upcasts to fp32
# in Python and whose 16-bit eager softmax runs in fp32; a causal LM's own class is counted instead
# (tokenbatch.probe._calibrate), this list serves encoders, inference and the fallback.
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

# Activations written in Python (transformers.activations): I-sized tensors each keeps for
# backward beyond a fused activation's one.
_ACTIVATION_EXTRA = {"gelu_new": 3}


def _get(config: Any, *names: str, default: Any = None) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value is not None:
            return value
    return default


def _dropout(config: Any, *names: str) -> float:
    return float(_get(config, *names, default=0.0))


def resolve_task(config: Any, task: str = "auto", model: Any = None) -> str:
    """``task``, or for ``"auto"`` the head that ``model``'s class (when given) or else
    ``config.architectures`` names (else sequence classification).

    A model built from a config in code has no ``architectures``: its class is
    what says that a ``LlamaForCausalLM`` carries a vocabulary-wide head.
    """
    task = _checks.one_of("task", task, TASKS)
    if task != "auto":
        return task
    names = [type(model).__name__] if model is not None else []
    names += list(getattr(config, "architectures", None) or [])[:1]
    for name in names:
        for suffix, head in (
            ("ForMaskedLM", "masked-lm"),
            ("ForCausalLM", "causal-lm"),
            ("LMHeadModel", "causal-lm"),
            ("ForTokenClassification", "token-classification"),
            ("ForSequenceClassification", "sequence-classification"),
        ):
            if name.endswith(suffix):
                return head
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


def check_margin(margin: float) -> float:
    """``margin`` if it is a fraction in ``[0, 1)``, the share of the memory limit kept free."""
    margin = _checks.non_negative_number("margin", margin)
    if margin >= 1:
        raise ValueError(f"margin should be a fraction below 1 (e.g. 0.1), but got margin={margin!r}")
    return margin


@dataclass(frozen=True)
class MemoryModel:
    """Peak training memory in bytes of one step on ``B`` sequences padded to ``L`` tokens.

    ``predict(B, L) = max(step_peak, constant + B * (linear*L' + quadratic*L'**2 + per_sample))``
    with ``L'`` the length padded to ``pad_to_multiple_of``: forward + backward
    grows with the batch, the optimizer step's peak (gradients, optimizer
    state) does not.

    Example:
        >>> model = MemoryModel(constant=1e6, linear=2000.0, quadratic=50.0, per_sample=0.0)
        >>> model.predict(4, 100)
        3800000.0
        >>> model.budget(10e6, margin=0.1), model.token_cost().quadratic
        (8000000.0, 0.025)
        >>> from transformers import BertConfig
        >>> est = MemoryModel.from_config(BertConfig(), dtype=torch.float16, attn_implementation="eager")
        >>> est.stores_scores, est.quadratic  # 12 layers x 5 bytes x 12 heads, + 2 for the mask
        (True, 722.0)
    """

    constant: float
    """Bytes held under the activations: weights and optimizer state (the analytic estimate),
    or what the fit finds."""
    linear: float
    """Bytes per padded token."""
    quadratic: float
    """Bytes per pair of tokens in one sequence (attention scores, attention mask)."""
    per_sample: float
    """Bytes per sequence whatever its length (classification head)."""
    step_peak: float = 0.0
    """The optimizer step's peak, whatever the batch: measured, or for the analytic estimate
    weights, gradients, optimizer state and the update's temporaries (0 for inference)."""
    pad_to_multiple_of: int = 1
    stores_scores: bool | None = None
    """Whether attention keeps the ``L x L`` scores for backward (``None``: fitted, not known)."""

    @classmethod
    def from_config(
        cls,
        config: Any,
        *,
        dtype: torch.dtype = torch.float32,
        training: bool = True,
        attn_implementation: str | None = None,
        device: str = "cuda",
        task: str = "auto",
        optimizer: str = "adamw",
        pad_to_multiple_of: int = 1,
        shards: int = 1,
    ) -> MemoryModel:
        """Estimate the training (or inference) memory of a transformers model from its config.

        Korthikanti et al. (2022)'s activation counts, adjusted for fp32, for
        CPU dropout masks, for fused attention and for the causal-LM loss's fp32
        buffers, plus weights, gradients and optimizer state; within about 20% of
        :func:`~tokenbatch.find_max_tokens` on the BERTs measured. For
        ``task="causal-lm"`` training the layers' activations and the parameters
        are counted on the config's own model class on the ``meta`` device (see
        the module's docstring); a class that cannot be built logs why and the
        analytic rule is used.

        Args:
            config: a ``transformers.PretrainedConfig`` of an encoder (BERT family)
                or decoder (GPT-2, Llama family) model.
            dtype: the dtype activations are computed in (``torch.float32``,
                ``torch.float16``, ``torch.bfloat16``); weights are assumed in it too.
            training: ``False`` estimates a no-grad forward pass (one layer's
                working set) instead of forward + backward.
            attn_implementation: ``"eager"``, ``"sdpa"``, ``"flash_attention_2"``,
                ... ; ``None`` reads ``config._attn_implementation`` (``"sdpa"``
                when unset, transformers' default).
            device: ``"cuda"`` or ``"cpu"``: dropout masks and sdpa kernels differ.
            task: the head: ``"auto"`` (from ``config.architectures``, else
                sequence classification), ``"base"``, ``"sequence-classification"``,
                ``"token-classification"``, ``"masked-lm"`` or ``"causal-lm"``.
            optimizer: ``"adamw"`` (two states per parameter, 8 bytes in fp32), ``"sgd-momentum"``
                (one) or ``"sgd"`` (none); only affects ``constant`` and ``step_peak``.
            pad_to_multiple_of: the collator's padding multiple.
            shards: how many ranks share each parameter: FSDP2's shard group (1: not sharded).
                Weights, gradients, optimizer state and the step's temporaries are divided among
                them; activations are each rank's own and are not. FSDP all-gathers a unit's
                parameters while it runs: the constant gains one full copy of the largest
                parameter (the LM head, which the root unit keeps gathered through the step), and
                the step's peak the end of backward, where that parameter's unit holds its full
                copy, its full gradient and the gradient's reduce-scatter buffers besides
                (``benchmarks/fsdp_memory.py``: Llama on 2 CPU processes, within 7%).

        Raises:
            ValueError: an encoder-decoder config, or an unknown option.

        Example:
            >>> from transformers import BertConfig
            >>> eager = MemoryModel.from_config(BertConfig(), attn_implementation="eager")
            >>> flash = MemoryModel.from_config(BertConfig(), attn_implementation="flash_attention_2")
            >>> eager.cost_model().quadratic > 0, flash.cost_model().quadratic
            (True, 0.0)
        """
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
        p_hid = _dropout(config, "hidden_dropout_prob", "resid_pdrop", "hidden_dropout", "dropout")
        gated = getattr(config, "model_type", "") in _GATED_MODEL_TYPES
        activation = _get(config, "activation_function", "hidden_act", default="")
        e = torch.empty((), dtype=torch.float32 if dtype is None else dtype).element_size()
        m = 1 if device == "cuda" else e  # fused bool dropout mask on CUDA; a dtype-sized mask on CPU
        scores = stores_attention_scores(
            attn_implementation, device=device, training=training, attention_dropout=p_att
        )
        kv_width = h * kv // a
        # A causal LM's layers are counted on its own class (see tokenbatch.probe._calibrate), else
        # (encoders, inference, a class that cannot be built) by the analytic rule below.
        layer = (
            calibrate(config, torch.float32 if dtype is None else dtype)
            if task == "causal-lm" and training
            else None
        )

        if layer is not None:
            # the calibration runs without dropout: its masks (and eager attention's dropped scores,
            # which the second matmul keeps instead of the softmax's output) are added here
            masks = 2 * m * h if p_hid > 0 else 0
            if attn_implementation == "eager":
                layer_linear = layer.eager_linear + masks
                layer_quadratic = layer.eager_quadratic + (a * (m + e) if p_att > 0 else 0)
            elif scores:
                # CPU sdpa's math kernel: eager's tensors, and for 16-bit inputs fp32 copies of q, k
                # and v, fp32 scores and an fp32 dropout mask and output
                upcast = e < 4
                layer_linear = layer.eager_linear + masks + (3 * (4 - e) * h if upcast else 0)
                layer_quadratic = a * (4 + 8) if upcast else layer.eager_quadratic + a * (m + e)
            else:
                # the stand-in keeps k and v repeated to every head, as transformers passes them to sdpa
                # for padded batches; flash attention takes them at their own width
                head_dim = int(_get(config, "head_dim", default=h // a))
                narrow = 2 * e * (a - kv) * head_dim if attn_implementation.startswith("flash") else 0
                layer_linear, layer_quadratic = layer.fused_linear - narrow + masks, 0
            embeddings = e * h + (m * h if p_hid > 0 else 0) + 8
            # + the final hidden state the head keeps, + the backward pass's working set at its start
            linear = n_layers * layer_linear + embeddings + e * h + 4 * e * h
            quadratic = float(n_layers * layer_quadratic)
        elif training:
            # eager: x, q, k, v (k and v repeated to all heads), the context; fused: x, q, k, v,
            # the kernel's output and its fp32 log-sum-exp per row and head, the context
            attention = 5 * e * h if scores else e * (4 * h + 2 * kv_width) + 4 * a
            # CPU sdpa's math kernel (the one that keeps the scores) computes 16-bit inputs in fp32:
            # it keeps fp32 copies of q, k and v, and fp32 scores
            upcast = attn_implementation == "sdpa" and device == "cpu" and scores and e < 4
            if upcast:
                attention = 2 * e * h + 3 * 4 * h
            # + the python GELUs' intermediates: GPT-2's gelu_new keeps its input, 0.5*x, tanh(...)
            # and 1 + tanh(...) where torch's fused GELU keeps only the input
            mlp = e * h + e * inter * ((4 if gated else 2) + _ACTIVATION_EXTRA.get(activation, 0))
            norms = 2 * e * h + 16 if not gated else 2 * (8 + e) * h
            masks = 2 * m * h if p_hid > 0 else 0
            layer_linear = attention + mlp + norms + masks
            # the softmax's output (Llama-family eager attention computes it in fp32 and keeps
            # that and its 16-bit copy), with attention dropout its mask and output
            softmax, dropout = (4, 4 + 4) if upcast else (e + (4 if gated and e < 4 else 0), m + e)
            layer_quadratic = a * (softmax + (dropout if p_att > 0 else 0)) if scores else 0
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

        lm_head = task in ("masked-lm", "causal-lm") and not getattr(config, "tie_word_embeddings", True)
        if layer is not None:
            params, largest = layer.parameters, layer.largest
        else:
            params, largest = _parameter_count(h, n_layers, inter, kv_width, vocab, config, gated, lm_head)
        # torch's optimizers keep their state in the parameters' dtype
        state = OPTIMIZER_STATE_BYTES[optimizer] * e // 4 if training else 0
        # Forward + backward peaks where the activations are all alive and hardly any gradient
        # exists yet (backward frees each layer's activations as it makes the layer's gradients),
        # so the batch-dependent line starts at weights + optimizer state. The gradients all
        # exist at the optimizer step, whose update needs temporaries: single-tensor AdamW (CPU)
        # two of its largest parameter at a time, foreach AdamW (CUDA's default) one per parameter.
        elements = params if device == "cuda" else 2 * largest
        temporaries = _STEP_TEMPORARY_BYTES[optimizer] * e // 4 * elements
        # Sharded (FSDP2): each rank holds 1/shards of every parameter, gradient and state, plus what
        # FSDP all-gathers (see `shards` above).
        shards = _checks.positive_int("shards", shards)
        constant = float(params * (e + state)) / shards
        step_peak = float(params * (2 * e + state) + temporaries) / shards if training else 0.0
        if shards > 1:
            gathered = float(e * largest)
            end_of_backward = float(params * (2 * e + state)) / shards + (4 + 1 / shards) * gathered
            constant += gathered
            step_peak = max(step_peak, end_of_backward) if training else 0.0
        return cls(
            constant=constant,
            linear=float(linear),
            quadratic=quadratic,
            per_sample=per_sample,
            step_peak=step_peak,
            pad_to_multiple_of=_checks.positive_int("pad_to_multiple_of", pad_to_multiple_of),
            stores_scores=scores,
        )

    def cost_model(self) -> CostModel:
        """The batch-dependent terms as a :class:`~tokenbatch.CostModel` in bytes."""
        return CostModel(self.linear, self.quadratic, self.per_sample, self.pad_to_multiple_of)

    def bytes_per_token(self) -> float:
        """Bytes in one unit of :meth:`token_cost`: ``linear``, or 1 when there is no linear term."""
        return self.linear if self.linear > 0 else 1.0

    def token_cost(self) -> CostModel:
        """The same shape in token units (``linear = 1``): a budget of ``bytes / linear`` tokens."""
        unit = self.bytes_per_token()
        return CostModel(
            self.linear / unit, self.quadratic / unit, self.per_sample / unit, self.pad_to_multiple_of
        )

    @overload
    def predict(self, batch_size: int, length: int) -> float: ...
    @overload
    def predict(self, batch_size: np.ndarray, length: np.ndarray | int) -> np.ndarray: ...

    def predict(self, batch_size: np.ndarray | int, length: np.ndarray | int) -> np.ndarray | float:
        """Predicted peak bytes of one step; numpy arrays broadcast."""
        peak = np.maximum(self.step_peak, self.constant + self.cost_model().cost(batch_size, length))
        return float(peak) if np.ndim(peak) == 0 else peak

    def budget(self, memory_limit: float, *, margin: float = 0.1) -> float:
        """Largest cost in bytes (of :meth:`cost_model`) with a peak under ``(1 - margin) * memory_limit``.

        Divide by :meth:`bytes_per_token` for a budget in the units of :meth:`token_cost`.

        Raises:
            ValueError: weights, gradients and optimizer state alone exceed it.
        """
        memory_limit = _checks.positive_number("memory_limit", memory_limit)
        margin = check_margin(margin)
        target = memory_limit * (1 - margin)
        budget = target - self.constant
        if budget <= 0 or self.step_peak > target:
            fixed = max(self.constant, self.step_peak)
            raise ValueError(
                f"memory_limit={memory_limit:,.0f} bytes with margin={margin} leaves "
                f"{target:,.0f} bytes and no room for activations: weights, gradients and optimizer "
                f"state alone take {fixed:,.0f}; raise memory_limit, lower margin or use a smaller model"
            )
        return budget


def _parameter_count(
    h: int, n_layers: int, inter: int, kv_width: int, vocab: int, config: Any, gated: bool, lm_head: bool
) -> tuple[int, int]:
    """Approximate number of parameters (embeddings, attention, MLP, norms, an untied LM head),
    and the size of the largest one."""
    positions = int(_get(config, "max_position_embeddings", "n_positions", default=0))
    if _get(config, "rope_theta", "rope_parameters") is not None:
        positions = 0  # rotary embeddings have no weights
    attention = h * (h + 2 * kv_width) + h * h + 4 * h
    mlp = h * inter * (3 if gated else 2) + inter + h
    total = n_layers * (attention + mlp + 4 * h) + (vocab * (2 if lm_head else 1) + positions) * h
    return int(np.int64(total)), h * max(vocab, positions, inter, h)


@dataclass(frozen=True)
class Measurement:
    """Peak memory of one probe step on ``batch_size`` sequences of ``length`` tokens."""

    batch_size: int
    length: int
    peak_bytes: int
    """The step's peak: the larger of the two phases below (0 when it ran out of memory)."""
    forward_backward_bytes: int
    optimizer_step_bytes: int
    oom: bool
    seconds: float

    @property
    def tokens(self) -> int:
        """Padded tokens in the batch."""
        return self.batch_size * self.length


def _nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Non-negative least squares for a handful of columns: the best feasible least-squares
    solution over every subset of columns (the optimum is one of them, the problem being convex)."""
    best, best_residual = np.zeros(a.shape[1]), float(np.sum(b * b))
    for size in range(1, a.shape[1] + 1):
        for columns in itertools.combinations(range(a.shape[1]), size):
            sub = a[:, columns]
            coef, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if np.any(coef < 0):
                continue
            residual = float(np.sum((sub @ coef - b) ** 2))
            if residual < best_residual:
                best_residual = residual
                best = np.zeros(a.shape[1])
                best[list(columns)] = coef
    return best


def fit_memory(measurements: Sequence[Measurement], *, pad_to_multiple_of: int = 1) -> MemoryModel:
    """Fit a :class:`MemoryModel` to measurements by non-negative, relative least squares.

    Forward + backward peaks are fitted to ``constant + B*(linear*L + quadratic*L**2 +
    per_sample)``, each point weighted by ``1 / measured`` so that the fit minimises
    relative error; ``step_peak`` is the largest optimizer-step peak seen. Runs that
    ran out of memory are ignored.

    Raises:
        ValueError: fewer than 4 measured shapes, or fewer than 3 distinct lengths.
    """
    pad_to_multiple_of = _checks.positive_int("pad_to_multiple_of", pad_to_multiple_of)
    ok = [m for m in measurements if not m.oom]
    shapes = {(m.batch_size, m.length) for m in ok}
    lengths = {m.length for m in ok}
    if len(shapes) < 4 or len(lengths) < 3:
        raise ValueError(
            f"fitting needs at least 4 measured shapes over at least 3 lengths, but got "
            f"{len(shapes)} shapes over lengths {sorted(lengths)}; measure more shapes"
        )
    b = np.array([m.batch_size for m in ok], dtype=np.float64)
    padded = CostModel(pad_to_multiple_of=pad_to_multiple_of).padded_length(
        np.array([m.length for m in ok], dtype=np.int64)
    )
    length = np.asarray(padded, dtype=np.float64)
    y = np.array([m.forward_backward_bytes for m in ok], dtype=np.float64)
    design = np.stack([np.ones_like(b), b * length, b * length**2, b], axis=1)
    # Scale columns to comparable magnitudes so lstsq is well conditioned.
    scale = np.abs(design).max(axis=0)
    weight = 1.0 / y
    coef = _nnls(design / scale * weight[:, None], y * weight) / scale
    return MemoryModel(
        constant=float(coef[0]),
        linear=float(coef[1]),
        quadratic=float(coef[2]),
        per_sample=float(coef[3]),
        step_peak=float(max(m.optimizer_step_bytes for m in ok)),
        pad_to_multiple_of=pad_to_multiple_of,
    )
