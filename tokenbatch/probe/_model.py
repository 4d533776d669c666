"""One memory model, ``constant + B * (linear*L + quadratic*L**2 + per_sample)`` bytes, two sources.

:meth:`MemoryModel.from_config` estimates the terms from a transformers
config (the formula is in ``tokenbatch/_analytic.py``); :func:`tokenbatch.probe.fit_memory`
fits them to measured steps. Either way the same methods turn the model into
a :class:`~tokenbatch.CostModel` and a budget.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, overload

import numpy as np
import torch

from tokenbatch import _analytic, _checks
from tokenbatch.cost import CostModel


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
    """Bytes for weights, gradients and optimizer state."""
    linear: float
    """Bytes per padded token."""
    quadratic: float
    """Bytes per pair of tokens in one sequence (attention scores, attention mask)."""
    per_sample: float
    """Bytes per sequence whatever its length (classification head)."""
    step_peak: float = 0.0
    """The optimizer step's peak, whatever the batch (measured; 0 for the analytic estimate)."""
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
    ) -> MemoryModel:
        """Estimate the training (or inference) memory of a transformers model from its config.

        Korthikanti et al. (2022)'s activation counts, adjusted for fp32, for
        CPU dropout masks and for fused attention, plus weights, gradients and
        optimizer state; within about 20% of :func:`~tokenbatch.find_max_tokens`
        on the BERTs measured.

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
            optimizer: ``"adamw"`` (8 bytes of state per parameter), ``"sgd-momentum"``
                (4) or ``"sgd"`` (0); only affects ``constant``.
            pad_to_multiple_of: the collator's padding multiple.

        Raises:
            ValueError: an encoder-decoder config, or an unknown option.

        Example:
            >>> from transformers import BertConfig
            >>> eager = MemoryModel.from_config(BertConfig(), attn_implementation="eager")
            >>> flash = MemoryModel.from_config(BertConfig(), attn_implementation="flash_attention_2")
            >>> eager.cost_model().quadratic > 0, flash.cost_model().quadratic
            (True, 0.0)
        """
        terms = _analytic.memory_terms(
            config,
            dtype=dtype,
            training=training,
            attn_implementation=attn_implementation,
            device=device,
            task=task,
            optimizer=optimizer,
        )
        return cls(
            constant=terms.constant,
            linear=terms.linear,
            quadratic=terms.quadratic,
            per_sample=terms.per_sample,
            pad_to_multiple_of=_checks.positive_int("pad_to_multiple_of", pad_to_multiple_of),
            stores_scores=terms.stores_scores,
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
