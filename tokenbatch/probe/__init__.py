"""Find the token budget that fits your model on your device, by measuring before training.

:func:`find_max_tokens` runs real forward + backward + optimizer steps on
synthetic worst-case batches (every sequence as long as the batch's longest)
and returns a :class:`ProbeResult`. With ``method="fit"`` (the default) it
fits a :class:`MemoryModel` to the measured peaks and checks the budget on the
worst batches it allows; ``method="search"`` doubles then bisects the budget
of a cost model you choose. The model, the optimizer and every random number
generator are restored afterwards. Probe the bare model in one process (not a
DDP-wrapped one); the budget is per device::

    result = find_max_tokens(model, lengths=lengths, memory_limit=8 * 2**30)
    sampler = TokenBudgetBatchSampler(lengths, result.max_tokens, cost=result.cost)

:class:`MemoryModel` is the one memory model: fitted to measured steps
(``result.fit``) or estimated from a transformers config without running
anything (:meth:`MemoryModel.from_config`, whose ``.cost_model()`` and
``.token_cost()`` are a :class:`~tokenbatch.CostModel`).

A budget that worked is worth keeping: :class:`BudgetCache` is a small JSON
file of budgets keyed by :class:`BudgetKey` (model, device and memory, dtype,
world size), each entry used only for data within the padded lengths it was
found on, in the same cost units; ``tokenbatch probe --write-cache`` stores what it measured, and
:func:`remember_budget` starts an OOM fallback from the cached budget and
records each budget it falls back to. ``max_tokens="auto"`` puts it together:
:func:`auto_budget` gives a sampler made with it the remembered budget, else
the probe's (see docs/trainer.md).

On CPU the probe counts PyTorch's tensor bytes (the torch profiler's memory
accounting; on CUDA the allocator's peak statistics), and what the operating
system sees can be well above them: glibc's malloc serves blocks below its
sliding mmap threshold (up to 32 MiB) from a heap that it rarely gives back,
so freed activations leave holes. In ``benchmarks/probe.py`` a tiny BERT under
``RLIMIT_AS`` fitted only about 0.63 of the probe's budget with glibc's
defaults, and 1.07 of it (the margin at work) with
``MALLOC_MMAP_THRESHOLD_=65536``, which gives every tensor of 64 KiB or more
its own mapping, returned when freed. Train on CPU with that setting (or
jemalloc / tcmalloc), or raise ``margin``.
"""

from tokenbatch.probe._auto import AutoBudget, auto_budget, parse_memory
from tokenbatch.probe._cache import BudgetCache, BudgetKey, remember_budget
from tokenbatch.probe._model import Measurement, MemoryModel
from tokenbatch.probe._search import ProbeResult, find_max_tokens

__all__ = [
    "AutoBudget",
    "BudgetCache",
    "BudgetKey",
    "Measurement",
    "MemoryModel",
    "ProbeResult",
    "auto_budget",
    "find_max_tokens",
    "parse_memory",  # "8GiB" -> bytes, for a --memory_limit option (the example's)
    "remember_budget",
]
