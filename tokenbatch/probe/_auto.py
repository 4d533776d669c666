"""``max_tokens="auto"``: resolve a sampler's budget from the remembered one, else the probe.

The sampler and the OOM guard sit below this package and never see the
model, so they cannot resolve "auto" themselves: :func:`auto_budget` does it,
called by the user, :class:`~tokenbatch.integrations.transformers.TokenBudgetTrainer`
or the example, before the DataLoader is prepared and the guard is made.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import math
import os
import re
import resource
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import torch

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.oom import _fsdp
from tokenbatch.plan import OversizeSampleError
from tokenbatch.probe._cache import BudgetCache, BudgetKey, out_of_scope, scope
from tokenbatch.probe._measure import LossFn, MakeBatch, batch_maker, held_bytes, model_device
from tokenbatch.probe._model import MemoryModel, check_margin, resolve_task
from tokenbatch.probe._search import ProbeResult, default_memory_limit, find_max_tokens
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger(__name__)

MEMORY_ENV = "TOKENBATCH_MEMORY_LIMIT"
"""An environment variable with the memory limit for "auto" (bytes, or ``8GiB``, ``512MiB``)."""

SUSPECT_RATIO = 4.0
"""A cached budget more than this many times the config's estimate is not trusted: the probe runs."""

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
    """Where the agreed budget came from, on the rank that had the smallest: ``"cache"``
    (remembered), ``"probe"`` (measured) or ``"estimate"`` (analytic, from the config)."""
    key: BudgetKey
    memory_limit: float | None = None
    estimate: float | None = None
    """This rank's analytic budget from the config, where there is one (also when the probe measured)."""
    probe: ProbeResult | None = None
    """This rank's probe; None where it took its own remembered budget."""

    def __str__(self) -> str:
        where = {"cache": "the cache", "probe": "the probe", "estimate": "the config's estimate"}[self.source]
        return f"max_tokens={_checks.budget(self.max_tokens)} from {where} ({self.key})"


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

    Each rank takes, in order: the budget its cache remembers for this model
    and device (:class:`BudgetCache`, :class:`BudgetKey`); else its probe
    (:func:`find_max_tokens` on synthetic worst-case batches of the
    sampler's longest sequence, under ``memory_limit``), whose fitted memory
    model is turned into the sampler's cost units; with ``measure=False``, the
    analytic estimate from the config (:meth:`MemoryModel.from_config`). A
    remembered budget found on other data (padded lengths reaching beyond
    those it was found on), in another cost model's units or by an older
    tokenbatch that did not record them (:func:`~tokenbatch.probe._cache.out_of_scope`),
    more than ``SUSPECT_RATIO`` (4) times the estimate, or
    below what one sample the sampler must batch costs (the longest with
    ``oversize="error"``, else the shortest), is not trusted: a warning names
    the file and the key, and the rank probes (or estimates) instead. The
    ranks agree on the smallest of their budgets, which the sampler then
    holds; each rank that did not take its own remembered budget stores the
    agreed one under its own key (``remember``; under ``RLIMIT_AS`` the one for
    the room before the probe, whose own mappings stay in this process only).
    A rank that fails stops every rank: the others raise a ``RuntimeError``
    that names it and its error.

    Under FSDP2 the model's parameters, gradients and optimizer state are cut into its shard
    group's size (read from its ``DTensor`` parameters), and so is the estimate's share of them
    (:meth:`MemoryModel.from_config`'s ``shards``); the key names the sharding. On several
    processes the probe cannot run on a sharded model: the estimate is taken instead (a warning
    says so).

    Args:
        model: the bare model (not DDP-wrapped; under FSDP2, the sharded one), on its training device.
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
        remember: store the agreed budget in ``cache`` for the next run (where this rank probed
            or estimated).
        batch: one real collated batch, for a model whose forward needs more than token ids
            (labels, a wrapped encoder): the probe's worst-case batches copy its keys, dtypes and
            per-row fields (see :func:`find_max_tokens`).
        make_batch, loss_fn: for models that are not plain transformers models (see the probe).

    Raises:
        ValueError: no memory limit on CPU; ``measure=False`` without a config;
            or the model alone does not fit (the message says what to pass).
        RuntimeError: another rank raised one of these.

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
    shards = _fsdp.shard_count(model)
    if measure and _fsdp.in_lockstep(model):
        logger.warning(
            "max_tokens='auto': the probe cannot measure a model that FSDP shards over %d processes (its "
            "trial steps would run FSDP's collectives on shapes each rank chooses alone, and out of memory "
            "on one rank would leave the others waiting): taking the config's estimate for %d shards",
            distributed.world_size(),
            shards,
        )
        measure = False
    limit, memory_bytes = memory_limits(model, memory_limit, optimizer)
    device = model_device(model)
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    if key is None:
        # A sharded model has room for larger batches than the same model replicated on as many ranks.
        name = model_name(model, config) + (f" [FSDP, {shards} shards]" if shards > 1 else "")
        key = BudgetKey.for_device(name, device=device, dtype=dtype)
        key = BudgetKey(key.model, key.device, memory_bytes, key.dtype, key.world_size)
    store = cache if cache is not None else BudgetCache()
    cost, lengths = sampler.cost, sampler.lengths
    estimate = probe = None
    own_entry = False
    error: Exception | None = None
    try:
        # This rank's budget: its own remembered one, else its own probe (or estimate). A rank
        # without an entry measures even where another rank has one: the ranks' memory can differ.
        entry = store.get(key)
        mine = math.inf if entry is None else float(entry["max_tokens"])
        if entry is not None:
            doubt = out_of_scope(entry, cost, lengths)  # found on other data, or in other units
            if doubt is None:
                if config is not None:
                    with contextlib.suppress(AttributeError, TypeError, ValueError):  # a check, not a need
                        estimate = _estimate(
                            model, config, dtype, device, cost, lengths, limit, margin, shards
                        )
                doubt = _suspect(mine, estimate, sampler)
            if doubt is not None:
                logger.warning(
                    "not using the cached max_tokens=%s for %s in the budget cache %s: %s; %s instead",
                    _checks.budget(mine),
                    key,
                    store.path,
                    doubt,
                    "measuring" if measure else "taking the config's estimate",
                )
                mine = math.inf
        if math.isfinite(mine):
            budget = fresh = mine
            source, own_entry = "cache", True
        else:
            if config is not None and estimate is None:
                estimate = _estimate(model, config, dtype, device, cost, lengths, limit, margin, shards)
            if estimate is not None:
                logger.info(
                    "max_tokens='auto': the config's estimate is %s for %s", _checks.budget(estimate), key
                )
            elif not measure:
                raise ValueError(
                    f"auto_budget(measure=False) needs a transformers config for the estimate, but "
                    f"{type(model).__name__} has no .config: pass config=..., measure=True or "
                    f"max_tokens=<number>"
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
                fresh = budget_in_units(probe.fit, cost, lengths, limit, margin)
                limit = min(limit, memory_limits(model, memory_limit, optimizer)[0])
                budget, source = budget_in_units(probe.fit, cost, lengths, limit, margin), "probe"
            else:
                assert estimate is not None
                budget = fresh = estimate
                source = "estimate"
    except Exception as exc:  # told to every rank below, so that none waits for this one
        error, budget, fresh, source = exc, math.inf, math.inf, "error"
    budget, fresh, source = _agree(budget, fresh, source, error)
    if remember and not own_entry:
        # Under this rank's own key, the budget every rank can run (ranks may share one file and key).
        _remember(store, key, max(fresh, budget), source, scope(cost, lengths), limit)
    result = AutoBudget(budget, source, key, memory_limit=limit, estimate=estimate, probe=probe)
    try:
        sampler.resolve(budget)
    except OversizeSampleError as oversize:
        raise OversizeSampleError(
            f"{oversize}; max_tokens='auto' gave {result}: raise memory_limit, or pass max_tokens=<number>"
        ) from None
    logger.info("max_tokens='auto' resolved to %s", result)
    return result


def _estimate(
    model: torch.nn.Module,
    config: Any,
    dtype: torch.dtype,
    device: torch.device,
    cost: CostModel,
    lengths: np.ndarray,
    limit: float,
    margin: float,
    shards: int = 1,
) -> float:
    """The config's analytic budget in ``cost`` units for this memory (the head named by the
    model's class: a model built from a config in code has no ``config.architectures``), for a
    model whose parameters are cut into ``shards`` (FSDP2)."""
    analytic = MemoryModel.from_config(
        config,
        dtype=dtype,
        device=device.type,
        task=resolve_task(config, model=model),
        pad_to_multiple_of=cost.pad_to_multiple_of,
        shards=shards,
    )
    return budget_in_units(analytic, cost, lengths, limit, margin)


def _suspect(cached: float, estimate: float | None, sampler: TokenBudgetBatchSampler) -> str | None:
    """Why a cached budget cannot be this run's, or None.

    Above ``SUSPECT_RATIO`` times the config's estimate for this memory (the
    estimate is within about 20% of the probe on the models measured), or below
    what one sample the sampler must batch costs: the longest with
    ``oversize="error"`` (the sampler would refuse the budget), else the shortest.
    A budget the guard lowered after an OOM stays between the two.
    """
    if estimate is not None and cached > SUSPECT_RATIO * estimate:
        return (
            f"it is more than {SUSPECT_RATIO:g}x the config's estimate of {estimate:g} for this model and "
            f"memory (a cache entry from another setting, or written by hand)"
        )
    which = "longest" if sampler.oversize == "error" else "shortest"
    length = int(sampler.lengths.max() if which == "longest" else sampler.lengths.min())
    floor = float(sampler.cost.cost(1, length))
    if cached < floor:
        return f"it is below what one sample of the {which} length ({length}) costs, {floor:g}"
    return None


def _agree(budget: float, fresh: float, source: str, error: Exception | None) -> tuple[float, float, str]:
    """The smallest budget over the ranks, where it came from, and the smallest ``fresh``.

    One gather; a rank that failed raises its error, and every other rank
    raises one that names it, rather than wait for it.
    """
    mine = (budget, fresh, source, None if error is None else f"{type(error).__name__}: {error}")
    ranks = cast("list[tuple[float, float, str, str | None]]", distributed.all_gather_objects(mine))
    if error is not None:
        raise error
    failed = [(r, message) for r, (*_, message) in enumerate(ranks) if message is not None]
    if failed:
        where, message = failed[0]
        raise RuntimeError(f"max_tokens='auto': rank {where} could not find its budget ({message})")
    smallest = min(range(len(ranks)), key=lambda r: ranks[r][0])
    if smallest != distributed.rank():
        logger.info(
            "max_tokens='auto': rank %d's budget %s (from its %s) is the smallest; this rank's was %s (%s)",
            smallest,
            _checks.budget(ranks[smallest][0]),
            ranks[smallest][2],
            _checks.budget(budget),
            source,
        )
    return ranks[smallest][0], min(r[1] for r in ranks), ranks[smallest][2]


def _remember(
    store: BudgetCache, key: BudgetKey, budget: float, source: str, found_on: dict[str, Any], limit: float
) -> None:
    try:
        store.put(key, budget, source=source, memory_limit=limit, **found_on)
    except (OSError, ValueError) as error:  # a cache is a convenience: never stop for it
        logger.warning(
            "could not remember max_tokens=%s in %s: %s", _checks.budget(budget), store.path, error
        )
