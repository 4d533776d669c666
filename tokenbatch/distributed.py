"""Which process am I, how many are there, and do we all agree.

The only module that touches ``torch.distributed``. When no process group is
initialised yet, the launchers' environment variables (``WORLD_SIZE`` and
``RANK``, set by ``torchrun`` and ``accelerate launch``) answer instead, so a
sampler built before ``Accelerator()`` still plans for the right world size.

The OOM fallback's collectives live here too: one small all-reduce that tells
every rank how every other rank's step went, and the buffer broadcast and
gradient average it runs itself instead of DDP, at points every rank reaches.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    """True inside an initialised ``torch.distributed`` process group."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    """Number of processes: the process group's, else ``$WORLD_SIZE``, else 1."""
    if is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    """This process's rank: the process group's, else ``$RANK``, else 0."""
    if is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def all_reduce_max(values: list[float], device: torch.device | str = "cpu") -> list[float]:
    """Element-wise maximum of ``values`` over all ranks (identity on one process).

    ``device`` must be one the process group's backend can reduce on (CUDA
    tensors for NCCL, CPU tensors for gloo).
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_objects(value: object) -> list[object]:
    """``value`` from every rank, in rank order (``[value]`` on one process)."""
    if not is_initialized() or dist.get_world_size() == 1:
        return [value]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def collective_device() -> torch.device:
    """Where small tensors for collectives must live: the current GPU for NCCL, else CPU."""
    if is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_rows(row: Sequence[float], flags: Sequence[bool] = ()) -> tuple[list[list[float]], list[bool]]:
    """Every rank's ``row`` and, per position, whether any rank set ``flags``: one all-reduce.

    Each rank writes its row into its own slot of a zero tensor and the ranks
    sum it, so every rank learns every other rank's row from a single small
    collective. ``row`` and ``flags`` must have the same length on every rank.

    Returns:
        ``(rows, any_flags)``: ``rows[r]`` is rank ``r``'s row.
    """
    if not is_initialized() or dist.get_world_size() == 1:
        return [[float(v) for v in row]], [bool(f) for f in flags]
    world, me, width = dist.get_world_size(), dist.get_rank(), len(row)
    tensor = torch.zeros(world * width + len(flags), dtype=torch.float64)
    tensor[me * width : (me + 1) * width] = torch.tensor(row, dtype=torch.float64)
    if len(flags):
        tensor[world * width :] = torch.tensor(flags, dtype=torch.float64)
    tensor = tensor.to(collective_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    values = tensor.cpu().tolist()
    rows = [values[r * width : (r + 1) * width] for r in range(world)]
    return rows, [v > 0 for v in values[world * width :]]


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
    if not is_initialized() or dist.get_world_size() == 1:
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
        world = dist.get_world_size() if is_initialized() else 1
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


def broadcast_module_buffers(ddp: torch.nn.parallel.DistributedDataParallel) -> None:
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
