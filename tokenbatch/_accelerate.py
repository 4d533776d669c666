"""What tokenbatch reads of accelerate's public state: the prepared DataLoader being iterated now.

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
