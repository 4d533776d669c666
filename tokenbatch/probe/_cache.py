"""Remember the token budget that worked, so the next run starts from it.

A small JSON file (``$TOKENBATCH_CACHE``, else
``~/.cache/tokenbatch/budgets.json``) maps a key made of the model, the
device and its memory, the dtype and the world size to the last budget that
trained without running out of memory. :func:`remember_budget` starts an OOM
fallback from it and writes it after each budget change, the probe writes
what it measured, and a training script may read it to pick its starting
``max_tokens``.

A budget in cost units holds only for data like the data it was found on:
under a cost model that counts tokens, a budget found on sequences of at most
128 tokens overfills memory on 512-token data, whose attention grows with the
square of the length. So each entry also records its *scope* (:func:`scope`):
the cost model it is in and the range of padded lengths it was found on.
:func:`remember_budget` and :func:`tokenbatch.auto_budget` use an entry only
for data whose padded lengths lie in that range, in the same cost units
(:func:`out_of_scope`), and otherwise measure again, with a warning that says
why. Entries carry ``"version": 2``; one written before (no version, no
scope) is never trusted, and is measured again with a warning.

A cache is a convenience, so it never stops a run: a file that is not
readable JSON, or an entry whose ``max_tokens`` is not a positive finite
number, is a warning that names the file (and the key) and is then ignored;
the next budget stored replaces the file. Many jobs may share one home
directory, so :meth:`BudgetCache.put` reads, changes and rewrites the file
under a lock (``budgets.json.lock`` beside it), and replaces it atomically.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import platform
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from filelock import FileLock

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.plan import OversizeSampleError
from tokenbatch.sampler import TokenBudgetBatchSampler

if TYPE_CHECKING:
    from tokenbatch.oom import OOMFallback

# The guard's logger: remembering was the guard's job, and its messages keep their place.
logger = logging.getLogger("tokenbatch.oom")

# A write holds the lock for milliseconds; waiting longer means the lock is stuck
# (an unreliable network file system), and a cache is not worth a stalled run.
LOCK_TIMEOUT_S = 30.0

ENTRY_VERSION = 2
"""The version :meth:`BudgetCache.put` writes in each entry. 2: the entry records its scope (cost model
and padded lengths); entries without a version were written before and are not trusted."""
_COST_TERMS = ("linear", "quadratic", "per_sample")


def default_path() -> Path:
    """``$TOKENBATCH_CACHE`` if set, else ``~/.cache/tokenbatch/budgets.json``."""
    env = os.environ.get("TOKENBATCH_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "tokenbatch" / "budgets.json"


@dataclass(frozen=True)
class BudgetKey:
    """What a budget depends on: the same model on the same hardware and settings."""

    model: str
    device: str
    memory_bytes: int
    dtype: str
    world_size: int

    def __str__(self) -> str:
        # The file's key: a tenth of a GiB tells GPUs and large limits apart; below 1 GiB (small CPU
        # limits) MiB do, where "0.1GiB" named both 64 MiB and 128 MiB.
        gib = self.memory_bytes / 2**30
        memory = f"{gib:.1f}GiB" if gib >= 1 else f"{self.memory_bytes / 2**20:g}MiB"
        return f"{self.model} | {self.device} {memory} | {self.dtype} | x{self.world_size}"

    @classmethod
    def for_device(
        cls,
        model: str,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | str = torch.float32,
        world_size: int | None = None,
    ) -> BudgetKey:
        """The key for ``model`` on ``device`` (default: CUDA if present, else CPU).

        Example:
            >>> key = BudgetKey.for_device("bert-base-cased", device="cpu", world_size=2)
            >>> key.world_size, key.device.startswith("cpu")
            (2, True)
        """
        device = torch.device(
            device if device is not None else "cuda" if torch.cuda.is_available() else "cpu"
        )
        if device.type == "cuda":
            props = torch.cuda.get_device_properties(device)
            name, memory = props.name, int(props.total_memory)
        else:
            name = f"{device.type}:{platform.machine()}"
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
        return cls(
            model=str(model),
            device=name,
            memory_bytes=memory,
            dtype=str(dtype).removeprefix("torch."),
            world_size=distributed.world_size() if world_size is None else world_size,
        )


class BudgetCache:
    """The JSON file of budgets that worked, keyed by :class:`BudgetKey`.

    Example:
        >>> import tempfile, pathlib
        >>> cache = BudgetCache(pathlib.Path(tempfile.mkdtemp()) / "budgets.json")
        >>> key = BudgetKey("tiny-bert", "cpu:x86_64", 2**34, "float32", 1)
        >>> cache.get(key) is None
        True
        >>> cache.put(key, 8192, source="probe")
        >>> cache.get(key)["max_tokens"]
        8192.0
    """

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_path()

    def _read(self) -> dict[str, Any]:
        """The file's entries; {} (with a warning) for a file that is not a readable JSON object."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:  # ValueError: bad JSON, or bytes that are not UTF-8
            problem = f"is not readable JSON ({error})"
        else:
            if isinstance(data, dict):
                return data
            problem = f"should hold a JSON object, but holds a {type(data).__name__}"
        logger.warning(
            "the budget cache %s %s; ignoring it (the next budget stored replaces it)", self.path, problem
        )
        return {}

    def get(self, key: BudgetKey) -> dict[str, Any] | None:
        """The stored entry (``max_tokens``, ``source``, ``updated``, ...) or None.

        None, with a warning, also for an entry that is not an object with a
        positive finite ``max_tokens`` (written by hand, or by another version).
        """
        entry = self._read().get(str(key))
        if entry is None:
            return None
        try:
            if not isinstance(entry, dict):
                raise TypeError(f"the entry should be a JSON object, but got {entry!r}")
            _checks.positive_number("max_tokens", entry.get("max_tokens"))
        except (TypeError, ValueError) as error:
            logger.warning("ignoring the entry for %s in the budget cache %s: %s", key, self.path, error)
            return None
        return dict(entry)

    def put(self, key: BudgetKey, max_tokens: float, *, source: str, **extra: Any) -> None:
        """Store ``max_tokens`` for ``key``; ``source`` says who found it ("oom", "probe").

        ``extra`` fields are stored beside it; pass ``**scope(cost, lengths)``
        (the cost model and the lengths it was found on): without them no
        run trusts the entry.

        Raises:
            OSError: the file cannot be written, or its lock not taken within
                ``LOCK_TIMEOUT_S`` (30) seconds (``filelock.Timeout``).
        """
        max_tokens = _checks.positive_number("max_tokens", max_tokens)
        entry = {
            "version": ENTRY_VERSION,
            "max_tokens": max_tokens,
            "source": source,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "key": asdict(key),
            **extra,
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Other processes (other jobs in the same home directory) may be storing their
        # budgets at the same moment: without the lock, the last to rename wins and
        # the entries the others added since it read the file are lost.
        with FileLock(str(self.path) + ".lock", timeout=LOCK_TIMEOUT_S):
            data = self._read()
            data[str(key)] = entry
            self._write(data)

    def _write(self, data: dict[str, Any]) -> None:
        # Write, flush to disk, then rename: readers (who take no lock) and a crash
        # at any moment see the old file or the new one, never half of one.
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as file:
                json.dump(data, file, indent=2, sort_keys=True)
                file.flush()
                os.fsync(file.fileno())
            os.replace(tmp, self.path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def padded_range(cost: CostModel, lengths: np.ndarray) -> tuple[int, int]:
    """The shortest and longest of ``lengths`` as ``cost`` pads them."""
    return int(cost.padded_length(int(lengths.min()))), int(cost.padded_length(int(lengths.max())))


def scope(cost: CostModel, lengths: np.ndarray) -> dict[str, Any]:
    """What a budget holds for besides its key: its cost model and the padded lengths it was found on.

    The fields an entry records (``BudgetCache.put(key, budget, source=..., **scope(cost, lengths))``).

    Example:
        >>> scope(CostModel(pad_to_multiple_of=8), np.array([5, 30, 17]))["lengths"]
        [8, 32]
    """
    terms: dict[str, Any] = {name: getattr(cost, name) for name in _COST_TERMS}
    terms["pad_to_multiple_of"] = cost.pad_to_multiple_of
    return {"cost": terms, "lengths": list(padded_range(cost, lengths))}


def out_of_scope(entry: dict[str, Any], cost: CostModel, lengths: np.ndarray) -> str | None:
    """Why ``entry``'s budget cannot be trusted for ``lengths`` under ``cost``, or None where it can.

    It can where it is in the same cost units (``linear``, ``quadratic`` and
    ``per_sample``; the padding is in the lengths) and was found on padded
    lengths reaching at least as short and as long as these: the memory of a
    batch within the budget, per unit of cost, changes with the length unless
    the cost model is exact.
    """
    version = entry.get("version")
    if version is None:
        return (
            "the entry was written by an older tokenbatch, which did not record the cost model and the "
            "lengths a budget was found on"
        )
    if version != ENTRY_VERSION:
        return f"the entry has version={version!r}, and this tokenbatch reads version {ENTRY_VERSION}"
    stored, found = entry.get("cost"), entry.get("lengths")
    if not isinstance(stored, dict) or not (
        isinstance(found, list) and len(found) == 2 and all(type(n) is int for n in found)
    ):
        return (
            "the entry does not say which cost model and lengths it was found on (store one with "
            "BudgetCache.put(key, max_tokens, source=..., **scope(cost, lengths)))"
        )
    mine = {name: getattr(cost, name) for name in _COST_TERMS}
    theirs = {name: stored.get(name) for name in _COST_TERMS}
    if any(not (isinstance(t := theirs[k], int | float) and math.isclose(t, v)) for k, v in mine.items()):
        return f"it is in the units of another cost model ({theirs}; the sampler's is {mine})"
    shortest, longest = padded_range(cost, lengths)
    if shortest < found[0] or longest > found[1]:
        return (
            f"it was found on padded lengths {found[0]}..{found[1]}, and this data's reach "
            f"{shortest}..{longest}"
        )
    return None


def remember_budget(fallback: OOMFallback, key: BudgetKey, cache: BudgetCache | None = None) -> None:
    """Start ``fallback`` from the budget remembered for ``key``, and remember each budget that fits.

    Call it on every rank, right after making the fallback: the ranks agree
    on the smallest cached budget (ranks on other machines may read other
    files) in one all-reduce, and the fallback starts from it if it is
    smaller than the budget in force. An entry found on other lengths or in
    another cost model (:func:`out_of_scope`) is not used, with a warning.
    After each step that trained under a new budget, the main process writes
    it to ``cache`` with the sampler's cost model and lengths; a cache that
    cannot be written is a warning, never a stop. Under FSDP on several
    processes, where out of memory in the passes stops the job for a restart,
    the rank that ran out of memory writes the lowered budget before it stops:
    call this after loading the checkpoint, and the restarted job starts from
    it (with a cache beside the checkpoints, every rank of the restart reads
    it). A :class:`~tokenbatch.TokenBudgetStream` does not know its lengths
    before it is read, so for one nothing is read or written (a warning says so).

    Args:
        fallback: the :class:`~tokenbatch.OOMFallback` guarding training.
        key: what the budget depends on (:meth:`BudgetKey.for_device`).
        cache: the cache file (default ``BudgetCache()``).

    Example:
        >>> import tempfile, pathlib, torch
        >>> from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
        >>> cache = BudgetCache(pathlib.Path(tempfile.mkdtemp()) / "budgets.json")
        >>> key = BudgetKey("tiny", "cpu:x86_64", 2**30, "float32", 1)
        >>> cache.put(key, 8, source="oom", **scope(CostModel(), np.array([4, 4])))
        >>> fallback = OOMFallback(TokenBudgetBatchSampler([4] * 12, max_tokens=16), torch.nn.Linear(4, 1))
        >>> remember_budget(fallback, key, cache=cache)
        >>> fallback.max_tokens
        8.0
    """
    sampler = fallback.sampler
    if not isinstance(sampler, TokenBudgetBatchSampler):
        logger.warning(
            "remember_budget reads and writes budgets for the lengths they were found on, which a "
            "TokenBudgetStream does not know before it is read: nothing is remembered for %s",
            key,
        )
        return
    store = cache if cache is not None else BudgetCache()
    cost, lengths = sampler.cost, sampler.lengths
    entry = store.get(key)
    doubt = None if entry is None else out_of_scope(entry, cost, lengths)
    if entry is not None and doubt is not None:
        logger.warning(
            "not starting from the cached max_tokens=%g for %s in the budget cache %s: %s",
            float(entry["max_tokens"]),
            key,
            store.path,
            doubt,
        )
    mine = float(entry["max_tokens"]) if entry is not None and doubt is None else math.inf
    cached = -distributed.all_reduce_max([-mine], device=distributed.collective_device())[0]
    if cached < fallback.max_tokens:
        try:
            fallback.start_from(cached)
        except OversizeSampleError as error:
            logger.warning(
                "not starting from the cached max_tokens=%s for %s: %s", _checks.budget(cached), key, error
            )
        else:
            logger.info("starting from max_tokens=%s remembered for %s", _checks.budget(cached), key)
    found_on = scope(cost, lengths)

    def save(fallback: OOMFallback) -> None:
        # The main process writes; under FSDP, where the guard stops the job for a restart (it has
        # then not yet been shown to fit), so does the rank that ran out of memory, before it stops.
        if distributed.rank() != 0 and fallback._stopping is None:
            return
        try:
            store.put(key, fallback.max_tokens, source="oom", mode=fallback.mode, **found_on)
        except (OSError, ValueError) as error:  # a cache is a convenience: never stop training for it
            logger.warning(
                "could not remember max_tokens=%s in %s: %s",
                _checks.budget(fallback.max_tokens),
                store.path,
                error,
            )

    fallback.add_listener(save)
