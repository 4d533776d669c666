"""Remember the token budget that worked, so the next run starts from it.

A small JSON file (``$TOKENBATCH_CACHE``, else
``~/.cache/tokenbatch/budgets.json``) maps a key made of the model, the
device and its memory, the dtype and the world size to the last budget that
trained without running out of memory. :func:`remember_budget` starts an OOM
fallback from it and writes it after each budget change, the probe writes
what it measured, and a training script may read it to pick its starting
``max_tokens``.

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

import torch
from filelock import FileLock

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch.plan import OversizeSampleError

if TYPE_CHECKING:
    from tokenbatch.oom import OOMFallback

# The guard's logger: remembering was the guard's job, and its messages keep their place.
logger = logging.getLogger("tokenbatch.oom")

# A write holds the lock for milliseconds; waiting longer means the lock is stuck
# (an unreliable network file system), and a cache is not worth a stalled run.
LOCK_TIMEOUT_S = 30.0


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

        Raises:
            OSError: the file cannot be written, or its lock not taken within
                ``LOCK_TIMEOUT_S`` (30) seconds (``filelock.Timeout``).
        """
        max_tokens = _checks.positive_number("max_tokens", max_tokens)
        entry = {
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


def remember_budget(fallback: OOMFallback, key: BudgetKey, cache: BudgetCache | None = None) -> None:
    """Start ``fallback`` from the budget remembered for ``key``, and remember each budget that fits.

    Call it on every rank, right after making the fallback: the ranks agree
    on the smallest cached budget (ranks on other machines may read other
    files) in one all-reduce, and the fallback starts from it if it is
    smaller than the budget in force. After each step that trained under a
    new budget, the main process writes it to ``cache``; a cache that cannot
    be written is a warning, never a stop. Under FSDP on several processes,
    where out of memory in the passes stops the job for a restart, the rank
    that ran out of memory writes the lowered budget before it stops: call this
    after loading the checkpoint, and the restarted job starts from it (with a
    cache beside the checkpoints, every rank of the restart reads it).

    Args:
        fallback: the :class:`~tokenbatch.OOMFallback` guarding training.
        key: what the budget depends on (:meth:`BudgetKey.for_device`).
        cache: the cache file (default ``BudgetCache()``).

    Example:
        >>> import tempfile, pathlib, torch
        >>> from tokenbatch import OOMFallback, TokenBudgetBatchSampler
        >>> cache = BudgetCache(pathlib.Path(tempfile.mkdtemp()) / "budgets.json")
        >>> key = BudgetKey("tiny", "cpu:x86_64", 2**34, "float32", 1)
        >>> cache.put(key, 8, source="oom")
        >>> fallback = OOMFallback(TokenBudgetBatchSampler([4] * 12, max_tokens=16), torch.nn.Linear(4, 1))
        >>> remember_budget(fallback, key, cache=cache)
        >>> fallback.max_tokens
        8.0
    """
    store = cache if cache is not None else BudgetCache()
    entry = store.get(key)
    mine = float(entry["max_tokens"]) if entry is not None else math.inf
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

    def save(fallback: OOMFallback) -> None:
        # The main process writes; under FSDP, where the guard stops the job for a restart (it has
        # then not yet been shown to fit), so does the rank that ran out of memory, before it stops.
        if distributed.rank() != 0 and fallback._stopping is None:
            return
        try:
            store.put(key, fallback.max_tokens, source="oom", mode=fallback.mode)
        except (OSError, ValueError) as error:  # a cache is a convenience: never stop training for it
            logger.warning(
                "could not remember max_tokens=%s in %s: %s",
                _checks.budget(fallback.max_tokens),
                store.path,
                error,
            )

    fallback.add_listener(save)
