"""What the guard does with a step that ran out of memory: split it, or halve the budget and re-plan.

A strategy holds its options, checked once when it is made, and answers the
guard's questions: how to read a batch's row lengths, whether to cut this
attempt into micro-batches, and whether the failed step is kept (retried) or
dropped. The budgets themselves are the guard's state, so one strategy object
may serve several guards.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.oom._split import BatchShape, Piece, inspect_batch, split_batch

MODES = ("split", "halve")


class Strategy:
    """The base of :class:`Split` and :class:`Halve`."""

    name: ClassVar[str]
    """``"split"`` or ``"halve"``: the guard's ``mode``."""
    keeps_step: ClassVar[bool]
    """True: the failed step is retried under the new budget; False: it is dropped."""
    rebudgets: ClassVar[bool] = False
    """True: the new budget goes to the sampler (or stream) that forms the batches."""
    pad_token_id: int | None

    def read(self, batch: Any) -> BatchShape:
        """The batch's rows and their real lengths (what ran out of memory, and what to split)."""
        return inspect_batch(batch, self.pad_token_id)

    def split_budget(self, micro_tokens: float, sampler_tokens: float) -> float | None:
        """The budget to cut an attempt's batch to, or None to run it whole."""
        return None

    def split(
        self, batch: Any, shape: BatchShape, cost: CostModel, budget: float, *, fill: bool = False
    ) -> list[Piece]:
        """The micro-batches of ``batch`` within ``budget``; ``fill``: the first one as large as it allows."""
        raise TypeError(f"the {self.name!r} strategy does not split batches")


@dataclass(frozen=True, kw_only=True)
class Split(Strategy):
    """On out-of-memory, keep the step: run its batch as micro-batches that fit a smaller budget.

    The planned batches and optimizer steps stay as they are; gradients are
    accumulated over the micro-batches, weighted so that they add up to the
    whole batch's. Retries shrink the micro-batch budget until one fits.

    The gradients, and so the run, then match the unsplit batch's up to
    floating point when each sample's loss does not depend on how the batch
    is cut: no dropout or other randomness drawn per forward pass (each
    micro-batch draws its own masks), no layer that mixes the samples of a
    batch (BatchNorm in training mode, in-batch negatives), padding masked
    out (``trim_padding`` changes only the padding), and ``weight`` saying
    what the loss averages over.

    Args:
        weight: the micro-batch loss weights: ``"samples"`` (for a loss
            averaged over samples), ``"tokens"`` (averaged over real tokens),
            or a function of a micro-batch returning its count.
        pad_token_id: read row lengths from ``input_ids`` when batches have no ``attention_mask``.
        trim_padding: cut each micro-batch to its longest row (right-padded batches).

    Example:
        >>> import torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> sampler = TokenBudgetBatchSampler([4] * 12, max_tokens=16, seed=0)
        >>> fallback = OOMFallback(sampler, torch.nn.Linear(4, 1), mode=Split(weight="tokens"))
        >>> fallback.mode
        'split'
    """

    name: ClassVar[str] = "split"
    keeps_step: ClassVar[bool] = True
    weight: str | Callable[[Any], float] = "samples"
    pad_token_id: int | None = None
    trim_padding: bool = True

    def __post_init__(self) -> None:
        _check_split_options(self)

    def split_budget(self, micro_tokens: float, sampler_tokens: float) -> float | None:
        # Until a first out-of-memory error the batches run as planned, oversize ones included.
        return micro_tokens if micro_tokens < sampler_tokens else None

    def split(
        self, batch: Any, shape: BatchShape, cost: CostModel, budget: float, *, fill: bool = False
    ) -> list[Piece]:
        return split_batch(batch, shape, cost, budget, weight=self.weight, trim=self.trim_padding, fill=fill)


@dataclass(frozen=True, kw_only=True)
class Halve(Strategy):
    """On out-of-memory, drop the step: shrink the sampler's budget and re-plan the rest of the epoch.

    The semantics of accelerate's ``find_executable_batch_size``, without
    the restart: the failed batch's samples are planned again, under the new
    budget, with the rest of the epoch. With a :class:`~tokenbatch.TokenBudgetStream`
    the stream forms its next batches under the new budget, and the batches it
    had formed already (the failed one, those read ahead) are trained in
    micro-batches, as :class:`Split` does (see ``docs/streaming.md``).

    Args:
        pad_token_id: read row lengths from ``input_ids`` when batches have no
            ``attention_mask`` (the failed batch's cost and longest sequence).
        weight, trim_padding: as :class:`Split`'s, for a stream's micro-batches.
    """

    name: ClassVar[str] = "halve"
    keeps_step: ClassVar[bool] = False
    rebudgets: ClassVar[bool] = True
    pad_token_id: int | None = None
    weight: str | Callable[[Any], float] = "samples"
    trim_padding: bool = True

    def __post_init__(self) -> None:
        _check_split_options(self)


def _check_split_options(strategy: Split | Halve) -> None:
    if not (strategy.weight in ("samples", "tokens") or callable(strategy.weight)):
        raise ValueError(
            f"weight should be 'samples', 'tokens' or a function, but got weight={strategy.weight!r}"
        )
    object.__setattr__(strategy, "trim_padding", _checks.boolean("trim_padding", strategy.trim_padding))


def as_strategy(mode: str | Strategy) -> Strategy:
    """The strategy for ``mode``: ``"split"``, ``"halve"``, or a :class:`Split` or :class:`Halve`."""
    if isinstance(mode, Strategy):
        return mode
    if mode not in MODES:
        raise ValueError(
            f"mode should be one of 'split', 'halve' (or a tokenbatch.oom.Split or Halve), "
            f"but got mode={mode!r}"
        )
    return Split() if mode == "split" else Halve()


# Options OOMFallback took before its strategies and budget remembering moved out, and where they went.
_MOVED = {
    "weight": "pass mode=tokenbatch.oom.Split(weight=...)",
    "pad_token_id": "pass mode=tokenbatch.oom.Split(pad_token_id=...) (or Halve(pad_token_id=...))",
    "trim_padding": "pass mode=tokenbatch.oom.Split(trim_padding=...)",
    "remember": "call tokenbatch.remember_budget(fallback, key) after making the fallback",
    "cache": "call tokenbatch.remember_budget(fallback, key, cache=cache) after making the fallback",
}


def moved_option(options: dict[str, Any]) -> TypeError:
    """The TypeError for an old OOMFallback keyword, saying where the option went."""
    name, value = next(iter(options.items()))
    if name not in _MOVED:
        return TypeError(f"OOMFallback() got an unexpected keyword argument {name!r}")
    return TypeError(
        f"{name} is no longer an OOMFallback option: {_MOVED[name]} instead, but got {name}={value!r:.80}"
    )
