"""``max_tokens="auto"``: resolve a sampler's budget from the remembered one, else the probe.

The sampler and the OOM guard sit below this package and never see the
model, so they cannot resolve "auto" themselves: :func:`auto_budget` does it,
called by the user, :class:`~tokenbatch.integrations.transformers.TokenBudgetTrainer`
or the example, before the DataLoader is prepared and the guard is made.
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import resource
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.probe._cache import BudgetCache, BudgetKey
from tokenbatch.probe._measure import LossFn, MakeBatch, batch_maker, held_bytes, model_device
from tokenbatch.probe._model import MemoryModel, check_margin
from tokenbatch.probe._search import ProbeResult, default_memory_limit, find_max_tokens
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger(__name__)

MEMORY_ENV = "TOKENBATCH_MEMORY_LIMIT"
"""An environment variable with the memory limit for "auto" (bytes, or ``8GiB``, ``512MiB``)."""

CPU_NEEDS_LIMIT = (
    "max_tokens='auto' on CPU needs a memory limit: nothing fails on CPU until the operating system kills "
    "the process, so there is no limit to measure against. Pass memory_limit=<bytes> (for example "
    "memory_limit=8 * 2**30), set {env}=8GiB, or run under an address-space limit (ulimit -v, "
    "resource.setrlimit(resource.RLIMIT_AS, ...)); or pass max_tokens=<number>"
)


@dataclass(frozen=True)
class AutoBudget:
    """What :func:`auto_budget` chose and why; the sampler already holds ``max_tokens``.

    Example:
        >>> key = BudgetKey("tiny", "cpu:x86_64", 2**30, "float32", 1)
        >>> print(AutoBudget(4096.0, "cache", key, memory_limit=2**30))
        max_tokens=4096 from the cache (tiny | cpu:x86_64 1.0GiB | float32 | x1)
    """

    max_tokens: float
    """The budget every rank agreed on (the smallest of theirs), in the sampler's cost units."""
    source: str
    """``"cache"`` (remembered), ``"probe"`` (measured) or ``"estimate"`` (analytic, from the config)."""
    key: BudgetKey
    memory_limit: float | None = None
    estimate: float | None = None
    """The analytic budget from the config, where there is one (also when the probe measured)."""
    probe: ProbeResult | None = None

    def __str__(self) -> str:
        where = {"cache": "the cache", "probe": "the probe", "estimate": "the config's estimate"}[self.source]
        return f"max_tokens={self.max_tokens:g} from {where} ({self.key})"


def parse_memory(text: str) -> int:
    """``"8GiB"``, ``"512MiB"``, ``"16GB"`` or ``"1e9"`` as bytes.

    Example:
        >>> parse_memory("2GiB"), parse_memory("1.5 GB"), parse_memory("4096")
        (2147483648, 1500000000, 4096)
    """
    match = re.fullmatch(r"\s*([0-9.]+(?:e[0-9]+)?)\s*([kmgt]?)(i?)b?\s*", str(text).lower())
    if match is None:
        raise ValueError(f"{MEMORY_ENV} should be a size such as 8GiB, 512MiB or 16GB, but got {text!r}")
    number, unit, binary = match.groups()
    scale = 1024 ** "_kmgt".index(unit) if binary and unit else 1000 ** "_kmgt".index(unit) if unit else 1
    return int(_checks.positive_number(MEMORY_ENV, float(number) * scale))


def _vm_size() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmSize in /proc/self/status")


def memory_limits(
    model: torch.nn.Module, memory_limit: float | None, optimizer: torch.optim.Optimizer | None = None
) -> tuple[float, int]:
    """The probe's limit in tensor bytes, and the memory size for the cache key.

    ``memory_limit``, else ``$TOKENBATCH_MEMORY_LIMIT``; on CPU also the room
    an ``RLIMIT_AS`` leaves (the limit minus the address space mapped now, plus
    the tensor bytes already held, which that space includes), the smallest of
    them. CUDA without either: free device memory (:func:`default_memory_limit`).

    Raises:
        ValueError: CPU with no limit at all (the message says what to pass).
    """
    given = None if memory_limit is None else _checks.positive_number("memory_limit", memory_limit)
    if given is None and os.environ.get(MEMORY_ENV):
        given = float(parse_memory(os.environ[MEMORY_ENV]))
    device = model_device(model)
    if device.type == "cuda":
        limit = given if given is not None else float(default_memory_limit(model, optimizer))
        return limit, int(torch.cuda.get_device_properties(device).total_memory)
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    limits = [] if given is None else [given]
    if soft != resource.RLIM_INFINITY:
        limits.append(float(soft - _vm_size() + held_bytes(model, optimizer)))
    if not limits:
        raise ValueError(CPU_NEEDS_LIMIT.format(env=MEMORY_ENV))
    # The key names the limit as set (stable across runs), not the room left (which moves with VmSize).
    return min(limits), int(given if given is not None else soft)


