"""How a step went on each rank, how the ranks learn it from each other, and what they conclude.

Every attempt of a guarded step ends with one small all-reduce: each rank
writes its :class:`Outcome` into its own slot of a float64 tensor of zeros,
the ranks sum it, and so every rank holds every rank's outcome. From those
outcomes every rank derives the same next :class:`~tokenbatch.oom.OOMEvent`
(:func:`next_event`, pure) or raises the same way (:func:`raise_on_every_rank`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tokenbatch import distributed
from tokenbatch.oom._events import OOMEvent, RankFailedError, SampleTooLargeError

Status = Literal["ok", "oom", "error"]
Phase = Literal["", "forward", "backward"]
STATUSES: tuple[Status, ...] = ("ok", "oom", "error")
PHASES: tuple[Phase, ...] = ("", "forward", "backward")


@dataclass(frozen=True)
class Outcome:
    """How one rank's attempt at a step went.

    For ``"oom"``, ``cost``, ``longest`` and ``rows`` describe what failed:
    the whole batch, or the micro-batch that ran out of memory.
    """

    status: Status = "ok"
    phase: Phase = ""
    """Where it stopped: ``"forward"`` (splitting counts as forward) or ``"backward"``."""
    cost: float = 0.0
    longest: int = 0
    rows: int = 0

    def floats(self) -> list[float]:
        """The outcome as the floats of its slot in the all-reduce."""
        return [
            float(STATUSES.index(self.status)),
            float(PHASES.index(self.phase)),
            float(self.cost),
            float(self.longest),
            float(self.rows),
        ]

    @classmethod
    def from_floats(cls, values: Sequence[float]) -> Outcome:
        status, phase, cost, longest, rows = values
        return cls(STATUSES[int(status)], PHASES[int(phase)], float(cost), int(longest), int(rows))


WIDTH = len(dataclasses.fields(Outcome))


def pack(outcome: Outcome, flags: Sequence[bool], *, rank: int, world: int) -> torch.Tensor:
    """This rank's contribution to the all-reduce: ``outcome`` in its own slot, then ``flags``.

    Summed over the ranks, the tensor holds every rank's outcome and, per
    flag, how many ranks set it.

    Example:
        >>> ok, failed = Outcome(), Outcome("oom", "backward", cost=900.0, longest=90, rows=10)
        >>> summed = pack(ok, [True, False], rank=0, world=2) + pack(failed, [False, False], rank=1, world=2)
        >>> unpack(summed, world=2) == ([ok, failed], [True, False])
        True
    """
    tensor = torch.zeros(world * WIDTH + len(flags), dtype=torch.float64)
    tensor[rank * WIDTH : (rank + 1) * WIDTH] = torch.tensor(outcome.floats(), dtype=torch.float64)
    if len(flags):
        tensor[world * WIDTH :] = torch.tensor(list(flags), dtype=torch.float64)
    return tensor


def unpack(summed: torch.Tensor, world: int) -> tuple[list[Outcome], list[bool]]:
    """Every rank's outcome, in rank order, and per flag whether any rank set it."""
    values = summed.tolist()
    outcomes = [Outcome.from_floats(values[r * WIDTH : (r + 1) * WIDTH]) for r in range(world)]
    return outcomes, [v > 0 for v in values[world * WIDTH :]]


def share(outcome: Outcome, flags: Sequence[bool] = ()) -> tuple[list[Outcome], list[bool]]:
    """Every rank's outcome and, per position, whether any rank set ``flags``: one all-reduce.

    ``flags`` must have the same length on every rank.
    """
    if not distributed.is_initialized() or distributed.world_size() == 1:
        return [outcome], [bool(f) for f in flags]
    world = distributed.world_size()
    summed = distributed.all_reduce_sum(pack(outcome, flags, rank=distributed.rank(), world=world))
    return unpack(summed, world)


def next_event(
    outcomes: Sequence[Outcome],
    *,
    epoch: int,
    step: int,
    mode: str,
    max_tokens: float,
    factor: float,
    min_tokens: float | None,
    attempt: int,
) -> OOMEvent:
    """The event all ranks derive from the shared outcomes of a step in which some rank ran out of memory.

    The new budget is ``factor * min(max_tokens, cost of the costliest batch
    that failed)``, so a batch far under the budget that still fails is
    split at once, and never below ``min_tokens``.

    Raises:
        SampleTooLargeError: a rank ran out of memory on a single sample, or
            ``max_tokens`` is already at ``min_tokens``.

    Example:
        >>> outcomes = [Outcome(), Outcome("oom", "backward", cost=900.0, longest=90, rows=10)]
        >>> event = next_event(outcomes, epoch=0, step=3, mode="split", max_tokens=1024,
        ...                    factor=0.5, min_tokens=None, attempt=0)
        >>> event.new_max_tokens, event.ranks, event.where, event.longest
        (450.0, (1,), ('backward',), 90)
    """
    failing = {r: o for r, o in enumerate(outcomes) if o.status == "oom"}
    if not failing:
        raise ValueError("next_event needs at least one outcome with an out-of-memory status")
    longest = max(o.longest for o in failing.values())
    new = factor * min(max_tokens, max(o.cost for o in failing.values()))
    single = [r for r, o in failing.items() if o.rows == 1]
    if single:
        rank, length = single[0], failing[single[0]].longest
        raise SampleTooLargeError(
            f"a single sample of {length} tokens ran out of memory on its own (rank {rank}, epoch "
            f"{epoch}, step {step}, max_tokens={max_tokens:g}); nothing smaller is left to try: truncate "
            f"sequences below {length} tokens (the tokenizer's max_length), or free memory (a smaller "
            f"model or dtype, gradient checkpointing)",
            length=length,
            max_tokens=max_tokens,
            step=step,
            rank=rank,
        )
    if min_tokens is not None:
        if max_tokens <= min_tokens:
            raise SampleTooLargeError(
                f"out of memory at epoch {epoch}, step {step} on rank(s) {list(failing)} (longest sequence "
                f"{longest} tokens) with max_tokens={max_tokens:g} already at min_tokens={min_tokens:g}; "
                f"lower min_tokens, truncate sequences, or free memory",
                length=longest,
                max_tokens=max_tokens,
                step=step,
                rank=next(iter(failing)),
            )
        new = max(new, min_tokens)
    return OOMEvent(
        epoch=epoch,
        step=step,
        mode=mode,
        old_max_tokens=float(max_tokens),
        new_max_tokens=float(new),
        longest=longest,
        ranks=tuple(failing),
        where=tuple(o.phase for o in failing.values()),
        attempt=attempt,
    )


def raise_on_every_rank(outcomes: Sequence[Outcome], error: Exception | None, where: str) -> None:
    """Raise on every rank: the original error where it happened, :class:`RankFailedError` elsewhere.

    Every rank has seen an error status in the shared outcomes, so every
    rank comes here and the gather of error messages cannot be missed.
    """
    summary = None if error is None else f"{type(error).__name__}: {error}"
    summaries = distributed.all_gather_objects(summary)
    if error is not None:
        raise error
    rank = next(r for r, o in enumerate(outcomes) if o.status == "error")
    raise RankFailedError(
        f"rank {rank} raised {summaries[rank]} during {outcomes[rank].phase or 'its step'} "
        f"at {where}; this rank stops too rather than wait for it (see rank {rank}'s traceback)",
        rank=rank,
        error=str(summaries[rank]),
    )
