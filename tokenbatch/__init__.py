"""tokenbatch: length-aware dynamic batching under a token budget, with an OOM fallback."""

from tokenbatch.cost import CostModel
from tokenbatch.lengths import column_lengths, text_lengths
from tokenbatch.lr import BatchScaledLR, count_batch, global_count, global_token_count
from tokenbatch.oom import OOMEvent, OOMFallback, RankFailedError, SampleTooLargeError, is_oom
from tokenbatch.plan import OversizeSampleError
from tokenbatch.probe import (
    AutoBudget,
    BudgetCache,
    BudgetKey,
    ProbeResult,
    auto_budget,
    find_max_tokens,
    remember_budget,
)
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

__version__ = "0.1.0"

__all__ = [
    "AutoBudget",
    "BatchScaledLR",
    "BudgetCache",
    "BudgetKey",
    "CostModel",
    "OOMEvent",
    "OOMFallback",
    "OversizeSampleError",
    "ProbeResult",
    "RankFailedError",
    "SampleTooLargeError",
    "TokenBudgetBatchSampler",
    "TokenBudgetStream",
    "__version__",
    "auto_budget",
    "column_lengths",
    "count_batch",
    "find_max_tokens",
    "global_count",
    "global_token_count",
    "is_oom",
    "remember_budget",
    "text_lengths",
]