def budget_in_units(
    memory: MemoryModel, cost: CostModel, lengths: np.ndarray, memory_limit: float, margin: float
) -> float:
    """The largest budget in ``cost`` units whose worst batch of ``lengths`` fits ``memory``'s room.

    A batch of ``B`` sequences padded to ``L`` within budget ``X`` has
    ``B <= X / cost(1, L)``, so it needs at most ``X * bytes(1, L) / cost(1, L)``
    bytes beyond the constant: the budget is the room over the largest such ratio.
    """
    room = memory.budget(memory_limit, margin=margin)
    padded = np.unique(cost.padded_length(np.unique(lengths)))
    ratio = memory.cost_model().cost(1, padded) / cost.cost(1, padded)
    return float(room / np.max(ratio))


def model_name(model: torch.nn.Module, config: Any = None) -> str:
    """What the cache key calls the model: the config's ``name_or_path``, else its class and shapes.

    A model built from a config in code has no name; its class alone would give
    every such model of a class, whatever its size, one remembered budget. So the
    name is the class with its parameter count and a digest of its parameters'
    names, shapes and dtypes: the same architecture, trained or not, shares it.

    >>> model_name(torch.nn.Linear(4, 2))
    'Linear[10 params, ...]'
    """
    config = getattr(model, "config", None) if config is None else config
    name = getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None)
    if name:
        return str(name)
    shapes = [(n, tuple(p.shape), str(p.dtype)) for n, p in model.named_parameters()]
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:10]
    return f"{type(model).__name__}[{sum(p.numel() for p in model.parameters())} params, {digest}]"


def _cached(cache: BudgetCache, key: BudgetKey, cost: CostModel) -> float:
    """This rank's remembered budget for ``key`` in ``cost``'s units, or inf."""
    entry = cache.get(key)
    if entry is None:
        return math.inf
    stored = entry.get("cost")
    mine = {"linear": cost.linear, "quadratic": cost.quadratic, "per_sample": cost.per_sample}
    if isinstance(stored, dict) and any(not math.isclose(stored.get(k, 0.0), v) for k, v in mine.items()):
        logger.info(
            "not using the cached budget for %s: it is for cost %s, the sampler's is %s", key, stored, mine
        )
        return math.inf
    return float(entry["max_tokens"])


def _agree(value: float) -> float:
    """The smallest ``value`` over all ranks (inf where none has one)."""
    return -distributed.all_reduce_max([-value], device=distributed.collective_device())[0]


