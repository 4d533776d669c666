"""Measuring one training step: its peak memory on a worst-case batch, with the model's state kept intact.

The probe trains on synthetic worst-case batches (:func:`synthetic_batch`:
every sequence as long as the batch's longest) and measures each step's peak
in two phases, forward + backward and then optimizer step + ``zero_grad``,
because their peaks behave differently: the first grows with the batch, the
second is a constant (gradients plus optimizer state) that dominates only for
tiny batches.

How the peaks are measured, and why so:

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

What the operating system sees on CPU can be well above these tensor bytes
(glibc's heap); the advice for that is in :mod:`tokenbatch.probe`.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tokenbatch import _checks
from tokenbatch.oom import is_oom
from tokenbatch.probe._model import Measurement

logger = logging.getLogger(__name__)

MakeBatch = Callable[[int, int, torch.Generator], Any]
LossFn = Callable[[Any, Any], torch.Tensor]


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


class BatchLike:
    """Worst-case batches shaped like one real collated batch: its keys, dtypes and per-row fields.

    For a model that needs more than token ids (labels, a wrapped encoder, extra
    inputs), the probe copies one batch of your own collator at each
    ``(batch_size, length)`` it measures::

        tensor in the real batch        in the probe's batch_size x length batch
        (rows, padded length, ...)      (batch_size, length, ...): values drawn from its real tokens
          attention_mask                  all ones but the last token of the last row (real padding)
        (rows, ...)  (labels)           (batch_size, ...): rows drawn from the real ones
        anything else                   passed as it is

    Real tokens are the positions the ``attention_mask`` marks (all, without
    one). Rows and padded length are read from ``attention_mask``, else
    ``input_ids``; a batch of two or more rows tells per-row fields apart from
    constants.

    Example:
        >>> real = {"input_ids": torch.tensor([[5, 6, 7], [5, 8, 0]]),
        ...         "attention_mask": torch.tensor([[1, 1, 1], [1, 1, 0]]), "labels": torch.tensor([2, 4])}
        >>> batch = BatchLike(real)(4, 6, torch.Generator().manual_seed(0))
        >>> {k: (tuple(v.shape), str(v.dtype)) for k, v in batch.items()}["labels"]
        ((4,), 'torch.int64')
        >>> set(batch["input_ids"].unique().tolist()) <= {5, 6, 7, 8}, batch["attention_mask"].sum().item()
        (True, 23)
    """

    def __init__(self, batch: Any) -> None:
        if not isinstance(batch, Mapping):
            raise TypeError(
                f"batch should be one collated batch, a mapping of tensors as a collator returns it, but got "
                f"batch of type {type(batch).__name__}; pass e.g. batch=collator([dataset[0], dataset[1]])"
            )
        key = next((k for k in ("attention_mask", "input_ids") if _is_2d(batch.get(k))), None)
        if key is None:
            shapes = {
                k: tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
                for k, v in batch.items()
            }
            raise ValueError(
                f"batch should hold an 'attention_mask' or 'input_ids' tensor of shape (rows, padded "
                f"length), but got batch={shapes}; pass a batch of your collator, or make_batch=... instead"
            )
        self.batch: dict[str, Any] = _cpu_copy(dict(batch))
        self.rows, self.length = (int(n) for n in self.batch[key].shape)
        mask = self.batch.get("attention_mask")
        self.real = mask.bool() if _is_2d(mask) else torch.ones(self.rows, self.length, dtype=torch.bool)
        if not bool(self.real.any()):
            raise ValueError(
                f"batch should hold at least one real token to copy, but got batch[{key!r}] of shape "
                f"{tuple(self.batch[key].shape)} with none; pass a batch of your training data"
            )

    def __call__(self, batch_size: int, length: int, generator: torch.Generator) -> dict[str, Any]:
        """A batch of ``batch_size`` rows, every one ``length`` tokens long."""
        rows = torch.randint(0, self.rows, (batch_size,), generator=generator)
        result: dict[str, Any] = {}
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape[0] != self.rows:
                result[key] = value
            elif key == "attention_mask" and value.dim() == 2:
                mask = torch.ones(batch_size, length, dtype=value.dtype)
                if length > 1:
                    mask[-1, -1] = 0
                result[key] = mask
            elif value.dim() >= 2 and value.shape[1] == self.length:
                tokens = value[self.real]  # (real tokens, ...)
                result[key] = tokens[torch.randint(0, len(tokens), (batch_size, length), generator=generator)]
            else:
                result[key] = value[rows]
        return result


def batch_maker(batch: Any, make_batch: MakeBatch | None) -> MakeBatch | None:
    """``make_batch``, or one that copies ``batch`` (:class:`BatchLike`); not both."""
    if batch is None:
        return make_batch
    if make_batch is not None:
        raise ValueError(
            "pass batch= (one real batch to copy) or make_batch= (a function that builds each one), "
            "but got both; drop one"
        )
    return BatchLike(batch)


def _is_2d(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 2


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
    """Bytes of the distinct storages behind weights, buffers, gradients and optimizer state (this rank's)."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            local = getattr(t, "to_local", None)  # a DTensor (FSDP2): this rank's shard holds the bytes
            storage = (local() if callable(local) else t).untyped_storage()
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


class Prober:
    """Measures steps, records them and drives the progress bar."""

    def __init__(self, runner: ProbeStep, target: float, progress: bool) -> None:
        self.runner, self.target = runner, target
        self.bar: Any = None
        self.steps = 0
        if progress:
            try:
                from tqdm.auto import tqdm

                self.bar = tqdm(desc="tokenbatch probe", unit="step")
            except ImportError:
                logger.info("install tqdm for a progress bar")

    def measure(self, batch_size: int, length: int) -> Measurement:
        """Run and measure one step of ``batch_size`` sequences of ``length`` tokens."""
        start = time.perf_counter()
        peak = self.runner.run(batch_size, length)
        self.steps += 1
        m = Measurement(
            batch_size=batch_size,
            length=length,
            peak_bytes=0 if peak.oom else max(peak.forward_backward, peak.optimizer_step),
            forward_backward_bytes=peak.forward_backward,
            optimizer_step_bytes=peak.optimizer_step,
            oom=peak.oom,
            seconds=time.perf_counter() - start,
        )
        if self.bar is not None:
            self.bar.update(1)
            status = "OOM" if m.oom else f"{m.peak_bytes / 2**20:,.0f}MiB"
            self.bar.set_postfix_str(f"{batch_size}x{length}: {status}")
        logger.debug("probe step %dx%d: %s", batch_size, length, m)
        return m

    def fits(self, m: Measurement) -> bool:
        """Whether a measured step stayed under the target (and did not run out of memory)."""
        return not m.oom and m.peak_bytes <= self.target

    def close(self) -> None:
        """Close the progress bar."""
        if self.bar is not None:
            self.bar.close()


def measure_peak(
    model: torch.nn.Module,
    batch_size: int,
    length: int,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    make_batch: MakeBatch | None = None,
    loss_fn: LossFn | None = None,
    warmup: bool = True,
) -> Measurement:
    """Peak memory of one forward + backward + optimizer step on a worst-case batch; state is restored.

    With ``warmup`` a tiny step runs first, so that the optimizer's state
    exists as it does in steady-state training.
    """
    batch_size = _checks.positive_int("batch_size", batch_size)
    length = _checks.positive_int("length", length)
    own_optimizer = optimizer is None
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    with preserved(model, None if own_optimizer else optimizer):
        runner = ProbeStep(model, optimizer, make_batch=make_batch, loss_fn=loss_fn)
        if warmup:
            runner.run(1, min(length, 8), measure=False)
        return Prober(runner, math.inf, progress=False).measure(batch_size, length)
