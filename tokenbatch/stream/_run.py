"""One pass of one :class:`~tokenbatch.TokenBudgetStream` reader over its part: read, batch, agree, resume.

An epoch of a reader has two phases::

    stream:  refill the buffer (when 1/16 of it is gone) -> (agree) -> draw one batch -> yield
    final:   pack what is left (plan_batches) -> agree on a count -> split -> yield them

With a packed cost (``CostModel(packing=...)``) the stream phase forms a
round of packs at a time, and the final round and the agreement are the same::

    stream:  refill the buffer (once the round before is yielded) -> (agree) -> pack all of it
             (plan_batches), the least full packs staying in it -> yield the packs, one a step
             (agreeing before each)

The packs of a round not yet yielded are :attr:`Run.formed`, saved in the
state like the final round's batches; an OOM re-budget puts them back into
the buffer, to be packed again under the new budget.

With several ranks each stream step asks the others two things at once
(one all-reduce of two numbers): has a rank whose part is read out run low
(below half a buffer), and is any part not read out yet. The final round
starts on every rank at the same step, when a rank runs low or every part
is read out; a rank whose part is not read out yet first reads up to one
more buffer of it. Its count of batches is agreed too: the most any rank needs,
but no more than the fewest examples a rank holds; a rank with fewer
batches halves its largest ones, so every rank yields the same number of
batches and everything read is trained. Only where a rank holds fewer
examples than another needs batches is anything left out, and then it is
counted and logged (as is the unread rest of a part longer than the
others'): never lost silently.

An agreement is the element-wise maximum of a short list of floats over all
ranks: ``agree([a, b]) -> [max a, max b]`` (a minimum is the maximum of the
negated values). By default (:func:`default_agreement`) it runs over
``torch.distributed``: on the default group when its backend reduces CPU
tensors (gloo), else on a gloo group made once for it, so that the agreement
never waits for the GPU (an NCCL all-reduce plus ``.tolist()`` would block
the host on every batch until the queued backward has finished). Where that
default cannot work (in a DataLoader worker; under an accelerate loader that
reads on process 0 only, or that deals one stream's items out between
processes), the pass is refused before it starts.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tokenbatch import _accelerate
from tokenbatch import _distributed as distributed
from tokenbatch.cost import CostModel
from tokenbatch.plan import OversizeSampleError
from tokenbatch.stream._buffer import Buffer, estimate_boundaries, split_to, tie_breaks
from tokenbatch.stream._source import Part, Reader, Snapshots

logger = logging.getLogger("tokenbatch.stream")

Agree = Callable[[list[float]], list[float]]


@dataclass(frozen=True)
class Settings:
    """What every reader of a stream shares."""

    cost: CostModel
    budget: float
    """The budget the stream was made with: what ``oversize`` judges an example by."""
    buffer_size: int
    oversize: str
    buckets: int | np.ndarray
    seed: int
    lengths: Callable[[list[Any], int], np.ndarray]


class Run:
    """One epoch of one reader; :meth:`batches` yields, :meth:`state` says where it is."""

    def __init__(
        self,
        settings: Settings,
        part: Part,
        reader: Reader,
        *,
        epoch: int,
        agree: Agree | None,
        resume: dict[str, Any] | None = None,
        budget: Callable[[], float] | None = None,
    ) -> None:
        self.settings, self.part, self.reader, self.epoch, self.agree = settings, part, reader, epoch, agree
        # The budget in force, read before each batch is formed: an OOM re-budget (the stream's
        # replan) changes it between batches, in this process or, through shared memory, a worker's.
        self.budget = budget if budget is not None else (lambda: settings.budget)
        seed, who = settings.seed, [reader.rank, reader.worker]
        self.local = np.random.default_rng([seed, epoch, *who, 1])
        # The same on every rank: ranks draw from the same bucket at the same step.
        self.shared = np.random.default_rng([seed, epoch, reader.worker, 2])
        self.salt = int(np.random.default_rng([seed, epoch, *who, 3]).integers(2**62))
        self.buffer = Buffer(self.budget(), np.empty(0, np.int64))
        self.snapshots = Snapshots()
        # Batches formed, not yet yielded, as slots: the final round's, or a packed stream's round of packs.
        self.formed: deque[np.ndarray] = deque()
        self.phase, self.read, self.exhausted = "start", 0, False
        self.yielded = self.skipped = self.left_out = 0
        self._iter: Iterator[Any] = iter(())
        if resume is not None:
            self._restore(resume)

    # -- reading -----------------------------------------------------------------

    def _fill(self) -> None:
        """Read until the buffer is full or the part is read out (skipped examples do not count)."""
        while not self.exhausted and len(self.buffer) < self.settings.buffer_size:
            self._read(self.settings.buffer_size - len(self.buffer))

    def _read(self, count: int) -> None:
        # In chunks of a quarter buffer (at least 4096 examples, so that a small buffer's refill stays one
        # merge): inserting a whole buffer at once (the first fill) would hold temporaries of a buffer's
        # size beside it. The order is the same (Buffer.add merges stably).
        start, step = self.read, max(4096, self.settings.buffer_size // 4)
        while count > 0 and not self.exhausted:
            chunk = list(itertools.islice(self._iter, min(count, step)))
            if len(chunk) < min(count, step):
                self.exhausted = True
            if chunk:
                first = self.read
                self.read += len(chunk)
                count -= len(chunk)
                self._insert(np.arange(first, self.read), chunk)
        if self.read > start and self.part.kind == "datasets":
            # Pruned as it goes, not only when a state is asked for: an epoch may never be checkpointed.
            # The oldest example held: in the buffer's order, or in a packed stream's round not yet
            # yielded (the final round reads on while that round waits).
            held = [self.buffer.positions(), *(self.buffer.position[slots] for slots in self.formed)]
            oldest = min((int(h.min()) for h in held if len(h)), default=self.read)
            self.snapshots.add(self.read, self.part.snapshot(), oldest=oldest)

    def _insert(self, positions: np.ndarray, chunk: list[Any]) -> None:
        # Judged by the budget the stream was made with: an example it admitted stays admitted after an
        # OOM re-budget (drawn alone if it is over the new one), as the map-style sampler keeps it.
        cost, budget = self.settings.cost, self.settings.budget
        lengths = self.settings.lengths(chunk, int(positions[0]))
        # Packs are ordered by the examples' own lengths: only a pack's row is rounded up.
        padded = np.asarray(lengths if cost.packing is not None else cost.padded_length(lengths), np.int64)
        unit = cost.sample_cost(padded)
        over = unit > budget
        if over.any() and self.settings.oversize != "alone":
            first = int(np.flatnonzero(over)[0])
            if self.settings.oversize == "error":
                raise OversizeSampleError(
                    f"the example at position {int(positions[first])} of rank {self.reader.rank}'s part "
                    f"(worker {self.reader.worker}; padded length {int(padded[first])}) costs "
                    f"{float(unit[first]):g} on its own, more than the budget max_tokens={budget:g}; "
                    f"raise max_tokens, truncate the sequences, or pass oversize='alone' (a batch of "
                    f"one) or oversize='skip'"
                )
            if not self.skipped:
                logger.warning(
                    "epoch %d: leaving out examples that alone exceed max_tokens=%g (oversize='skip'), the "
                    "first at position %d of rank %d's part (worker %d); the count is logged at the end",
                    self.epoch,
                    budget,
                    int(positions[first]),
                    self.reader.rank,
                    self.reader.worker,
                )
            self.skipped += int(over.sum())
            keep = ~over
            chunk = [example for example, kept in zip(chunk, keep.tolist(), strict=True) if kept]
            positions, padded, unit = positions[keep], padded[keep], unit[keep]
        self.buffer.add(positions, padded, unit, tie_breaks(positions, self.salt), chunk)

    # -- batching ----------------------------------------------------------------

    def batches(self) -> Iterator[list[Any]]:
        if self.phase == "start":
            self._iter = self.part.open(0)
            self._fill()
            buckets = self.settings.buckets
            if not isinstance(buckets, np.ndarray):
                buckets = estimate_boundaries(self.buffer.padded(), self.buffer.unit, buckets)
            self.buffer.set_boundaries(buckets)
            self.phase = "stream"
        # Refill in chunks of a sixteenth of the buffer, not after every batch: merging new
        # examples into the length order costs O(buffer_size) however few they are.
        refill = self.settings.buffer_size - max(1, self.settings.buffer_size // 16)
        packed = self.settings.cost.packing is not None
        while self.phase == "stream":
            # Packs are formed a round at a time from a full buffer, and the buffer is read again
            # only when that round is yielded: what it holds and the packs formed stay one buffer.
            if not self.formed if packed else len(self.buffer) <= refill:
                self._fill()
            if self._final_now():
                self._follow_budget()
                self._begin_final()
                break
            self._follow_budget()
            if packed:
                if not self.formed:
                    self._form_packs()
                batch = self.buffer.take_slots(self.formed.popleft())
            else:
                start, stop = self.buffer.draw(self.shared.random(), self.local.random())
                batch = self.buffer.take(start, stop)
            self.yielded += 1
            yield batch  # the state already excludes this batch: a checkpoint taken now resumes after it
        while self.formed:
            batch = self.buffer.take_slots(self.formed.popleft())
            self.yielded += 1
            yield batch
        if self.phase != "done":
            self.phase = "done"
            self._log_end()

    def _follow_budget(self) -> None:
        budget = self.budget()
        if budget != self.buffer.budget:  # what the buffer holds is drawn afresh under it
            self.buffer.set_budget(budget)
            if self.formed:  # so are the packs formed under the budget before: back into the buffer
                slots = np.concatenate(list(self.formed))
                self.formed.clear()
                positions = self.buffer.position[slots]
                order = np.argsort(positions, kind="stable")  # in the order read, as a resume inserts them
                examples = self.buffer.take_slots(slots[order])
                self._insert(positions[order], examples)

    def _form_packs(self) -> None:
        """A round of packs from the buffer; the least full packs' examples wait for the next round."""
        keep = self.settings.buffer_size // 4
        self.formed.extend(self.buffer.form_packs(self.local, self.settings.cost, keep))

    def _held(self) -> int:
        return len(self.buffer) + sum(len(slots) for slots in self.formed)

    def _final_now(self) -> bool:
        if self.agree is None:
            return self.exhausted
        low = self.exhausted and self._held() < self.settings.buffer_size / 2
        anyone_low, anyone_reading = self.agree([float(low), 0.0 if self.exhausted else 1.0])
        return anyone_low > 0 or anyone_reading == 0

    def _begin_final(self) -> None:
        rng = np.random.default_rng([self.settings.seed, self.epoch, self.reader.rank, self.reader.worker, 4])
        if not self.exhausted:
            # Parts of equal size (+-1 example) end within a few batches of each other: read what is
            # left of this one into the final round, up to one more buffer (memory stays bounded).
            self._read(self.settings.buffer_size)
        held = self._held()
        # A packed stream's round of packs formed before comes first, as it would have.
        plan = [*self.formed, *self.buffer.plan_rest(rng, self.settings.cost)]
        self.formed.clear()
        count = len(plan)
        if self.agree is not None:
            most, fewest_held = self.agree([float(len(plan)), -float(held)])
            count = int(min(most, -fewest_held))
        if count > len(plan):
            plan = split_to(plan, count)
        self.formed = deque(plan[:count])
        for slots in plan[count:]:
            self.buffer.release(slots)
            self.left_out += len(slots)
        if not self.exhausted:
            logger.warning(
                "epoch %d: rank %d (worker %d) stops reading its part after %d examples, as another rank's "
                "part is read out; the rest of this part (more than a buffer) is not read this epoch "
                "(the ranks' parts are uneven: give every rank the same number of examples or shards)",
                self.epoch,
                self.reader.rank,
                self.reader.worker,
                self.read,
            )
        self.phase = "final"

    def _log_end(self) -> None:
        if self.skipped:
            logger.warning(
                "epoch %d: left out %d example(s) of rank %d's part (worker %d) that alone exceed "
                "max_tokens=%g (oversize='skip')",
                self.epoch,
                self.skipped,
                self.reader.rank,
                self.reader.worker,
                self.settings.budget,
            )
        if self.left_out:
            logger.warning(
                "epoch %d: rank %d (worker %d) left out %d example(s) it had read, because another rank "
                "held too few examples for a final round of equal batch counts",
                self.epoch,
                self.reader.rank,
                self.reader.worker,
                self.left_out,
            )

    # -- checkpointing -----------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Where this reader is: a resume yields exactly the batches this pass would yield next."""
        pending = self.buffer.positions().tolist()
        final = [self.buffer.position[slots].tolist() for slots in self.formed]
        oldest = min(itertools.chain(pending, *final), default=self.read)
        source_position, source_state = self.snapshots.before(oldest)
        return {
            "phase": self.phase,
            "read": self.read,
            "exhausted": self.exhausted,
            "pending": pending,
            "final": final,
            "source_position": source_position,
            "source_state": source_state,
            "boundaries": self.buffer.boundaries.tolist(),
            "local_rng": self.local.bit_generator.state,
            "shared_rng": self.shared.bit_generator.state,
            "yielded": self.yielded,
            "skipped": self.skipped,
            "left_out": self.left_out,
        }

    def _restore(self, state: dict[str, Any]) -> None:
        self.phase, self.read, self.exhausted = state["phase"], int(state["read"]), bool(state["exhausted"])
        self.yielded, self.skipped = int(state["yielded"]), int(state["skipped"])
        self.left_out = int(state["left_out"])
        self.buffer.set_boundaries(np.asarray(state["boundaries"], np.int64))
        self.local.bit_generator.state = state["local_rng"]
        self.shared.bit_generator.state = state["shared_rng"]
        if self.phase in ("start", "done"):
            return
        pending = sorted(int(p) for p in state["pending"])
        final = [[int(p) for p in batch] for batch in state["final"]]
        found = self._reread(pending + [p for batch in final for p in batch], state)
        if pending:
            self._insert(np.asarray(pending, np.int64), [found[p] for p in pending])
        for batch in final:
            self.formed.append(self.buffer.hold(np.asarray(batch, np.int64), [found[p] for p in batch]))

    def _reread(self, wanted: list[int], state: dict[str, Any]) -> dict[int, Any]:
        """The examples at ``wanted``, with the part's iterator left at :attr:`read`."""
        source_position, source_state = int(state["source_position"]), state["source_state"]
        if self.part.kind == "sequence":
            if self.part.size() < self.read:
                raise self._ended(self.part.size())
            self._iter = self.part.open(self.read)
            return self.part.fetch(wanted)
        iterator = self.part.open(source_position, source_state)
        if self.part.kind == "datasets" and source_position:
            self.snapshots.add(source_position, source_state)
        keep, found = set(wanted), {}
        for position in range(source_position, self.read):
            try:
                example = next(iterator)
            except StopIteration:
                raise self._ended(position) from None
            if position in keep:
                found[position] = example
        self._iter = iterator
        return found

    def _ended(self, position: int) -> ValueError:
        return ValueError(
            f"cannot resume: rank {self.reader.rank}'s part (worker {self.reader.worker}) ended at "
            f"position {position}, but the state says {self.read} examples were read; resume "
            f"with the same examples in the same order"
        )


