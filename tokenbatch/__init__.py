"""tokenbatch: length-aware dynamic batching under a token budget, with an OOM fallback."""

from tokenbatch.cost import CostModel
from tokenbatch.lengths import column_lengths, text_lengths
from tokenbatch.oom import OOMEvent, OOMFallback, RankFailedError, SampleTooLargeError, is_oom
from tokenbatch.plan import OversizeSampleError
from tokenbatch.probe import auto_budget, find_max_tokens
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

__version__ = "0.1.0"

__all__ = [
    "CostModel",
    "OOMEvent",
    "OOMFallback",
    "OversizeSampleError",
    "RankFailedError",
    "SampleTooLargeError",
    "TokenBudgetBatchSampler",
    "TokenBudgetStream",
    "__version__",
    "auto_budget",
    "column_lengths",
    "find_max_tokens",
    "is_oom",
    "text_lengths",
]
