"""Token-budget batches from a stream of examples: :class:`TokenBudgetStream`."""

from tokenbatch.stream._dataset import TokenBudgetStream

__all__ = ["TokenBudgetStream"]