# -- the default agreement, over torch.distributed ----------------------------------

_CPU_GROUPS: dict[int, Any] = {}

_WORKERS_AND_RANKS = (
    "TokenBudgetStream with num_replicas={world} is being read in DataLoader worker {worker} of "
    "{workers}, where no process group reaches the other ranks, so the ranks cannot agree when to end "
    "the epoch (one rank would wait forever for another). Use num_workers=0 for the stream on several "
    "ranks (batching is cheap; tokenize in a datasets.map or the collate_fn), or pass agree= a function "
    "that agrees across the ranks' workers"
)
_ACCELERATE = (
    "TokenBudgetStream is being read through accelerate's {wrapper}, which {what}; that breaks its "
    "batches on several processes (and its agreement between ranks would wait forever). Build the "
    "DataLoader on every rank, DataLoader(stream, batch_size=None, collate_fn=...), and do not pass it "
    "to accelerator.prepare (prepare the model and optimizer; move each batch to accelerator.device); "
    "register the stream with accelerator.register_for_checkpointing(stream) to save its position"
)
_WRAPPERS = {
    "DataLoaderDispatcher": "reads on process 0 only and splits each batch between processes "
    "(dispatch_batches=True, the default for iterable datasets)",
    "IterableDatasetShard": "reads the whole stream on every process and keeps every num_processes-th item",
}


