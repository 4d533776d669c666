"""The guard's stand-in for DDP's reducer: buffers and gradients synchronised where every rank arrives.

DDP synchronises inside the passes that can fail: it broadcasts buffers at
the start of its forward and all-reduces gradients during the backward. A
rank that runs out of memory half-way would leave the others waiting in a
collective it never reaches. So the guard runs DDP under ``no_sync()``,
broadcasts the buffers itself before anything can fail, and all-reduces the
gradients itself, in one of two ways:

- overlapped (:class:`OverlapReducer`, the default): during backward, in an
  order fixed by the parameters alone, which a rank that fails still
  completes before the ranks compare outcomes;
- after the step (:class:`GradientAverage`, ``overlap=False`` and models
  with sparse gradients): once every rank has said its step succeeded.

The overlapped path keeps DDP's overlap of communication and compute and
removes the wait: the units of communication are fixed by the parameters
(the same on every rank), they are issued strictly in that order, and a rank
whose attempt fails, in forward or in backward, issues every unit it had not
issued yet (with a scratch buffer whose contents do not matter) before the
outcome all-reduce. So every attempt on every rank issues the same
collectives in the same order::

    unit 0, unit 1, ..., unit n-1 (async, during backward)  ->  outcome all-reduce
    success everywhere: wait, the gradients are the averages
    any failure:        wait, drop the gradients (they are sums of partial ones)

Units, in reversed parameter order (about the order backward produces
gradients): each gradient of at least ``inplace_bytes`` is all-reduced
where it is (no copy, no extra memory); the smaller ones are packed into
flat buffers of up to ``bucket_bytes``, issued after the large ones (they
are a sliver of the bytes). A unit is issued once all its parameters'
gradients are accumulated (``register_post_accumulate_grad_hook``) and
every unit before it has been issued; a parameter that gets no gradient
holds its unit, and those after it, back to the end of backward, where the
rest are issued with zeros for it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from tokenbatch import _distributed as distributed
from tokenbatch.oom._errors import free_memory, is_oom


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


# -- overlapped: all-reduced during backward, in the same order on every rank ------------


@dataclass(frozen=True)
class Unit:
    """One collective: a large gradient in place, or small ones packed into one flat buffer."""

    indices: tuple[int, ...]
    packed: bool
    numel: int
    dtype: torch.dtype
    device: torch.device


def plan_units(params: Sequence[torch.Tensor], *, bucket_bytes: int, inplace_bytes: int) -> list[Unit]:
    """The units of communication for ``params``: a pure function of their shapes, dtypes and devices.

    Example:
        >>> big, small = torch.zeros(1000), torch.zeros(10)
        >>> units = plan_units([small, big, small], bucket_bytes=100, inplace_bytes=400)
        >>> [(u.indices, u.packed) for u in units]
        [((1,), False), ((2, 0), True)]
    """
    units: list[Unit] = []
    small: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    sizes: dict[tuple[torch.dtype, torch.device], int] = {}
    closed: list[Unit] = []

    def close(key: tuple[torch.dtype, torch.device]) -> None:
        run = small.pop(key, [])
        if run:
            numel = sum(params[i].numel() for i in run)
            closed.append(Unit(tuple(run), True, numel, key[0], key[1]))
        sizes.pop(key, None)

    for index in reversed(range(len(params))):
        param = params[index]
        nbytes = param.numel() * param.element_size()
        key = (param.dtype, param.device)
        if nbytes >= inplace_bytes:
            units.append(Unit((index,), False, param.numel(), param.dtype, param.device))
            continue
        if small.get(key) and sizes[key] + nbytes > bucket_bytes:
            close(key)
        small.setdefault(key, []).append(index)
        sizes[key] = sizes.get(key, 0) + nbytes
    for key in list(small):
        close(key)
    return units + closed


def unsupported(model: nn.Module) -> str | None:
    """Why the overlapped path cannot run ``model`` (None: it can)."""
    if not distributed.is_initialized() or distributed.world_size() == 1:
        return "one process: nothing to communicate"
    for name, module in model.named_modules():
        if getattr(module, "sparse", False) is True:  # nn.Embedding(sparse=True): no flat buffer for it
            return f"module {name!r} makes sparse gradients"
    return None


class OverlapReducer:
    """The fixed units of one model's parameters; :meth:`begin` starts one attempt's all-reduces.

    Example (one process, where the units are all-reduced with nobody)::

        reducer = OverlapReducer(params)
        round = reducer.begin(earlier=None)
        with round.armed():          # around the last backward of the attempt
            loss.backward()
        round.finish()               # success: issue what is left; or round.abandon() on failure
        # ... the outcome all-reduce ...
        round.average_into_grads(present)  # or round.discard()
    """

    def __init__(
        self, params: Sequence[nn.Parameter], *, bucket_bytes: int = 25 * 2**20, inplace_bytes: int = 2**20
    ) -> None:
        self.params = list(params)
        self.units = plan_units(self.params, bucket_bytes=bucket_bytes, inplace_bytes=inplace_bytes)
        self.unit_of = {i: u for u, unit in enumerate(self.units) for i in unit.indices}

    def matches(self, params: Sequence[nn.Parameter]) -> bool:
        same = len(params) == len(self.params)
        return same and all(a is b for a, b in zip(params, self.params, strict=True))

    def begin(self, earlier: Sequence[torch.Tensor | None] | None) -> Round:
        """One attempt's all-reduces; ``earlier``: the group's gradients held aside (accumulation)."""
        return Round(self, earlier)


@dataclass
class Round:
    """The collectives of one attempt of a step on this rank (see :class:`OverlapReducer`)."""

    reducer: OverlapReducer
    earlier: Sequence[torch.Tensor | None] | None
    issued: int = 0
    """Units issued so far, in order."""
    issued_early: int = 0
    """Of those, the units issued while some gradient was still to come: overlapping backward."""
    ready: list[int] = field(default_factory=list)
    fired: set[int] = field(default_factory=set)
    handles: list[dist.Work | None] = field(default_factory=list)
    tensors: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per parameter index, the tensor its average lands in."""
    flats: dict[int, torch.Tensor] = field(default_factory=dict)
    """Per packed unit, its flat buffer."""

    def __post_init__(self) -> None:
        self.ready = [0] * len(self.reducer.units)
        self.world = distributed.world_size() if distributed.is_initialized() else 1

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Hooks that issue each unit as soon as its gradients are accumulated, and the ones before it."""
        handles: list[RemovableHandle] = [
            param.register_post_accumulate_grad_hook(self._hook(index))  # type: ignore[no-untyped-call]
            for index, param in enumerate(self.reducer.params)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _hook(self, index: int) -> Callable[[torch.Tensor], None]:
        def accumulated(param: torch.Tensor) -> None:
            unit = self.reducer.unit_of[index]
            if unit < self.issued:  # its all-reduce has begun: this gradient would be left out
                raise RuntimeError(
                    f"OOMFallback(overlap=True): the gradient of parameter {index} was accumulated twice "
                    f"in one backward pass (reentrant gradient checkpointing, or a parameter used in two "
                    f"backward calls of one loss_fn?), after its all-reduce had started; pass "
                    f"OOMFallback(..., overlap=False), which averages gradients after the backward pass"
                )
            if index in self.fired:  # accumulated again before its unit went out: nothing to do
                return
            self.fired.add(index)
            self.ready[unit] += 1
            self._issue_ready()

        return accumulated

    def _issue_ready(self) -> None:
        units = self.reducer.units
        while self.issued < len(units) and self.ready[self.issued] == len(units[self.issued].indices):
            self._issue(self.issued)
            self.issued_early += len(self.fired) < len(self.reducer.params)

    def _grad(self, index: int) -> torch.Tensor | None:
        """This parameter's gradient for the step: the fresh one plus the group's earlier one."""
        param = self.reducer.params[index]
        earlier = None if self.earlier is None else self.earlier[index]
        if earlier is not None:
            if param.grad is None:
                param.grad = earlier.clone()  # the earlier tensor stays intact for a restore
            else:
                param.grad.add_(earlier)
        return param.grad

    def _issue(self, number: int) -> None:
        """Start unit ``number``'s all-reduce (gradients divided by the world size first, as DDP does)."""
        unit = self.reducer.units[number]
        params = self.reducer.params
        with torch.no_grad():
            if unit.packed:
                flat = torch.empty(unit.numel, dtype=unit.dtype, device=unit.device)
                offset = 0
                for index in unit.indices:
                    grad, count = self._grad(index), params[index].numel()
                    part = flat[offset : offset + count]
                    if grad is None:
                        part.zero_()
                    else:
                        part.copy_(grad.reshape(-1))
                    offset += count
                self.flats[number] = flat
                tensor = flat
            else:
                (index,) = unit.indices
                grad = self._grad(index)
                if grad is None:  # unused here: zeros, kept out of .grad until every rank reports
                    tensor = torch.zeros_like(params[index])
                else:
                    if not grad.is_contiguous():
                        params[index].grad = grad = grad.contiguous()
                    tensor = grad
                self.tensors[index] = tensor
            if self.world > 1:
                tensor.div_(self.world)
        self.handles.append(dist.all_reduce(tensor, async_op=True) if self.world > 1 else None)
        self.issued = number + 1

    def finish(self) -> Round:
        """This rank's attempt succeeded: issue every unit not issued yet, in order."""
        while self.issued < len(self.reducer.units):
            self._issue(self.issued)
        return self

    def abandon(self) -> None:
        """This rank's attempt failed: issue the units not issued yet from a scratch buffer, and wait.

        The results are never used (every rank discards a failed round), only
        the sequence of collectives matters. The scratch buffer is allocated
        after the failed attempt's activations are gone; if even that fails,
        memory is collected and it is tried once more.
        """
        units = self.reducer.units[self.issued :]
        scratch: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        for unit in units:
            key = (unit.dtype, unit.device)
            size = max(u.numel for u in units if (u.dtype, u.device) == key)
            if key not in scratch:
                try:
                    scratch[key] = torch.zeros(size, dtype=unit.dtype, device=unit.device)
                except Exception as error:
                    if not is_oom(error):
                        raise
                    free_memory()
                    scratch[key] = torch.zeros(size, dtype=unit.dtype, device=unit.device)
            if self.world > 1:
                dist.all_reduce(scratch[key][: unit.numel], async_op=True).wait()
            self.handles.append(None)
            self.issued += 1
        self.wait()

    def wait(self) -> None:
        """Wait for every collective issued (they complete: every rank issues the same ones)."""
        handles, self.handles = self.handles, []
        for handle in handles:
            if handle is not None:
                handle.wait()

    def average_into_grads(self, present: Sequence[bool]) -> None:
        """Every rank succeeded: the averages go into ``.grad`` (None where no rank had a gradient)."""
        self.wait()
        params = self.reducer.params
        with torch.no_grad():
            for number, flat in self.flats.items():
                offset = 0
                for index in self.reducer.units[number].indices:
                    count = params[index].numel()
                    self.tensors[index] = flat[offset : offset + count].view_as(params[index])
                    offset += count
        for index, param in enumerate(params):
            if not present[index]:
                param.grad = None
            elif param.grad is not self.tensors[index]:
                if param.grad is None:
                    param.grad = self.tensors[index]
                else:
                    param.grad.copy_(self.tensors[index])
        self.tensors, self.flats = {}, {}
