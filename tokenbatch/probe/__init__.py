"""Find the token budget that fits your model on your device, by measuring before training.

Two ways, both running real forward + backward + optimizer steps on synthetic
worst-case batches (every sequence as long as the batch's longest):

* ``method="fit"`` (default): measure peak memory over a grid of (batch size,
  length) shapes sized near the limit, fit ``constant + B*(linear*L +
  quadratic*L**2 + per_sample)`` by least squares, and take the budget that
  keeps the predicted peak under ``(1 - margin) * memory_limit``; then run
  the worst batches that budget allows (longest and shortest sequences) and
  shrink it if any measures above. Gives a cost model as well as a budget.
* ``method="search"``: for a cost model you choose, double the budget until
  a worst-case batch no longer fits, then bisect. No model of memory, more steps.

The model, the optimizer and every random number generator are restored
afterwards, whatever happens. Probe the bare model in one process (not a
DDP-wrapped one); the budget is per device.

One :class:`MemoryModel` describes peak memory, whether :func:`fit_memory`
fitted it to measured steps (``result.fit``) or :meth:`MemoryModel.from_config`
estimated it from a transformers config without running anything.

What was found is worth keeping: :class:`BudgetCache` is a small JSON file of
budgets that worked, keyed by :class:`BudgetKey` (model, device and memory,
dtype, world size); ``tokenbatch probe --write-cache`` stores what it measured,
and :func:`remember_budget` starts an OOM fallback from the cached budget and
records each budget it falls back to.

``max_tokens="auto"`` puts it together: :func:`auto_budget` gives a sampler made
with it the remembered budget, else the probe's (see docs/trainer.md).

Typical use, before building the sampler::

    result = find_max_tokens(model, lengths=lengths, memory_limit=8 * 2**30)
    sampler = TokenBudgetBatchSampler(lengths, result.max_tokens, cost=result.cost)

How each step's peak is measured (CUDA allocator statistics; on CPU the torch
profiler's memory accounting) is told in :mod:`tokenbatch.probe._measure`.

On CPU, what the operating system sees can be well above the tensor bytes:
glibc's malloc serves blocks below its sliding mmap threshold (up to 32 MiB)
from a heap that it rarely gives back, so freed activations leave holes. In
``benchmarks/probe.py`` a tiny BERT under ``RLIMIT_AS`` fitted only about 0.63
of the probe's budget with glibc's defaults, and 1.07 of it (the margin at
work) with ``MALLOC_MMAP_THRESHOLD_=65536``, which gives every tensor of 64
KiB or more its own mapping, returned when freed. Train on CPU with that
setting (or jemalloc / tcmalloc), or raise ``margin``.
"""

from tokenbatch.probe._auto import MEMORY_ENV, AutoBudget, auto_budget, memory_limits, parse_memory
from tokenbatch.probe._cache import BudgetCache, BudgetKey, default_path, remember_budget
from tokenbatch.probe._measure import (
    LossFn,
    MakeBatch,
    default_loss,
    held_bytes,
    measure_peak,
    synthetic_batch,
)
from tokenbatch.probe._model import (
    TASKS,
    Measurement,
    MemoryModel,
    fit_memory,
    resolve_task,
    stores_attention_scores,
)
from tokenbatch.probe._search import ProbeResult, default_memory_limit, find_max_tokens

__all__ = [
    "MEMORY_ENV",
    "TASKS",
    "AutoBudget",
    "BudgetCache",
    "BudgetKey",
    "LossFn",
    "MakeBatch",
    "Measurement",
    "MemoryModel",
    "ProbeResult",
    "auto_budget",
    "default_loss",
    "default_memory_limit",
    "default_path",
    "find_max_tokens",
    "fit_memory",
    "held_bytes",
    "measure_peak",
    "memory_limits",
    "parse_memory",
    "remember_budget",
    "resolve_task",
    "stores_attention_scores",
    "synthetic_batch",
]
