"""``optimizer.step()`` guarded like the passes: every rank learns how every rank's step went, none hangs.

The first step of Adam-like optimizers allocates their states (twice the
parameters' size) and later steps allocate temporaries, so the optimizer step
runs out of memory too. :func:`guarded_step` runs it on every rank and shares
the outcomes in one small all-reduce (:mod:`tokenbatch.oom._outcome`). A rank
that ran out of memory frees memory and tries once more, but only when the
failed step provably changed nothing that a second try would apply twice;
otherwise, or when the retry fails as well, every rank raises
:class:`~tokenbatch.oom.OptimizerOOMError` naming the optimizer and the
allocation that failed.

Whether a failed step changed anything is read from tensor version counters,
which in-place updates bump: no copy of parameters or states is made (a copy
would cost the very memory that ran out). Optimizer states the failed step
created are discarded, so the optimizer is as before the step. This holds for
the optimizers of ``torch.optim`` without ``fused=True``; fused kernels and
other libraries' optimizers (bitsandbytes, ``.data`` updates) may change
tensors without bumping their counters, so their failed steps are never
retried. Parameters a failed step had already updated are not rolled back.
"""

from __future__ import annotations

import logging
from typing import Any, cast

import torch

from tokenbatch import _distributed as distributed
from tokenbatch.oom._errors import OptimizerOOMError, free_memory, is_oom
from tokenbatch.oom._step import Outcome, raise_on_every_rank, share

logger = logging.getLogger("tokenbatch.oom")

_MESSAGE_CHARS = 600  # of each rank's out-of-memory message in the error


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer under accelerate's ``AcceleratedOptimizer`` (or ``optimizer`` itself)."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def shows_its_changes(optimizer: Any) -> bool:
    """True when the step's in-place updates show in version counters: ``torch.optim``, not fused."""
    bases = [b for b in type(optimizer).__mro__ if b is not torch.optim.Optimizer]
    from_torch = any(base.__module__.startswith("torch.optim") for base in bases)
    return from_torch and not any(group.get("fused") for group in optimizer.param_groups)


def _tensors(state: Any) -> list[torch.Tensor]:
    return [value for value in state.values() if isinstance(value, torch.Tensor)]


def _params_version(optimizer: Any) -> int:
    return sum(p._version for group in optimizer.param_groups for p in group["params"])


class StepRecord:
    """What an optimizer step can change, as it was before the step: version counters, not copies.

    Every in-place update bumps its tensor's version counter (torch.optim's
    for-loop updates through the dispatcher, its CUDA foreach kernels
    explicitly) and counters only grow, so a sum tells whether any changed.
    Taken before every step: well under a microsecond per tensor, no collective.
    """

    def __init__(self, optimizer: Any) -> None:
        self.optimizer = optimizer
        self.verifiable = shows_its_changes(optimizer)
        self.params_version = _params_version(optimizer)
        # Each state held before the step: the dict itself, its tensors and the sum of their counters.
        self.old = [(p, state, _tensors(state)) for p, state in optimizer.state.items() if state]
        self.old_version = sum(t._version for _, _, tensors in self.old for t in tensors)

    def changed(self) -> str | None:
        """Why a retry could apply part of the failed step twice, or None if it changed nothing.

        Creating new states does not count: :meth:`discard_new_states` drops them.
        """
        if not self.verifiable:
            return "a fused or non-torch.optim update cannot be checked, nor rolled back"
        begun = "its update had begun; what it updated is not rolled back"
        if _params_version(self.optimizer) != self.params_version:
            return begun
        if sum(t._version for _, _, tensors in self.old for t in tensors) != self.old_version:
            return begun
        state = self.optimizer.state
        for param, held, tensors in self.old:  # the same dicts, holding the same tensors
            now = _tensors(held)
            if state.get(param) is not held or len(now) != len(tensors):
                return begun
            if any(a is not b for a, b in zip(now, tensors, strict=True)):
                return begun
        old = {id(param) for param, _, _ in self.old}
        for param, created in state.items():  # created by this step: untouched since, or the update began
            if id(param) not in old and any(t._version > 0 for t in _tensors(created)):
                return begun
        return None

    def discard_new_states(self) -> None:
        """Drop the states the failed step created, so that the optimizer is as before it."""
        old = {id(param) for param, _, _ in self.old}
        state = self.optimizer.state
        for param in [p for p in state if id(p) not in old]:
            del state[param]


