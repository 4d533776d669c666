"""One measured training step for the probe: the peaks of its two phases, state kept intact.

How the peaks are measured, and why so (CUDA allocator statistics, the torch
profiler's memory accounting on CPU, two phases per step), is told in the
docstring of :mod:`tokenbatch.probe`, where users read it.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch.oom import is_oom
from tokenbatch.probe._synthetic import LossFn, MakeBatch, default_loss, synthetic_batch


@dataclass(frozen=True)
class StepPeak:
    """Peak bytes of one step's two phases, or ``oom=True`` when it ran out of memory."""

    forward_backward: int
    optimizer_step: int
    oom: bool = False


def _cpu_copy(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: _cpu_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_cpu_copy(v) for v in value)
    return value


@contextlib.contextmanager
def preserved(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> Iterator[None]:
    """Snapshot weights, buffers, gradients, optimizer state, train mode and RNG; restore them on exit.

    Copies go to host memory so that a GPU probe does not measure them.
    """
    tensors = [t for _, t in model.named_parameters()] + [t for _, t in model.named_buffers()]
    values = [t.detach().to("cpu", copy=True) for t in tensors]
    params = list(model.parameters())
    grads = [None if p.grad is None else p.grad.detach().to("cpu", copy=True) for p in params]
    optimizer_state = _cpu_copy(optimizer.state_dict()) if optimizer is not None else None
    rng_cpu = torch.get_rng_state()
    initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    rng_cuda = torch.cuda.get_rng_state_all() if initialized else None
    rng_python, rng_numpy = random.getstate(), np.random.get_state()
    was_training = model.training
    for p in params:
        p.grad = None
    try:
        yield
    finally:
        with torch.no_grad():
            for tensor, value in zip(tensors, values, strict=True):
                tensor.copy_(value)
        for p, g in zip(params, grads, strict=True):
            p.grad = None if g is None else g.to(p.device)
        if optimizer is not None and optimizer_state is not None:
            optimizer.load_state_dict(optimizer_state)
        torch.set_rng_state(rng_cpu)
        if rng_cuda is not None:
            torch.cuda.set_rng_state_all(rng_cuda)
        random.setstate(rng_python)
        np.random.set_state(rng_numpy)
        model.train(was_training)


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of the model's first parameter (CPU for a model without any)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def held_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> int:
    """Bytes of the distinct storages behind weights, buffers, gradients and optimizer state."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            storage = t.untyped_storage()
            seen[(str(t.device), storage.data_ptr())] = storage.nbytes()

    for t in list(model.parameters()) + list(model.buffers()):
        add(t)
        add(t.grad)
    if optimizer is not None:
        for state in optimizer.state.values():
            for value in state.values():
                add(value)
    return sum(seen.values())


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence file descriptor 2: kineto logs two lines on every profiler start and stop."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (embedded interpreter): nothing to silence
        yield
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


_PHASE_MARK = "tokenbatch.probe.optimizer_step"


def _cpu_phase_peaks(first: Callable[[], None], second: Callable[[], None]) -> tuple[int, int, int]:
    """Run ``first`` then ``second`` under one profiler session; CPU allocation peaks in bytes.

    Returns ``first``'s peak and net change of the running sum of allocations,
    and ``second``'s peak above where ``first`` left it. One session per step,
    not one per phase: starting and stopping the profiler costs about as much as
    a tiny model's step. A ``record_function`` mark splits the events.
    """
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        first()
        with record_function(_PHASE_MARK):
            second()
    finally:
        with _quiet_stderr():
            prof.stop()
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    boundary = None
    events = []
    for e in results.events():
        name = e.name()
        if name == "[memory]":
            if e.device_type() == DeviceType.CPU:
                events.append((e.start_ns(), int(e.nbytes())))
        elif name == _PHASE_MARK:
            boundary = e.start_ns()
    if boundary is None:
        raise RuntimeError("the torch profiler recorded no phase mark; cannot split the probe step")
    events.sort(key=lambda item: item[0])  # stable: same-instant events keep their order
    starts = np.array([start for start, _ in events], dtype=np.int64)
    running = np.cumsum(np.array([nbytes for _, nbytes in events], dtype=np.int64))
    split = int(np.searchsorted(starts, boundary))  # the events before the mark are ``first``'s
    net_first = int(running[split - 1]) if split else 0
    peak_first = int(running[:split].max(initial=0))
    peak_second = int(running[split:].max(initial=net_first)) - net_first
    return peak_first, net_first, peak_second


class ProbeStep:
    """Runs and measures one forward + backward + optimizer step at a given shape.

    The caller keeps the model's state intact with :func:`preserved`.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        make_batch: MakeBatch | None = None,
        loss_fn: LossFn | None = None,
        seed: int = 0,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.device = model_device(model)
        self.make_batch: MakeBatch = make_batch or (lambda b, n, g: synthetic_batch(model, b, n, g))
        self.loss_fn: LossFn = loss_fn or default_loss
        self.generator = torch.Generator().manual_seed(seed)

    def _batch(self, batch_size: int, length: int) -> Any:
        batch = self.make_batch(batch_size, length, self.generator)
        if isinstance(batch, Mapping):
            return {k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
        return tuple(v.to(self.device) if isinstance(v, torch.Tensor) else v for v in batch)

    def _forward_backward(self, batch: Any) -> None:
        output = self.model(**batch) if isinstance(batch, Mapping) else self.model(*batch)
        self.loss_fn(output, batch).backward()  # type: ignore[no-untyped-call]

    def _step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def run(self, batch_size: int, length: int, *, measure: bool = True) -> StepPeak:
        """Measure one step on a fresh synthetic batch; out-of-memory is reported, not raised.

        With ``measure=False`` the step only runs (a warm-up), and its peaks read 0.
        """
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            batch = self._batch(batch_size, length)
            if measure:
                return self._measure(batch)
            self._forward_backward(batch)
            self._step()
            return StepPeak(0, 0)
        except Exception as error:
            if not is_oom(error):
                raise
        # Outside the except block, so the traceback's frames (and their tensors) are gone.
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        return StepPeak(0, 0, oom=True)

    def _measure(self, batch: Any) -> StepPeak:
        if self.device.type == "cuda":
            return self._run_cuda(batch)
        base = held_bytes(self.model, self.optimizer) + _batch_bytes(batch)
        peak_a, net_a, peak_b = _cpu_phase_peaks(lambda: self._forward_backward(batch), self._step)
        return StepPeak(base + peak_a, base + net_a + peak_b)

    def _run_cuda(self, batch: Any) -> StepPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._forward_backward(batch)
        torch.cuda.synchronize(self.device)
        peak_a = torch.cuda.max_memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self._step()
        torch.cuda.synchronize(self.device)
        return StepPeak(int(peak_a), int(torch.cuda.max_memory_allocated(self.device)))


def _batch_bytes(batch: Any) -> int:
    values = batch.values() if isinstance(batch, Mapping) else batch
    return sum(v.untyped_storage().nbytes() for v in values if isinstance(v, torch.Tensor))
