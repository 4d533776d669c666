"""Fault injection: rehearse your out-of-memory path on any machine, GPU or not.

:func:`inject_oom` makes a model raise a real ``torch.OutOfMemoryError`` (or
the CPU allocator's ``RuntimeError``) whenever a batch's padded size (or a
pack's cost) exceeds a limit, in the forward or in the backward pass, on the
ranks you choose.
The error comes from inside the model call (a forward pre-hook) or from
inside autograd (a gradient hook on the first parameter, so most of the
backward pass has already run), exactly where a real one would.
"""

from __future__ import annotations

from collections.abc import Collection
from types import TracebackType
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.hooks import RemovableHandle

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch._packs import packed_examples
from tokenbatch.cost import CostModel

__all__ = ["inject_oom"]  # it returns an OOMInjector (its count, remove())

WHERE = ("forward", "backward")
KINDS = ("cuda", "cpu")


def _batch_shape(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int, int] | None:
    """(rows, padded length) of the token tensor in a model call, if there is one."""
    for name in ("attention_mask", "input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0]), int(value.shape[1])
    return None


def _sharded(param: torch.Tensor) -> bool:
    """True for a parameter FSDP2 shards (a ``DTensor``)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch < 2.5 has no public DTensor
        return False
    return isinstance(param, DTensor)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor that requires grad in a module's output (a tensor, or a container of them)."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values: Any = output.values() if isinstance(output, dict) else ()
    if isinstance(output, tuple | list):
        values = output
    return next((t for t in map(_first_grad_tensor, values) if t is not None), None)


class _Costed(Protocol):
    """What carries a budget's cost: a TokenBudgetBatchSampler or TokenBudgetStream (a layer above)."""

    cost: CostModel


def _as_cost(cost: CostModel | _Costed | None) -> CostModel:
    """The cost ``inject_oom(cost=...)`` counts: a CostModel, a sampler's or stream's, or padded tokens."""
    if cost is None:
        return CostModel()
    if isinstance(cost, CostModel):
        return cost
    own = getattr(cost, "cost", None)
    if isinstance(own, CostModel):
        return own
    raise TypeError(
        f"cost should be the TokenBudgetBatchSampler (or TokenBudgetStream) whose budget max_tokens is in, "
        f"or a tokenbatch.CostModel, but got cost={cost!r:.100}; leave it out to count padded tokens"
    )


class OOMInjector:
    """Raises an out-of-memory error from a model whenever a batch costs more than ``max_tokens``.

    Use :func:`inject_oom` to make one. ``count`` is how many errors it has
    raised, ``calls`` how many forward passes it has seen, ``costs`` the cost
    of each of them; ``remove()`` (or leaving the ``with`` block) takes the
    hooks off.

    Example:
        >>> import torch
        >>> from tokenbatch import is_oom
        >>> from tokenbatch.testing import inject_oom
        >>> model = torch.nn.Embedding(10, 4)
        >>> with inject_oom(model, max_tokens=8) as injector:
        ...     _ = model(torch.zeros(2, 3, dtype=torch.long))  # 6 padded tokens: fine
        ...     try:
        ...         model(torch.zeros(4, 3, dtype=torch.long))  # 12 padded tokens: out of memory
        ...     except Exception as error:
        ...         print(type(error).__name__, is_oom(error), injector.count)
        OutOfMemoryError True 1
    """

    def __init__(
        self,
        model: nn.Module,
        max_tokens: float,
        *,
        where: str = "forward",
        ranks: Collection[int] | None = None,
        times: int | None = None,
        after: int = 0,
        cost: CostModel | _Costed | None = None,
        kind: str = "cuda",
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model should be a torch.nn.Module, but got model of type {type(model).__name__}"
            )
        self.module = model.module if isinstance(model, DistributedDataParallel) else model
        self.max_tokens = _checks.non_negative_number("max_tokens", max_tokens)
        self.where = _checks.one_of("where", where, WHERE)
        self.kind = _checks.one_of("kind", kind, KINDS)
        self.ranks = None if ranks is None else frozenset(int(r) for r in ranks)
        self.times = None if times is None else _checks.positive_int("times", times)
        self.after = _checks.non_negative_int("after", after)
        self.cost = _as_cost(cost)
        self._tokens = cost is None  # the default counts the tensor's tokens, padded or packed
        self.count = 0
        self.calls = 0
        self.costs: list[float] = []
        self._armed: tuple[int, int, float] | None = None  # the call backward should fail for
        self._handles: list[RemovableHandle] = [
            self.module.register_forward_pre_hook(self._pre_forward, with_kwargs=True)
        ]
        if self.where == "backward":
            first = next((p for p in self.module.parameters() if p.requires_grad), None)
            if first is None:
                raise ValueError("where='backward' needs a model with a parameter that requires grad")
            if _sharded(first):
                # FSDP2: the graph holds the unsharded copy, and hooks on the sharded parameter never
                # run. The gradient of the output of the module that owns it comes just before its own.
                owner = next(m for m in self.module.modules() if any(p is first for p in m.parameters(False)))
                self._handles.append(owner.register_forward_hook(self._on_output))
            else:
                self._handles.append(first.register_hook(self._on_gradient))

    def _due(self, batch_cost: float) -> bool:
        if batch_cost <= self.max_tokens or self.calls <= self.after:
            return False
        if self.ranks is not None and distributed.rank() not in self.ranks:
            return False
        return self.times is None or self.count < self.times

    def _error(self, rows: int, length: int, batch_cost: float) -> BaseException:
        # Sized like the real thing: a float32 attention score tensor for the batch.
        size = rows * length * length * 4
        note = (
            f"(injected by tokenbatch.testing in {self.where}: batch of {rows} x {length} costs "
            f"{batch_cost:g} > max_tokens={self.max_tokens:g} on rank {distributed.rank()})"
        )
        if self.kind == "cpu":
            return RuntimeError(
                f"[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                f"you tried to allocate {size} bytes. Error code 12 (Cannot allocate memory) {note}"
            )
        return torch.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {size / 2**20:.2f} MiB. {note}")

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        shape = _batch_shape(args, kwargs)
        if shape is None:
            return None
        rows, length = shape
        packed = None if self._tokens else packed_examples(kwargs)
        if packed is not None:  # a flattened batch: its examples' lengths, costed as the cost model says
            batch_cost = self.cost.batch_cost(packed.lengths)
        else:
            batch_cost = float(self.cost.cost(rows, length))
        self.calls += 1
        self.costs.append(batch_cost)
        self._armed = None
        if self._due(batch_cost):
            if self.where == "forward":
                self.count += 1
                raise self._error(rows, length, batch_cost)
            if torch.is_grad_enabled():
                self._armed = (rows, length, batch_cost)
        return None

    def _on_output(self, module: nn.Module, args: Any, output: Any) -> None:
        tensor = _first_grad_tensor(output)
        if self._armed is not None and tensor is not None:
            tensor.register_hook(self._on_gradient)  # type: ignore[no-untyped-call]

    def _on_gradient(self, grad: torch.Tensor) -> None:
        armed, self._armed = self._armed, None
        if armed is not None:
            self.count += 1
            raise self._error(*armed)

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def __enter__(self) -> OOMInjector:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.remove()


def inject_oom(
    model: nn.Module,
    max_tokens: float,
    *,
    where: str = "forward",
    ranks: Collection[int] | None = None,
    times: int | None = None,
    after: int = 0,
    cost: CostModel | _Costed | None = None,
    kind: str = "cuda",
) -> OOMInjector:
    """Make ``model`` run out of memory on batches that cost more than ``max_tokens``.

    Works as a context manager or stays until ``.remove()``.

    Args:
        model: the model, plain or DDP-wrapped (the hooks go on the inner module,
            so DDP's own forward runs as usual).
        max_tokens: the limit; a model call whose (rows, padded length) costs
            more raises. The batch shape is read from ``attention_mask``,
            ``input_ids`` or ``inputs_embeds``, else the first 2-D tensor argument.
            With ``cost``, a flattened batch (a pack: ``position_ids`` restarting per
            example and no ``attention_mask``, as ``DataCollatorWithFlattening``
            collates it) costs ``cost.batch_cost`` of its examples' lengths.
        where: ``"forward"`` raises before the model runs; ``"backward"``
            raises from autograd when the first parameter's gradient is
            computed, near the end of the backward pass (under FSDP2, whose
            sharded parameters are not in the graph, the gradient of the output
            of the module that holds it, just before).
        ranks: raise only on these ranks (default: all).
        times: raise at most this many times (default: every time).
        after: let the first ``after`` model calls through whatever their
            cost (to rehearse an OOM in the middle of an epoch).
        cost: how a batch is costed: pass the sampler (or stream) feeding the
            model, or its ``CostModel``, to rehearse in the budget's own units,
            the rule growth assumes memory follows (see docs/oom.md, Growth).
            Default: padded tokens, rows x length (the default sampler's cost; a
            pack's row: its tokens).
        kind: ``"cuda"`` raises ``torch.OutOfMemoryError``; ``"cpu"`` raises the
            ``RuntimeError`` of PyTorch's CPU allocator.
    """
    return OOMInjector(
        model, max_tokens, where=where, ranks=ranks, times=times, after=after, cost=cost, kind=kind
    )
