"""The guard's stand-in for DDP's reducer: buffers and gradients synchronised where every rank arrives.

DDP synchronises inside the passes that can fail: it broadcasts buffers at
the start of its forward and all-reduces gradients during the backward. A
rank that runs out of memory half-way would leave the others waiting in a
collective it never reaches. So the guard runs DDP under ``no_sync()``,
broadcasts the buffers itself before anything can fail, and averages the
gradients itself once every rank has said its step succeeded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tokenbatch import distributed


class DDPSync:
    """DDP's synchronisation for one model, done by the guard (nothing to do for a plain module)."""

    def __init__(self, model: nn.Module) -> None:
        self.ddp = model if isinstance(model, DistributedDataParallel) else None

    @contextlib.contextmanager
    def step(self, accelerator: Any = None) -> Iterator[bool]:
        """Around a guarded step: buffers broadcast first, DDP's own forward sync restored after.

        Yields whether the guard must average gradients itself (DDP on
        several processes, and the accelerator says ``sync_gradients``).
        """
        ddp = self.ddp
        world = distributed.world_size() if distributed.is_initialized() else 1
        sync = ddp is not None and world > 1 and bool(getattr(accelerator, "sync_gradients", True))
        forward_sync = ddp.require_forward_param_sync if ddp is not None else False
        if ddp is not None and world > 1:
            broadcast_module_buffers(ddp)  # before anything that can fail
        try:
            yield sync
        finally:
            if ddp is not None:
                ddp.require_forward_param_sync = forward_sync

    def no_sync(self) -> contextlib.AbstractContextManager[Any]:
        """DDP's ``no_sync()``: no gradient all-reduce during the backward passes."""
        return self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()

    def before_forward(self) -> None:
        """Keep DDP from broadcasting buffers in its forward, where a rank that already failed never comes.

        :meth:`step` broadcasts them at the start of the step instead.
        """
        if self.ddp is not None:
            self.ddp.require_forward_param_sync = False

    def gradient_average(self, params: Sequence[torch.Tensor]) -> GradientAverage:
        """The parameters' gradients packed for averaging, in DDP's bucket size."""
        bucket_bytes = int(getattr(self.ddp, "bucket_bytes_cap", 25 * 2**20))
        return GradientAverage(params, bucket_bytes=bucket_bytes)


def _buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ``bucket_bytes`` each."""
    bucket: list[torch.Tensor] = []
    size = 0
    for tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and (
            size + nbytes > bucket_bytes
            or tensor.dtype != bucket[0].dtype
            or tensor.device != bucket[0].device
        ):
            yield bucket
            bucket, size = [], 0
        bucket.append(tensor)
        size += nbytes
    if bucket:
        yield bucket


def broadcast_(tensors: Sequence[torch.Tensor], *, src: int = 0, bucket_bytes: int = 25 * 2**20) -> None:
    """Overwrite ``tensors`` in place with rank ``src``'s values (no-op on one process)."""
    if not distributed.is_initialized() or distributed.world_size() == 1:
        return
    with torch.no_grad():
        for bucket in _buckets(tensors, bucket_bytes):
            flat = torch.cat([t.reshape(-1) for t in bucket])
            dist.broadcast(flat, src=src)
            _unflatten_into(flat, bucket)


class GradientAverage:
    """Gradients made ready to be averaged over all ranks: large ones in place, small ones packed.

    Made inside the guarded step, so that running out of memory for the
    packing buffers is reported like any other out-of-memory error instead of
    failing on one rank between collectives. Gradients of ``inplace_bytes``
    or more are all-reduced where they are (no copy, no extra memory); the
    rest are copied into flat buckets of up to ``bucket_bytes``, so that
    hundreds of small tensors cost a few collectives. A missing gradient
    counts as zeros. Which tensor goes where depends only on the parameters,
    so every rank issues the same collectives in the same order.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        *,
        bucket_bytes: int = 25 * 2**20,
        inplace_bytes: int = 2**20,
    ) -> None:
        self.params = list(params)
        # all_reduce needs contiguous tensors; a strided gradient is replaced by a contiguous copy.
        self._grads = [torch.zeros_like(p) if p.grad is None else p.grad.contiguous() for p in self.params]
        large = [p.numel() * p.element_size() >= inplace_bytes for p in self.params]
        self._inplace = [i for i, big in enumerate(large) if big]
        small = [i for i, big in enumerate(large) if not big]
        self._buckets: list[tuple[torch.Tensor, list[int]]] = []
        with torch.no_grad():
            for bucket in _buckets([self.params[i] for i in small], bucket_bytes):
                indices, small = small[: len(bucket)], small[len(bucket) :]
                flat = torch.cat([self._grads[i].reshape(-1) for i in indices])
                self._buckets.append((flat, indices))

    def average_into_grads(self, present: Sequence[bool]) -> None:
        """Average over ranks into ``.grad`` of the parameters some rank has a gradient for.

        Each tensor is divided by the world size before the sum, as DDP does,
        so that large gradients do not overflow in half precision.
        """
        world = distributed.world_size() if distributed.is_initialized() else 1
        with torch.no_grad():
            for index in self._inplace:
                if world > 1:
                    self._grads[index].div_(world)
                    dist.all_reduce(self._grads[index], op=dist.ReduceOp.SUM)
            for flat, indices in self._buckets:
                if world > 1:
                    flat.div_(world)
                    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
                _unflatten_into(flat, [self._grads[i] for i in indices])
        for param, grad, keep in zip(self.params, self._grads, present, strict=True):
            # No rank used it: leave .grad None, as DDP does; used elsewhere only: the average.
            param.grad = grad if keep else None
        self._grads, self._buckets = [], []


def broadcast_module_buffers(ddp: DistributedDataParallel) -> None:
    """DDP's buffer broadcast from rank 0, done by hand where the caller knows every rank arrives.

    Does what DDP does at the start of its forward when its settings ask for
    it (``forward_sync_buffers``, formerly ``broadcast_buffers``).
    """
    enabled = getattr(ddp, "forward_sync_buffers", getattr(ddp, "broadcast_buffers", True))
    if not enabled or not ddp.require_forward_param_sync:
        return
    ignored = set(getattr(ddp, "parameters_to_ignore", ()))
    buffers = [b for name, b in ddp.module.named_buffers() if name not in ignored]
    if buffers:
        broadcast_(buffers, src=0)


def _unflatten_into(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for tensor in tensors:
        count = tensor.numel()
        tensor.copy_(flat[offset : offset + count].view_as(tensor))
        offset += count
