"""Recognising an out-of-memory error, and giving the memory back after one."""

from __future__ import annotations

import gc

import torch

from tokenbatch.oom._events import OptimizerOOMError, SampleTooLargeError

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
