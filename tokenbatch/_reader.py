"""Who reads the sampler: the DataLoader pass, found once per pass in the calling frames.

The sampler sees only the batches of indices a DataLoader asks for, and a
DataLoader asks ahead of training: worker processes ``prefetch_factor *
num_workers`` batches ahead, accelerate's ``DataLoaderShard`` one more (it
looks a batch ahead to know which one is the last). What the training loop
has received is counted by the DataLoader iterator itself (``_num_yielded``,
which torch and torchdata keep for their own checkpoints). So when a pass
starts, the sampler looks up the stack once, through the DataLoader machinery
only (frames of ``torch.utils.data``, ``torchdata`` and ``accelerate``; it
stops at the first other frame, so a user's frames are never read), and keeps
weak references to what it finds: a checkpoint taken mid-epoch by
``accelerator.save_state`` then records the steps the loop has received, not
the steps read ahead (:meth:`Reader.steps_taken`).

The same look refuses the set-ups that cannot work, with a message that says
what to do, where they would otherwise fail deep inside torch or accelerate,
or lose samples without a word.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from dataclasses import dataclass
from types import FrameType
from typing import Any

from torch.utils.data import BatchSampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

_MACHINERY = ("torch.utils.data", "torchdata", "accelerate")
_MAX_FRAMES = 24  # the deepest path (workers, accelerate's shard and skip) is about 12


@dataclass
class Reader:
    """The DataLoader iterator a pass feeds, and what stands between it and the training loop."""

    iterator: weakref.ref[Any]
    """torch's (or torchdata's) DataLoader iterator: ``_num_yielded`` batches given out."""
    shard: weakref.ref[Any] | None
    """accelerate's ``DataLoaderShard``, which holds one batch back until it has the next."""
    skipped: int
    """Batches accelerate's ``skip_first_batches`` drops before the loop sees them (trained before)."""
    own_state: bool = False
    """torchdata's ``StatefulDataLoader``: it checkpoints the sampler itself, asking ``state_dict()``
    for the steps handed out, and accounts for what it read ahead on its own."""
    fast_forward: int = 0
    """Batches a ``StatefulDataLoader`` skips to resume its own state, where the sampler is wrapped
    (in accelerate's ``BatchSamplerShard``) and cannot be asked to resume itself."""
    start: int = 0
    """The step the pass started at (set by :meth:`begin`, with the plan's ``generation``)."""
    generation: int = -1
    ahead: int = 0
    """Batches the iterator asks for ahead of those it gave out: ``prefetch_factor * num_workers``."""
    exhausted: bool = False
    """The plan ran out: the DataLoader now gives out what it read ahead, and asks for nothing more."""

    def begin(self, start: int, generation: int) -> None:
        """The pass starts at ``start`` of the plan ``generation``; the iterator is fully made by now."""
        self.start, self.generation = start, generation
        iterator = self.iterator()
        workers, factor = getattr(iterator, "_num_workers", 0), getattr(iterator, "_prefetch_factor", 0)
        self.ahead = workers * factor if isinstance(workers, int) and isinstance(factor, int) else 0

    def refuse_second_skip(self, epoch: int, start: int) -> None:
        """Refuse skipping batches on top of a sampler that resumes at ``start`` by itself (lost steps)."""
        if start and self.skipped:
            raise ValueError(
                f"skip_first_batches should not be used after the sampler's state was loaded: the "
                f"sampler already resumes epoch {epoch} at step {start}, the first step not yet "
                f"trained, and skipping {self.skipped} more batches would never train them. Iterate "
                f"the prepared DataLoader itself after accelerator.load_state (or load_state_dict)"
            )
        if start and self.fast_forward:
            raise ValueError(
                f"the sampler should not be registered for checkpointing with use_stateful_dataloader="
                f"True on several processes: the sampler's state resumes epoch {epoch} at step {start}, "
                f"and the DataLoader's own state skips {self.fast_forward} more batches, which would "
                f"never be trained. Leave register_for_checkpointing(sampler) out: the DataLoader's "
                f"state resumes the sampler"
            )

    def steps_taken(self, generation: int, handed_out: int) -> int | None:
        """The step the training loop has got to (every batch it received counts), or None if unknown.

        ``handed_out``: the steps the sampler has yielded. None when the plan
        changed since the pass began (``generation``), or when the DataLoader
        iterator is gone after the plan ran out (the loop may have left
        anywhere in the batches read ahead).
        """
        if generation != self.generation or self.own_state:
            return None
        shard = None if self.shard is None else self.shard()
        # The shard fetches a batch before it gives out the one before: one held back, until its end.
        held = 0 if self.shard is None or getattr(shard, "end_of_dataloader", False) else 1
        yielded = getattr(self.iterator(), "_num_yielded", None)
        if type(yielded) is int:
            return self.start + self.skipped + yielded - min(held, yielded)
        if self.exhausted:
            return None
        # The iterator is gone (the loop was left): until the plan runs out, a DataLoader asks for one
        # batch for each it gives out, so it had asked for exactly `ahead` more than it gave.
        return max(self.start, handed_out - self.ahead - held)


