"""What the guard recognises, records and raises: out-of-memory errors, :class:`OOMEvent` and the errors."""

from __future__ import annotations

import dataclasses
import gc
from dataclasses import dataclass
from typing import Any

import torch

from tokenbatch import _checks

WHERE = ("forward", "backward")


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


class OptimizerOOMError(RuntimeError):
    """``optimizer.step()`` ran out of memory and freeing memory did not help (or could not be tried).

    Raised on every rank by ``OOMFallback.step``, from the out-of-memory
    error on the ranks where it happened. ``optimizer`` is the optimizer's
    class name, ``ranks`` the ranks that failed, ``retried`` whether they
    had tried again after freeing memory.
    """

    def __init__(self, message: str, *, optimizer: str, ranks: tuple[int, ...], retried: bool) -> None:
        super().__init__(message)
        self.optimizer = optimizer
        self.ranks = ranks
        self.retried = retried


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
    growth: bool = False
    """True: the step ran under a larger budget being tried (``OOMFallback(grow=...)``) and the
    budget went back to the one before it, which had trained (or to the usual halving, if higher)."""

    def __str__(self) -> str:
        places = ", ".join(f"rank {r} ({w})" for r, w in zip(self.ranks, self.where, strict=True))
        retry = f" (retry {self.attempt})" if self.attempt else ""
        action = "micro-batches" if self.mode == "split" else "re-planned the epoch"
        if self.growth:
            action = f"a growth try failed; {action}"
        return (
            f"out of memory at epoch {self.epoch}, step {self.step}{retry} on {places}, longest sequence "
            f"{self.longest} tokens: max_tokens {_checks.budget(self.old_max_tokens)} -> "
            f"{_checks.budget(self.new_max_tokens)} ({action})"
        )

    def replace(self, **changes: Any) -> OOMEvent:
        return dataclasses.replace(self, **changes)

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, *, name: str = "event") -> OOMEvent:
        """The event :meth:`as_dict` gave (also after JSON or ``torch.save``), every field checked.

        Raises:
            TypeError, ValueError: a key is missing or unknown, or a field is
                wrong; the message names it, as ``name['field']``.
        """
        keys = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(keys):
            raise ValueError(
                f"{name} should be an OOMEvent.as_dict(), with keys {keys}, but got {name}={data!r:.200}"
            )
        field = {key: f"{name}[{key!r}]" for key in keys}
        ranks, where = data["ranks"], data["where"]
        if not isinstance(ranks, list | tuple) or not ranks:
            raise ValueError(f"{field['ranks']} should be a non-empty list of ranks, but got {ranks!r:.100}")
        if not isinstance(where, list | tuple) or len(where) != len(ranks):
            raise ValueError(
                f"{field['where']} should hold 'forward' or 'backward' for each of the {len(ranks)} "
                f"rank(s), but got {field['where']}={where!r:.100}"
            )
        number, count = _checks.positive_number, _checks.non_negative_int
        return cls(
            epoch=count(field["epoch"], data["epoch"]),
            step=count(field["step"], data["step"]),
            mode=_checks.one_of(field["mode"], data["mode"], ("split", "halve")),
            old_max_tokens=number(field["old_max_tokens"], data["old_max_tokens"]),
            new_max_tokens=number(field["new_max_tokens"], data["new_max_tokens"]),
            longest=count(field["longest"], data["longest"]),
            ranks=tuple(count(f"{field['ranks']}[{i}]", r) for i, r in enumerate(ranks)),
            where=tuple(_checks.one_of(f"{field['where']}[{i}]", w, WHERE) for i, w in enumerate(where)),
            attempt=count(field["attempt"], data["attempt"]),
            growth=_checks.boolean(field["growth"], data["growth"]),
        )


# -- recognising an out-of-memory error, and giving the memory back --------------------

# torch >= 2.5 exposes the type at the top level; before, only as torch.cuda.OutOfMemoryError.
_TORCH_OOM: type[BaseException] = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)


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
    and ``__context__``. A :class:`SampleTooLargeError` or
    :class:`OptimizerOOMError` is the fallback's final verdict and is not
    treated as a retryable out-of-memory error.

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
        if isinstance(current, (SampleTooLargeError, OptimizerOOMError)):
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
