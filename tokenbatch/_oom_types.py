"""What the OOM fallback recognises, records and raises: ``is_oom``, events and errors.

Also the rule every rank applies to the step's shared outcome rows to agree
on the next budget, kept pure so it can be tested without processes.
"""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

import torch

# A rank's outcome row in the per-step all-reduce: [status, phase, cost, longest, rows] of
# what it ran (the whole batch, or the micro-batch that failed).
OK, OOM, ERROR = 0.0, 1.0, 2.0
PHASES = ("", "forward", "backward")

# torch >= 2.5 exposes the type at the top level; before, only as torch.cuda.OutOfMemoryError.
_TORCH_OOM: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


class SampleTooLargeError(RuntimeError):
    """Out of memory with nothing smaller left to try: one sample alone, or the budget at ``min_tokens``.

    Raised on every rank. ``length`` is the longest sequence that failed,
    ``max_tokens`` the budget it failed under, ``step`` the step of the
    epoch and ``rank`` the rank it failed on.
    """

    def __init__(self, message: str, *, length: int, max_tokens: float, step: int, rank: int) -> None:
        super().__init__(message)
        self.length = length
        self.max_tokens = max_tokens
        self.step = step
        self.rank = rank


class RankFailedError(RuntimeError):
    """Another rank raised an error that is not out-of-memory; this rank stops instead of waiting.

    ``rank`` is the rank that failed and ``error`` its error as ``"Type: message"``.
    """

    def __init__(self, message: str, *, rank: int, error: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.error = error


def _accelerate_says_oom(error: BaseException) -> bool:
    try:
        from accelerate.utils.memory import should_reduce_batch_size
    except ImportError:  # accelerate is optional; without it only the exception types count
        return False
    return isinstance(error, Exception) and bool(should_reduce_batch_size(error))


def is_oom(error: BaseException | None) -> bool:
    """True if ``error``, or an exception it was raised from or during, is an out-of-memory error.

    Recognises ``torch.OutOfMemoryError`` (CUDA, and XPU on recent torch) and
    everything accelerate's ``should_reduce_batch_size`` does (the CPU
    allocator, MPS, HPU, cuDNN's "not supported"), following ``__cause__``
    and ``__context__``. A :class:`SampleTooLargeError` is the fallback's
    final verdict and is not treated as a retryable out-of-memory error.

    Example:
        >>> import torch
        >>> is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
        True
        >>> try:
        ...     try:
        ...         raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ...")
        ...     except RuntimeError as oom:
        ...         raise ValueError("wrapped") from oom
        ... except ValueError as error:
        ...     is_oom(error), is_oom(ValueError("out of patience"))
        (True, False)
    """
    pending = [error]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, SampleTooLargeError):
            return False
        if isinstance(current, _TORCH_OOM) or _accelerate_says_oom(current):
            return True
        pending += [current.__cause__, current.__context__]
    return False


def free_memory() -> None:
    """Collect garbage and return cached device memory (accelerate's ``clear_device_cache``)."""
    try:
        from accelerate.utils.memory import clear_device_cache
    except ImportError:
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        return
    clear_device_cache(garbage_collection=True)


@dataclass(frozen=True)
class OOMEvent:
    """One out-of-memory event, as every rank agreed on it."""

    epoch: int
    step: int
    """The step of the epoch whose batch ran out of memory."""
    mode: str
    """``"split"`` (micro-batch budget shrunk) or ``"halve"`` (sampler re-planned)."""
    old_max_tokens: float
    new_max_tokens: float
    longest: int
    """The longest sequence in the batch (or micro-batch) that ran out of memory."""
    ranks: tuple[int, ...]
    """The ranks that ran out of memory."""
    where: tuple[str, ...]
    """For each of ``ranks``: ``"forward"`` or ``"backward"``."""
    attempt: int = 0
    """0 for the step's first try; 1, 2, ... for retries of smaller micro-batches."""

    def __str__(self) -> str:
        places = ", ".join(f"rank {r} ({w})" for r, w in zip(self.ranks, self.where, strict=True))
        retry = f" (retry {self.attempt})" if self.attempt else ""
        action = "micro-batches" if self.mode == "split" else "re-planned the epoch"
        return (
            f"out of memory at epoch {self.epoch}, step {self.step}{retry} on {places}, longest sequence "
            f"{self.longest} tokens: max_tokens {self.old_max_tokens:g} -> {self.new_max_tokens:g} ({action})"
        )

    def replace(self, **changes: Any) -> OOMEvent:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> OOMEvent:
        values = dict(data)
        values["ranks"] = tuple(values["ranks"])
        values["where"] = tuple(values["where"])
        return cls(**values)


def next_event(
    rows: list[list[float]],
    *,
    epoch: int,
    step: int,
    mode: str,
    max_tokens: float,
    factor: float,
    min_tokens: float | None,
    attempt: int,
) -> OOMEvent:
    """The event all ranks derive from the shared outcome rows of a step in which some rank ran out of memory.

    The new budget is ``factor * min(max_tokens, cost of the costliest batch
    that failed)``, so a batch far under the budget that still fails is
    split at once, and never below ``min_tokens``.

    Raises:
        SampleTooLargeError: a rank ran out of memory on a single sample, or
            ``max_tokens`` is already at ``min_tokens``.

    Example:
        >>> rows = [[OK, 0, 0, 0, 0], [OOM, 2, 900.0, 90, 10]]
        >>> event = next_event(rows, epoch=0, step=3, mode="split", max_tokens=1024,
        ...                    factor=0.5, min_tokens=None, attempt=0)
        >>> event.new_max_tokens, event.ranks, event.where, event.longest
        (450.0, (1,), ('backward',), 90)
    """
    failing = [r for r, row in enumerate(rows) if row[0] == OOM]
    if not failing:
        raise ValueError("next_event needs at least one row with an out-of-memory status")
    longest = int(max(rows[r][3] for r in failing))
    new = factor * min(max_tokens, max(rows[r][2] for r in failing))
    single = [r for r in failing if rows[r][4] == 1]
    if single:
        rank, length = single[0], int(rows[single[0]][3])
        raise SampleTooLargeError(
            f"a single sample of {length} tokens ran out of memory on its own (rank {rank}, epoch "
            f"{epoch}, step {step}, max_tokens={max_tokens:g}); nothing smaller is left to try: truncate "
            f"sequences below {length} tokens (the tokenizer's max_length), or free memory (a smaller "
            f"model or dtype, gradient checkpointing)",
            length=length,
            max_tokens=max_tokens,
            step=step,
            rank=rank,
        )
    if min_tokens is not None:
        if max_tokens <= min_tokens:
            raise SampleTooLargeError(
                f"out of memory at epoch {epoch}, step {step} on rank(s) {failing} (longest sequence "
                f"{longest} tokens) with max_tokens={max_tokens:g} already at min_tokens={min_tokens:g}; "
                f"lower min_tokens, truncate sequences, or free memory",
                length=longest,
                max_tokens=max_tokens,
                step=step,
                rank=failing[0],
            )
        new = max(new, min_tokens)
    return OOMEvent(
        epoch=epoch,
        step=step,
        mode=mode,
        old_max_tokens=float(max_tokens),
        new_max_tokens=float(new),
        longest=longest,
        ranks=tuple(failing),
        where=tuple(PHASES[int(rows[r][1])] for r in failing),
        attempt=attempt,
    )
