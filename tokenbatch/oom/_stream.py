"""The guard's strategy for a :class:`~tokenbatch.TokenBudgetStream` in halve mode.

A stream has no plan to re-plan, and the DataLoader has read batches ahead
(a worker's queue, accelerate's look-ahead) that were formed under the old
budget. So halve mode on a stream keeps the failed step, like split mode,
and runs it in micro-batches that fit the new budget; the new budget goes to
the stream, which forms every later batch under it (the examples it buffers
included). Any batch formed before, costing more than the budget in force, is
micro-batched the same way. Every batch the DataLoader gives is trained once,
and the ranks keep yielding the same number of batches::

    formed:   b0 b1 b2 | b3 (read ahead)     | b4 b5 ... (formed under the new budget)
    trained:  b0 b1 b2'(micro, after OOM)  b3'(micro)  b4 b5 ...
"""

from __future__ import annotations

from typing import Any, ClassVar

from tokenbatch._epoch import EpochCursor
from tokenbatch._stream_cursor import StreamCursor
from tokenbatch.cost import CostModel
from tokenbatch.oom._split import BatchShape, Piece, split_batch
from tokenbatch.oom._strategies import Halve, Strategy
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream


class StreamHalve(Strategy):
    """Halve mode on a stream: keep the step, re-budget the stream, micro-batch what was formed before."""

    name: ClassVar[str] = "halve"
    keeps_step: ClassVar[bool] = True
    rebudgets: ClassVar[bool] = True

    def __init__(self, halve: Halve, stream: TokenBudgetStream) -> None:
        self.halve, self.stream = halve, stream
        self.pad_token_id = halve.pad_token_id
        self.weight = halve.weight

    def split_budget(self, micro_tokens: float, sampler_tokens: float) -> float | None:
        # Until a re-budget every batch was formed under the budget in force: run it as formed.
        return micro_tokens if micro_tokens < self.stream.ceiling else None

    def split(
        self, batch: Any, shape: BatchShape, cost: CostModel, budget: float, *, fill: bool = False
    ) -> list[Piece]:
        # A stream does not grow, so fill stays False here; it is taken for Strategy's signature.
        weight, trim = self.halve.weight, self.halve.trim_padding
        return split_batch(batch, shape, cost, budget, weight=weight, trim=trim, fill=fill)


def with_cursor(
    sampler: TokenBudgetBatchSampler | TokenBudgetStream, strategy: Strategy
) -> tuple[Strategy, EpochCursor | StreamCursor]:
    """The strategy and the cursor the guard uses for the batches ``sampler`` forms.

    Raises:
        TypeError: ``sampler`` is neither a sampler nor a stream of tokenbatch.
    """
    if isinstance(sampler, TokenBudgetBatchSampler):
        return strategy, EpochCursor(sampler)
    if not isinstance(sampler, TokenBudgetStream):
        raise TypeError(
            f"sampler should be the tokenbatch.TokenBudgetBatchSampler feeding the DataLoader (or the "
            f"TokenBudgetStream it reads), but got sampler of type {type(sampler).__name__}"
        )
    if isinstance(strategy, Halve):
        strategy = StreamHalve(strategy, sampler)
    return strategy, StreamCursor(sampler)
