"""tokenbatch: length-aware dynamic batching under a token budget, with an OOM fallback."""

from tokenbatch._budget import UnresolvedBudgetError
from tokenbatch.cost import CostModel
from tokenbatch.lengths import column_lengths, text_lengths
from tokenbatch.lr import BatchScaledLR, count_batch, global_count, global_token_count
from tokenbatch.oom import OOMEvent, OOMFallback, RankFailedError, SampleTooLargeError, is_oom
from tokenbatch.plan import OversizeSampleError
from tokenbatch.probe import auto_budget, find_max_tokens
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stats import PlanStats
from tokenbatch.stream import TokenBudgetStream

__version__ = "0.1.0"

__all__ = [
    "BatchScaledLR",
    "CostModel",
    "OOMEvent",
    "OOMFallback",
    "OversizeSampleError",
    "PlanStats",
    "RankFailedError",
    "SampleTooLargeError",
    "TokenBudgetBatchSampler",
    "TokenBudgetStream",
    "UnresolvedBudgetError",
    "__version__",
    "auto_budget",
    "column_lengths",
    "count_batch",
    "find_max_tokens",
    "global_count",
    "global_token_count",
    "is_oom",
    "text_lengths",
]
