"""The sampler's budget slot: a number, or ``"auto"`` until :meth:`resolve` gives it one.

A sampler made with ``max_tokens="auto"`` holds no budget: it cannot plan, so
every use that needs a plan raises :class:`UnresolvedBudgetError`, which says
how to resolve it. The resolver (:func:`tokenbatch.auto_budget`) lives in
``probe/``, above the sampler and the guard: it needs the model, which the
sampler never sees (see docs/architecture.md).
"""

from __future__ import annotations

import math
from typing import Any, cast

import numpy as np

from tokenbatch import _checks
from tokenbatch._history import check_oversize, warn_if_one_length

AUTO = "auto"

RESOLVE_HINT = (
    "give it a budget with tokenbatch.auto_budget(model, sampler, memory_limit=...) (the remembered "
    "budget, else the probe), or sampler.resolve(max_tokens) with a number; "
    "TokenBudgetTrainer(max_tokens='auto') does this itself"
)


class UnresolvedBudgetError(RuntimeError):
    """A sampler made with ``max_tokens="auto"`` was used before its budget was resolved."""


def is_auto(max_tokens: Any) -> bool:
    """Whether ``max_tokens`` asks for an automatic budget (the string ``"auto"``, any case).

    Raises:
        TypeError: another string (``"100"``, or a typo of "auto").
    """
    if isinstance(max_tokens, str):
        if max_tokens.strip().lower() == AUTO:
            return True
        raise TypeError(
            f"max_tokens should be a positive number or 'auto', but got max_tokens={max_tokens!r}"
        )
    return False


class BudgetSlot:
    """The part of :class:`~tokenbatch.TokenBudgetBatchSampler` that holds its first budget.

    The sampler sets ``_keys``, ``_unit``, ``lengths``, ``oversize`` and
    ``max_batch_size`` before calling :meth:`_init_budget`.
    """

    _keys: np.ndarray
    _unit: np.ndarray
    lengths: np.ndarray
    oversize: str
    max_batch_size: int | None

    def _init_budget(self, max_tokens: float | str) -> None:
        # NaN until resolved: every path that plans calls _need_budget() first, so it is never read.
        self._max_tokens = self._admitted = self._epoch_max_tokens = math.nan
        self._resolved = False
        if not is_auto(max_tokens):
            self.resolve(cast(float, max_tokens))

    @property
    def resolved(self) -> bool:
        """False for a sampler made with ``max_tokens="auto"`` until :meth:`resolve` is called."""
        return self._resolved

    def resolve(self, max_tokens: float) -> None:
        """Give a sampler made with ``max_tokens="auto"`` its budget, before its first plan.

        :func:`tokenbatch.auto_budget` calls it with the agreed budget; call it
        yourself with a number found another way. Oversize samples are checked
        against it as the constructor checks a numeric ``max_tokens``.

        Raises:
            ValueError: the sampler has a budget already (use ``replan`` to change it).

        Example:
            >>> from tokenbatch import TokenBudgetBatchSampler
            >>> sampler = TokenBudgetBatchSampler([5, 3, 8, 2], max_tokens="auto")
            >>> sampler.resolved
            False
            >>> sampler.resolve(16)
            >>> sampler.max_tokens, len(sampler) > 0
            (16.0, True)
        """
        if self._resolved:
            raise ValueError(
                f"resolve() gives a budget to a sampler made with max_tokens='auto', but this one has "
                f"max_tokens={self._max_tokens:g} already; change it with replan(max_tokens, steps_done=...)"
            )
        budget = _checks.positive_number("max_tokens", max_tokens)
        check_oversize(self._keys, self._unit, budget, self.oversize)
        warn_if_one_length(self.lengths, self._unit, budget, self.max_batch_size)
        self._max_tokens = self._admitted = self._epoch_max_tokens = budget
        self._resolved = True

    def _need_budget(self) -> None:
        if not self._resolved:
            raise UnresolvedBudgetError(
                f"this TokenBudgetBatchSampler has max_tokens='auto' and no budget yet: {RESOLVE_HINT}"
            )
