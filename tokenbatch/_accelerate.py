"""What tokenbatch reads of accelerate's public state: the prepared DataLoader being iterated now.

And how many processes accelerate trains on (``accelerate.state.is_initialized``
and ``AcceleratorState().num_processes``), against ``torch.distributed``'s world
size: under ``torchrun`` or ``accelerate launch --multi_gpu`` on a machine without
a GPU, accelerate starts the process group and then trains alone on each process
unless ``ACCELERATE_USE_CPU=1`` says to use it (see :func:`check_processes`).

accelerate registers every prepared DataLoader it iterates in its
``GradientState`` singleton (the documented ``in_dataloader`` and
``active_dataloader`` properties), in ``begin()``, before that DataLoader
reads its batch sampler or dataset. The sampler and the stream look there,
and only there, to refuse a set-up that would otherwise lose or repeat
samples without a word, or leave a rank waiting; nothing read here changes
what is planned or yielded. Without accelerate imported there is nothing to
read. Every attribute used is public in accelerate (``batch_sampler``,
``dataset``, ``end_of_dataloader``, ``use_stateful_dataloader``,
``skip_batches``); tests in ``tests/test_sampler_accelerate.py`` and
``tests/test_stream.py`` fail loudly if one goes away.
"""

from __future__ import annotations

import sys
from typing import Any

from tokenbatch import _distributed as distributed

_DEPTH = 4  # DataLoader -> accelerate's BatchSamplerShard or SkipBatchSampler -> ... -> the sampler


def active_dataloader() -> Any | None:
    """The DataLoader accelerate is iterating now, or None (accelerate not imported, or none)."""
    state = sys.modules.get("accelerate.state")
    if state is None:
        return None
    gradient_state = state.GradientState()  # a singleton: this reads accelerate's, or starts it empty
    return gradient_state.active_dataloader if gradient_state.in_dataloader else None


def batch_samplers(dataloader: Any) -> list[Any]:
    """The chain of batch samplers under any ``dataloader``: its own, then what each wraps."""
    chain: list[Any] = []
    source = getattr(dataloader, "batch_sampler", None)
    while source is not None and len(chain) < _DEPTH:
        chain.append(source)
        source = getattr(source, "batch_sampler", None)
    return chain


def reading(sampler: Any) -> Any | None:
    """The DataLoader accelerate is iterating now if ``sampler`` is its batch sampler (or under it)."""
    loader = active_dataloader()
    if loader is None or not any(source is sampler for source in batch_samplers(loader)):
        return None
    return loader


def is_dispatcher(dataloader: Any) -> bool:
    """``dataloader`` is accelerate's ``DataLoaderDispatcher`` (``dispatch_batches=True``)."""
    module = sys.modules.get("accelerate.data_loader")
    dispatcher = getattr(module, "DataLoaderDispatcher", None)
    return isinstance(dispatcher, type) and isinstance(dataloader, dispatcher)


def is_iterable_shard(dataset: Any) -> bool:
    """``dataset`` is accelerate's ``IterableDatasetShard`` (a prepared iterable dataset)."""
    module = sys.modules.get("accelerate.data_loader")
    shard = getattr(module, "IterableDatasetShard", None)
    return isinstance(shard, type) and isinstance(dataset, shard)


def skipped_batches(chain: list[Any]) -> int:
    """Batches accelerate's ``skip_first_batches`` drops from the chain (0: none)."""
    module = sys.modules.get("accelerate.data_loader")
    skipper = getattr(module, "SkipBatchSampler", None)
    if skipper is None:
        return 0
    return sum(int(sampler.skip_batches) for sampler in chain if isinstance(sampler, skipper))


def processes() -> int | None:
    """The processes accelerate's ``Accelerator`` trains on, or None (no Accelerator made yet)."""
    state = sys.modules.get("accelerate.state")
    if state is None or not state.is_initialized():
        return None
    return int(state.AcceleratorState().num_processes)


def check_processes(num_processes: int | None = None) -> None:
    """Refuse a run that accelerate trains as one process where ``torch.distributed`` has started several.

    Each process would then train every sample alone, and all of them would write the same
    checkpoints. Every rank sees the same, so every rank raises, before any step.

    Args:
        num_processes: what the accelerator (or the Trainer's) says; default: accelerate's state.

    Raises:
        RuntimeError: accelerate sees one process in a process group of several.
    """
    seen = processes() if num_processes is None else num_processes
    world = distributed.world_size() if distributed.is_initialized() else 1
    if seen != 1 or world == 1:
        return
    raise RuntimeError(
        f"num_processes should be torch.distributed's world size {world}, but accelerate got "
        f"num_processes=1: it started the process group of the {world} processes of this launch, yet "
        f"trains alone on each, so each would train every sample (DistributedType.NO). On a machine "
        f"without a GPU, accelerate uses several processes only when told to: set ACCELERATE_USE_CPU=1 "
        f"(ACCELERATE_USE_CPU=1 torchrun --nproc_per_node {world} train.py, or ACCELERATE_USE_CPU=1 "
        f"accelerate launch --multi_gpu --num_processes {world} train.py), or pass Accelerator(cpu=True) "
        f"or TrainingArguments(use_cpu=True); with GPUs, check that every process sees one"
    )
