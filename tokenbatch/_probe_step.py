"""One measured training step for the probe: synthetic batch, peak memory, state kept intact.

How peak memory is measured:

* CUDA: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``,
  the allocator's own high-water mark of tensor bytes.
* CPU: the torch profiler's memory accounting (``profile_memory=True``),
  which reports every allocation and free of PyTorch's CPU allocator with its
  exact size; the running sum's maximum is the CPU twin of CUDA's statistic,
  added to the bytes already held (weights, buffers, optimizer state). We do
  not use the process's peak RSS: glibc keeps freed heap pages resident, so
  in one process a later, smaller step shows no growth at all, and a fresh
  subprocess per shape costs seconds of interpreter and torch start-up and
  still counts the allocator's retained pages. Memory outside PyTorch's
  allocator (the interpreter, libraries, glibc's own fragmentation) is not
  counted; the probe's safety margin is there for it.

On CPU, what the operating system sees can be well above the tensor bytes:
glibc's malloc serves blocks below its sliding mmap threshold (up to 32 MiB)
from a heap that it rarely gives back, so freed activations leave holes. In
``benchmarks/probe.py`` a tiny BERT under ``RLIMIT_AS`` fitted only about 0.63
of the probe's budget with glibc's defaults, and 1.07 of it (the margin at
work) with ``MALLOC_MMAP_THRESHOLD_=65536``, which gives every tensor of 64
KiB or more its own mapping, returned when freed. Train on CPU with that
setting (or jemalloc / tcmalloc), or raise ``margin``.

Each step is measured in two phases, forward + backward and then optimizer
step + ``zero_grad``, because their peaks behave differently: the first grows
with the batch, the second is a constant (gradients plus optimizer state)
that dominates only for tiny batches.
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

MakeBatch = Callable[[int, int, torch.Generator], Any]
LossFn = Callable[[Any, Any], torch.Tensor]

_OOM_MESSAGES = (" out of memory", "DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")


def is_oom(error: BaseException) -> bool:
    """Whether ``error`` is an out-of-memory error from CUDA, MPS or the CPU allocator."""
    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _OOM_MESSAGES)


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


def synthetic_batch(
    model: torch.nn.Module, batch_size: int, length: int, generator: torch.Generator
) -> dict[str, torch.Tensor]:
    """A worst-case batch for a transformers model: ``batch_size`` sequences all ``length`` tokens long.

    The last sequence ends one pad token early, so the attention mask is a
    real padding mask (transformers drops an all-ones mask, which would let
    sdpa pick a kernel that padded batches never get). Labels follow the
    head named by the class: sequence or token classification, masked or
    causal LM; other models get none and the probe's loss is the mean output.

    Raises:
        ValueError: the model has no ``config.vocab_size`` (pass ``make_batch``),
            or ``length`` exceeds ``config.max_position_embeddings``.
    """
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if not vocab:
        raise ValueError(
            f"{type(model).__name__} has no config.vocab_size to draw synthetic token ids from; "
            f"pass make_batch=lambda batch_size, length, generator: {{...}} that builds a batch"
        )
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and length > limit:
        raise ValueError(
            f"length={length} exceeds the model's max_position_embeddings={limit}; "
            f"probe with max_len <= {limit} (truncate your data to it)"
        )
    ids = torch.randint(0, int(vocab), (batch_size, length), generator=generator)
    mask = torch.ones(batch_size, length, dtype=torch.long)
    if length > 1:
        mask[-1, -1] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    name = type(model).__name__
    num_labels = int(getattr(config, "num_labels", 2))
    if name.endswith("ForSequenceClassification"):
        batch["labels"] = (
            torch.zeros(batch_size) if num_labels == 1 else torch.zeros(batch_size, dtype=torch.long)
        )
    elif name.endswith("ForTokenClassification"):
        batch["labels"] = torch.zeros(batch_size, length, dtype=torch.long)
    elif name.endswith(("ForMaskedLM", "ForCausalLM", "LMHeadModel")):
        batch["labels"] = ids.clone()
    return batch


def default_loss(output: Any, batch: Any) -> torch.Tensor:
    """``output.loss`` when the model computed one, else the mean of its first floating output."""
    loss = getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    values = output.values() if isinstance(output, Mapping) else output
    if isinstance(values, torch.Tensor):
        return values.float().mean()
    for value in values:
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return value.float().mean()
    raise ValueError(
        f"cannot make a loss from the model's output of type {type(output).__name__}; "
        f"pass loss_fn=lambda output, batch: ... returning a scalar tensor"
    )


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


def _cpu_peak_delta(fn: Callable[[], None]) -> tuple[int, int]:
    """Run ``fn`` under the profiler; (max, final) of its running sum of CPU allocations, in bytes."""
    from torch._C._autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    with _quiet_stderr():
        prof.start()
    try:
        fn()
    finally:
        with _quiet_stderr():
            prof.stop()
    results: Any = prof.profiler.kineto_results  # type: ignore[union-attr]
    events = [
        (e.start_ns(), int(e.nbytes()))
        for e in results.events()
        if e.name() == "[memory]" and e.device_type() == DeviceType.CPU
    ]
    events.sort(key=lambda item: item[0])
    current = peak = 0
    for _, nbytes in events:
        current += nbytes
        peak = max(peak, current)
    return peak, current


class StepRunner:
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

    def run(self, batch_size: int, length: int) -> StepPeak:
        """Measure one step on a fresh synthetic batch; out-of-memory is reported, not raised."""
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        try:
            return self._measure(self._batch(batch_size, length))
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
        peak_a, net_a = _cpu_peak_delta(lambda: self._forward_backward(batch))
        peak_b, _ = _cpu_peak_delta(self._step)
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