def auto_budget(
    model: torch.nn.Module,
    sampler: TokenBudgetBatchSampler,
    *,
    memory_limit: float | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    config: Any = None,
    measure: bool = True,
    margin: float = 0.1,
    cache: BudgetCache | None = None,
    key: BudgetKey | None = None,
    remember: bool = True,
    batch: Any = None,
    make_batch: MakeBatch | None = None,
    loss_fn: LossFn | None = None,
) -> AutoBudget:
    """Give ``sampler`` (made with ``max_tokens="auto"``) its budget; call it on every rank.

    In order: the budget remembered for this model and device
    (:class:`BudgetCache`, :class:`BudgetKey`); else the probe
    (:func:`find_max_tokens` on synthetic worst-case batches of the
    sampler's longest sequence, under ``memory_limit``), whose fitted memory
    model is turned into the sampler's cost units; with ``measure=False``, the
    analytic estimate from the config (:meth:`MemoryModel.from_config`). The
    ranks agree on the smallest, which the sampler then holds; the main
    process remembers a probed budget (``remember``; under ``RLIMIT_AS`` the one
    for the room before the probe, whose own mappings stay in this process
    only) and logs where it came from.

    Args:
        model: the bare model (not DDP-wrapped), on its training device.
        sampler: a :class:`~tokenbatch.TokenBudgetBatchSampler` made with ``max_tokens="auto"``.
        memory_limit: bytes; on CPU required unless ``$TOKENBATCH_MEMORY_LIMIT``
            or ``RLIMIT_AS`` sets one (see :func:`memory_limits`).
        optimizer: the optimizer you will train with (default AdamW, for the probe).
        config: the transformers config for the estimate (default ``model.config``).
        measure: run the probe (False: the estimate only, no step is run).
        margin: fraction of the limit kept free.
        cache, key: where budgets are remembered (default ``BudgetCache()`` and
            :meth:`BudgetKey.for_device` of :func:`model_name`, the model's dtype
            and, on CPU, the memory limit as set).
        remember: store a probed budget in ``cache`` for the next run.
        batch: one real collated batch, for a model whose forward needs more than token ids
            (labels, a wrapped encoder): the probe's worst-case batches copy its keys, dtypes and
            per-row fields (see :func:`find_max_tokens`).
        make_batch, loss_fn: for models that are not plain transformers models (see the probe).

    Raises:
        ValueError: no memory limit on CPU; ``measure=False`` without a config;
            or the model alone does not fit (the message says what to pass).

    Example:
        >>> sampler = TokenBudgetBatchSampler(lengths, max_tokens="auto")  # doctest: +SKIP
        >>> print(auto_budget(model, sampler, memory_limit=8 * 2**30))  # doctest: +SKIP
        max_tokens=18432 from the probe (bert-base-cased | cpu:x86_64 8.0GiB | float32 | x1)
    """
    if not isinstance(sampler, TokenBudgetBatchSampler):
        raise TypeError(
            f"sampler should be a tokenbatch.TokenBudgetBatchSampler, but got {type(sampler).__name__}"
        )
    if sampler.resolved:
        raise ValueError(
            f"auto_budget resolves a sampler made with max_tokens='auto', but this one has "
            f"max_tokens={sampler.max_tokens:g}; make it with max_tokens='auto'"
        )
    margin = check_margin(margin)
    make_batch = batch_maker(batch, make_batch)  # a bad batch is named now, not after the cache lookup
    config = getattr(model, "config", None) if config is None else config
    limit, memory_bytes = memory_limits(model, memory_limit, optimizer)
    device = model_device(model)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if key is None:
        name = model_name(model, config)
        key = BudgetKey.for_device(name, device=device, dtype=dtype)
        key = BudgetKey(key.model, key.device, memory_bytes, key.dtype, key.world_size)
    store = cache if cache is not None else BudgetCache()
    cost, lengths = sampler.cost, sampler.lengths
    cached = _agree(_cached(store, key, cost))
    estimate = probe = None
    if math.isfinite(cached):
        budget, source = cached, "cache"
    else:
        if config is not None:
            analytic = MemoryModel.from_config(
                config, dtype=dtype, device=device.type, pad_to_multiple_of=cost.pad_to_multiple_of
            )
            estimate = budget_in_units(analytic, cost, lengths, limit, margin)
            logger.info("max_tokens='auto': the config's estimate is %g for %s", estimate, key)
        elif not measure:
            raise ValueError(
                f"auto_budget(measure=False) needs a transformers config for the estimate, but "
                f"{type(model).__name__} has no .config: pass config=..., measure=True or max_tokens=<number>"
            )
        if measure:
            probe = find_max_tokens(
                model,
                lengths=lengths,
                memory_limit=limit,
                optimizer=optimizer,
                cost=cost,
                margin=margin,
                make_batch=make_batch,
                loss_fn=loss_fn,
            )
            assert probe.fit is not None  # method="fit" always fits
            # Under RLIMIT_AS the probe's own one-time mappings (the profiler's, ~150 MiB) stay and
            # take room from training in this process, not in the next run, which starts from the
            # cache: remember the budget for the room before the probe, train under the room left.
            fresh = _agree(budget_in_units(probe.fit, cost, lengths, limit, margin))
            limit = min(limit, memory_limits(model, memory_limit, optimizer)[0])
            budget, source = budget_in_units(probe.fit, cost, lengths, limit, margin), "probe"
        else:
            budget, source = float(estimate), "estimate"  # type: ignore[arg-type]
            fresh = budget
        budget = _agree(budget)
        if remember and distributed.rank() == 0:
            _remember(store, key, max(fresh, budget), source, cost, limit)
    sampler.resolve(budget)
    result = AutoBudget(budget, source, key, memory_limit=limit, estimate=estimate, probe=probe)
    logger.info("max_tokens='auto' resolved to %s", result)
    return result


def _remember(
    store: BudgetCache, key: BudgetKey, budget: float, source: str, cost: CostModel, limit: float
) -> None:
    entry_cost = {"linear": cost.linear, "quadratic": cost.quadratic, "per_sample": cost.per_sample}
    try:
        store.put(key, budget, source=source, cost=entry_cost, memory_limit=limit)
    except (OSError, ValueError) as error:  # a cache is a convenience: never stop for it
        logger.warning("could not remember max_tokens=%g in %s: %s", budget, store.path, error)