def _try(optimizer: Any) -> tuple[Outcome, Exception | None]:
    try:
        optimizer.step()
    except Exception as exc:
        return Outcome("oom" if is_oom(exc) else "error"), exc
    return Outcome(), None


def guarded_step(optimizer: Any, *, where: str) -> None:
    """``optimizer.step()`` on every rank together; out of memory: free and retry once if safe, else raise.

    Call it on every rank. ``where`` says when, for the messages (``"epoch 0, step 3"``).

    Raises:
        OptimizerOOMError: on every rank, when a rank ran out of memory and
            could not retry, or ran out again.
        RankFailedError: on the other ranks, when one rank's step raised an
            error that is not out-of-memory (that rank re-raises its own).
    """
    name = type(inner_optimizer(optimizer)).__name__
    record = StepRecord(inner_optimizer(optimizer))
    outcome, error = _try(optimizer)
    for attempt in (0, 1):
        changed = record.changed() if outcome.status == "oom" else None
        if outcome.status == "oom" and changed is None:
            record.discard_new_states()
        outcomes, (any_changed,) = share(outcome, [changed is not None])
        if any(o.status == "error" for o in outcomes):
            raise_on_every_rank(outcomes, error, f"{name}.step() at {where}")
        failed = [r for r, o in enumerate(outcomes) if o.status == "oom"]
        if not failed:
            return
        if attempt == 1 or any_changed:
            _raise_on_every_rank(name, where, failed, error, changed=changed, retried=attempt == 1)
        if distributed.rank() == 0:
            logger.warning(
                "%s.step() ran out of memory on rank(s) %s at %s; freeing memory and trying once more",
                name,
                failed,
                where,
            )
        if outcome.status == "oom":  # only the ranks that failed step again
            # The error's traceback holds the failed step's temporaries: let it go before freeing.
            outcome, error = Outcome(), None
            free_memory()
            record = StepRecord(inner_optimizer(optimizer))
            outcome, error = _try(optimizer)


def _raise_on_every_rank(
    name: str, where: str, failed: list[int], error: Exception | None, *, changed: str | None, retried: bool
) -> None:
    """Every rank raises :class:`OptimizerOOMError` with every failed rank's message (one gather)."""
    left = changed or "its optimizer is as before the step"
    own = None if error is None else (str(error)[:_MESSAGE_CHARS], left)
    gathered = cast("list[tuple[str, str] | None]", distributed.all_gather_objects(own))
    details = "; ".join("rank {}: {} ({})".format(r, *(gathered[r] or ("?", "?"))) for r in failed)
    if retried:
        tried = "again after freeing memory and trying once more"
    else:
        tried = "and was not retried, as a retry could apply part of the step twice"
    done = [r for r in range(len(gathered)) if r not in failed]
    replicas = f" Rank(s) {done} completed the step, so the replicas now differ." if done else ""
    raised = OptimizerOOMError(
        f"{name}.step() ran out of memory on rank(s) {failed} at {where}, {tried}; {details}.{replicas} "
        f"Make room for the optimizer's states and temporaries (Adam keeps two per parameter; foreach=False "
        f"allocates fewer temporaries; a smaller model or dtype) and resume from a checkpoint",
        optimizer=name,
        ranks=tuple(failed),
        retried=retried,
    )
    if error is not None:
        raise raised from error
    raise raised