def default_agreement(reader: Reader, *, stream: object, in_worker: bool) -> Agree:
    """The agreement over ``torch.distributed`` for ``reader``, or an error where it cannot reach the ranks.

    Raises:
        RuntimeError: the stream is read through an accelerate loader that breaks its batches, or
            in a DataLoader worker (no process group there), or no process group is initialised.
        ValueError: the process group's world size is not ``reader.num_replicas``.
    """
    refusal = _accelerate_refusal(stream)
    if refusal is not None:
        raise RuntimeError(refusal)
    _accelerate.check_processes()  # an Accelerator training alone on each of these ranks
    if in_worker:
        raise RuntimeError(
            _WORKERS_AND_RANKS.format(
                world=reader.num_replicas, worker=reader.worker, workers=reader.num_workers
            )
        )
    return _process_group(reader.num_replicas)


def _accelerate_refusal(stream: object) -> str | None:
    """The refusal message if the DataLoader accelerate is iterating reads ``stream`` wrongly, else None.

    accelerate registers the DataLoader it is iterating in its public
    ``GradientState().active_dataloader``: its ``DataLoaderShard`` and
    ``DataLoaderDispatcher`` call ``begin()`` before iterating the DataLoader
    underneath, so before this pass starts. Refused: a ``DataLoaderDispatcher``
    whose dataset is ``stream``, and a loader whose dataset is an
    ``IterableDatasetShard`` of ``stream``. A stream read through a plain
    DataLoader (the recipe on several ranks) is not, even inside another of
    accelerate's loops.
    """
    active = _accelerate.active_dataloader()
    if active is None:  # accelerate not imported, or none of its DataLoaders is being iterated
        return None
    dataset = getattr(active, "dataset", None)  # DataLoader.dataset, which accelerate's loaders pass on
    if _accelerate.is_dispatcher(active) and dataset is stream:
        wrapper = "DataLoaderDispatcher"
    elif _accelerate.is_iterable_shard(dataset) and getattr(dataset, "dataset", None) is stream:
        wrapper = "IterableDatasetShard"
    else:
        return None
    return _ACCELERATE.format(wrapper=wrapper, what=_WRAPPERS[wrapper])


def _process_group(num_replicas: int) -> Agree:
    """The default agreement over ``torch.distributed``, after checking it spans ``num_replicas`` ranks."""
    if not distributed.is_initialized():
        raise RuntimeError(
            f"TokenBudgetStream with num_replicas={num_replicas} needs the ranks to agree when to end an "
            f"epoch, but no torch.distributed process group is initialised; initialise it (torchrun, "
            f"accelerate launch, or Accelerator()) before iterating, or pass agree="
        )
    if dist.get_world_size() != num_replicas:
        raise ValueError(
            f"num_replicas should be the process group's world size {dist.get_world_size()}, but got "
            f"num_replicas={num_replicas}; leave it None, or pass agree= to agree among other ranks"
        )
    group = _cpu_group()

    def agree(values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
        result: list[float] = tensor.tolist()
        return result

    return agree


def _cpu_group() -> Any:
    """The group to agree on with CPU tensors: the default one under gloo, else a gloo group made once."""
    if "gloo" in str(dist.get_backend()):
        return None
    key = id(dist.group.WORLD)
    if key not in _CPU_GROUPS:  # new_group is collective: every rank reaches its first agreement together
        _CPU_GROUPS[key] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[key]