def find(frame: FrameType | None, sampler: object) -> Reader | None:
    """The DataLoader pass that ``frame`` (the caller of ``sampler.__iter__``) belongs to, if any.

    Raises:
        TypeError: the sampler was passed as ``DataLoader(sampler=...)``.
        ValueError: accelerate's ``dispatch_batches=True``, which cannot deal out
            batches of different sizes.
    """
    accelerate = sys.modules.get("accelerate.data_loader")
    shard_type = getattr(accelerate, "DataLoaderShard", ())
    dispatcher_type = getattr(accelerate, "DataLoaderDispatcher", ())
    skip_type = getattr(accelerate, "SkipBatchSampler", ())
    iterator: Any = None
    skipped, seen = 0, set()
    for depth in range(_MAX_FRAMES):
        if frame is None or not frame.f_globals.get("__name__", "").startswith(_MACHINERY):
            break
        owner = frame.f_locals.get("self")
        frame = frame.f_back
        if owner is None or id(owner) in seen:
            continue
        seen.add(id(owner))
        if depth == 0 and isinstance(owner, BatchSampler) and getattr(owner, "sampler", None) is sampler:
            raise TypeError(
                "TokenBudgetBatchSampler yields whole batches: pass it as DataLoader(dataset, "
                "batch_sampler=sampler), not sampler= (which wraps it in torch's BatchSampler, "
                "and each 'index' it yields would be a list of indices)"
            )
        if isinstance(owner, dispatcher_type):
            raise ValueError(
                "dispatch_batches should be False for TokenBudgetBatchSampler, but got "
                "dispatch_batches=True: accelerate would concatenate the processes' batches, which have "
                "different sizes and lengths, and cut the result evenly. Leave it at its default for a "
                "map-style dataset (Accelerator(dataloader_config=DataLoaderConfiguration("
                "dispatch_batches=False))): the sampler plans one batch per process for each step"
            )
        if isinstance(owner, skip_type):
            skipped += int(getattr(owner, "skip_batches", 0))
        elif iterator is None and isinstance(owner, _BaseDataLoaderIter):
            iterator = owner
        elif isinstance(owner, shard_type):
            if iterator is None:
                break
            return _reader(iterator, owner, skipped, sampler)
    return None if iterator is None else _reader(iterator, None, skipped, sampler)


def _reader(iterator: Any, shard: Any, skipped: int, sampler: object) -> Reader:
    own_state = type(iterator).__module__.startswith("torchdata")
    # A StatefulDataLoader resumes a sampler it cannot ask (not its own index sampler) by skipping
    # the batches it had drawn: it has set that count already when the pass starts.
    wrapped = own_state and getattr(iterator, "_index_sampler", None) is not sampler
    forward = getattr(iterator, "_sampler_iter_yielded", 0) if wrapped else 0
    return Reader(
        weakref.ref(iterator), None if shard is None else weakref.ref(shard), skipped, own_state,
        forward if isinstance(forward, int) else 0,
    )  # fmt: skip


def refuse_split_batches(frame: FrameType | None) -> None:
    """Refuse accelerate's ``split_batches=True`` where ``prepare`` reads the sampler's ``batch_size``.

    accelerate's ``prepare_data_loader`` reads ``batch_sampler.batch_size``
    only to check that a fixed batch can be split evenly between the
    processes, and fails on None (the sampler's: there is no fixed batch size)
    with ``TypeError: '>' not supported between instances of 'NoneType' and
    'int'``. Say what to do instead, at the same place.
    """
    if (
        frame is not None
        and frame.f_code.co_name == "prepare_data_loader"
        and frame.f_globals.get("__name__", "").startswith("accelerate")
        and frame.f_locals.get("split_batches") is True
    ):
        raise ValueError(
            "split_batches should be False for TokenBudgetBatchSampler, but got split_batches=True: "
            "there is no fixed batch to split between the processes. Leave it at its default "
            "(Accelerator(dataloader_config=DataLoaderConfiguration(split_batches=False))): the "
            "sampler's global plan already gives each process its own batch of every step, within "
            "max_tokens"
        )


def unsharded_error(world: int) -> ValueError:
    """The error for the global plan read as it is by a DataLoader on each of ``world`` processes."""
    return ValueError(
        f"rank should be this process's rank when a DataLoader reads the sampler itself on {world} "
        f"processes (plain DDP), but got rank=None: the sampler then yields the global plan, every "
        f"rank's batches, and every rank would train every sample; pass "
        f"rank=torch.distributed.get_rank(), or let accelerator.prepare(dataloader) share the plan out"
    )


def read_by_a_dataloader(frame: FrameType | None) -> bool:
    """``frame`` is a torch DataLoader iterator's, asking for the next batch: nothing shares the plan out.

    accelerate's ``BatchSamplerShard``, which does, reads the sampler from its own frame.
    """
    return frame is not None and isinstance(frame.f_locals.get("self"), _BaseDataLoaderIter)


def warn_repeat(epoch: int) -> None:
    """A DataLoader goes over the epoch's whole plan again: set_epoch was forgotten."""
    warnings.warn(
        f"TokenBudgetBatchSampler: epoch {epoch} is iterated again in full, with the same "
        f"plan, and set_epoch was not called since: every epoch then trains the same batches in "
        f"the same order. Call sampler.set_epoch(epoch) before each epoch, as with "
        f"DistributedSampler (accelerate's DataLoader does not call it on several processes); a "
        f"sampler meant to repeat, for evaluation, can be built with shuffle=False",
        UserWarning,
        stacklevel=4,
    )
