"""Guarded evaluation: ``fn(batch)`` without gradients on every rank, and micro-batches after out-of-memory.

Evaluation budgets are often larger than training ones, and an evaluation
that runs out of memory hours into a run kills it as surely as a training
step. :class:`EvalGuard` runs each evaluation batch as the training guard runs
a step: the attempt never raises on its own rank, one small all-reduce of
:class:`~tokenbatch.oom._outcome.Outcome` tells every rank how every rank's
attempt went, and when any rank ran out of memory, every rank shrinks the
evaluation budget to the same value and the ranks that failed run their batch
again as micro-batches under it (later batches over the budget are split at
once). A rank that succeeded keeps its result.

The micro-batches' results are put together as the whole batch's: tensors
with a row per sample are concatenated in the batch's row order, scalars (a
mean loss) are summed weighted by each micro-batch's share of the batch.
Micro-batches keep the batch's padded width, so every output has the shape
an unsplit run gives, and each row's values match it up to floating point.
A pack (a flattened batch) is cut into smaller packs of whole examples, and
per-token outputs (logits of shape ``(1, tokens, ...)``) are put back at
their tokens' places; a mean loss is weighted by labelled tokens.
The training budget is not touched.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from tokenbatch import _checks
from tokenbatch import _distributed as distributed
from tokenbatch._packs import PackedExamples
from tokenbatch.cost import CostModel
from tokenbatch.oom import _fsdp
from tokenbatch.oom._ddp import DDPSync
from tokenbatch.oom._errors import OOMEvent, SampleTooLargeError, free_memory, is_oom
from tokenbatch.oom._split import (
    BatchShape,
    Piece,
    Weight,
    check_weight,
    inspect_batch,
    piece_shares,
    plan_micro_batches,
    take_rows,
)
from tokenbatch.oom._step import Outcome, next_event, raise_on_every_rank, share

logger = logging.getLogger("tokenbatch.oom")

T = TypeVar("T")
_NOTHING: Any = object()  # no result yet (None is a valid one)


class EvalGuard:
    """Runs ``fn(batch)`` under ``torch.no_grad()``; on out-of-memory on any rank, in micro-batches.

    Call :meth:`evaluate` on every rank for every evaluation batch (ranks in
    step, as a prepared DataLoader keeps them). Under FSDP on several processes
    the forward pass holds collectives: out of memory (or another error) there
    ends the process of the rank it happened on, with status 1 and the error
    logged (see :mod:`tokenbatch.oom._fsdp`). ``fn`` must not communicate
    with other ranks: gather its results after :meth:`evaluate` returns
    (micro-batches make the number of ``fn`` calls differ between ranks).

    Args:
        model: optional; when it is DDP-wrapped, its buffers are broadcast
            once per batch, before anything can fail, instead of in each
            forward (where a rank that failed would never arrive).
        cost: how a batch is costed (default: padded tokens).
        factor: the budget multiplier per out-of-memory event, in (0, 1); the
            new evaluation budget is ``factor * min(budget, cost of the batch that failed)``.
        min_tokens: the floor; out-of-memory at it raises :class:`~tokenbatch.SampleTooLargeError`.
        weight: the micro-batches' shares, for scalar results: ``"samples"``,
            ``"tokens"`` (real tokens; a pack's labelled tokens), a function of a
            micro-batch returning its count, or None: ``"tokens"`` for a pack,
            ``"samples"`` otherwise (as for :class:`~tokenbatch.OOMFallback`).
        pad_token_id: read row lengths from ``input_ids`` when batches have no ``attention_mask``.

    ``max_tokens`` is the evaluation budget (None until the first
    out-of-memory error: batches run whole), ``batches`` the batches evaluated
    (set it to 0 when an evaluation starts) and ``events`` every event (its
    ``step`` is ``batches`` when the batch came; its ``epoch`` is 0).

    Example:
        >>> import torch
        >>> from tokenbatch.oom import EvalGuard
        >>> from tokenbatch.testing import inject_oom
        >>> model = torch.nn.Linear(4, 2)
        >>> guard = EvalGuard(model)
        >>> batch = torch.ones(8, 4)
        >>> with inject_oom(model, max_tokens=16):  # 8 rows x 4 columns "run out of memory"
        ...     logits = guard.evaluate(batch, model)
        >>> logits.shape, guard.max_tokens, len(guard.events)
        (torch.Size([8, 2]), 16.0, 1)
        >>> torch.allclose(logits, model(batch))
        True
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        *,
        cost: CostModel | None = None,
        factor: float = 0.5,
        min_tokens: float | None = None,
        weight: Weight = None,
        pad_token_id: int | None = None,
    ) -> None:
        if model is not None and not isinstance(model, nn.Module):
            raise TypeError(
                f"model should be a torch.nn.Module or None, but got model of type {type(model).__name__}"
            )
        if cost is not None and not isinstance(cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        self.cost = CostModel() if cost is None else cost
        self.factor = _checks.shrink_factor("factor", factor)
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
        self.weight, self.pad_token_id = check_weight(weight), pad_token_id
        self._ddp = None if model is None else DDPSync(model)
        self._lockstep = model is not None and _fsdp.in_lockstep(model)
        self.max_tokens: float | None = None
        self.events: list[OOMEvent] = []
        self.batches = 0
        self._rows: np.ndarray | None = None  # rows of the micro-batch last run (None: the whole batch)

    def evaluate(self, batch: Any, fn: Callable[[Any], T]) -> T:
        """``fn(batch)`` without gradients, split into micro-batches on out-of-memory (on any rank).

        Returns:
            ``fn(batch)``, or the micro-batches' results put together (see the module).

        Raises:
            SampleTooLargeError: one sample alone runs out of memory, or the budget is at ``min_tokens``.
            RankFailedError: another rank raised an error that is not out-of-memory.
        """
        step, self.batches = self.batches, self.batches + 1
        result, shape, attempt = _NOTHING, None, 0
        sync = self._ddp.step() if self._ddp is not None else contextlib.nullcontext()
        with sync, torch.no_grad():
            while True:
                outcome, error = Outcome(), None
                if result is _NOTHING:
                    outcome, error, result, shape = self._attempt(batch, fn, shape)
                    if outcome.status == "oom":
                        free_memory()
                    if self._lockstep and outcome.status != "ok":
                        # The other ranks wait inside FSDP's all-gathers: sharing the outcome would meet
                        # them in the wrong collective. This process ends, and their collectives with it.
                        _fsdp.end_on_error(
                            error
                            or RuntimeError(
                                "evaluation ran out of memory under FSDP on several processes: evaluate on "
                                "smaller batches (a smaller max_tokens for the evaluation sampler)"
                            ),
                            f"evaluation batch {step}",
                        )
                outcomes, _ = share(outcome)
                if any(o.status == "error" for o in outcomes):
                    raise_on_every_rank(outcomes, error, f"evaluation batch {step}")
                failed = [o.cost for o in outcomes if o.status == "oom"]
                if not failed:
                    return result  # type: ignore[no-any-return]
                try:
                    event = next_event(
                        outcomes,
                        epoch=0,
                        step=step,
                        mode="split",
                        max_tokens=self.max_tokens if self.max_tokens is not None else max(failed),
                        factor=self.factor,
                        min_tokens=self.min_tokens,
                        attempt=attempt,
                    )
                except SampleTooLargeError as too_large:
                    raise SampleTooLargeError(
                        f"evaluation batch {step}: {too_large}",
                        length=too_large.length,
                        max_tokens=too_large.max_tokens,
                        step=step,
                        rank=too_large.rank,
                    ) from None
                self.events.append(event)
                if distributed.rank() == 0:
                    logger.warning("evaluation: %s", event)
                self.max_tokens = event.new_max_tokens
                attempt += 1

    def _attempt(
        self, batch: Any, fn: Callable[[Any], Any], shape: BatchShape | None
    ) -> tuple[Outcome, Exception | None, Any, BatchShape | None]:
        """One try on this rank, never raising: (outcome, error if not out-of-memory, result, shape)."""
        self._rows = None
        try:
            pieces = None
            if self.max_tokens is not None:
                shape = shape or inspect_batch(batch, self.pad_token_id)
                if _as_run(shape).cost(self.cost) > self.max_tokens:
                    pieces = self._pieces(batch, shape, self.max_tokens)
            return Outcome(), None, self._run(batch, pieces, fn, shape), shape
        except Exception as exc:
            if not is_oom(exc):
                return Outcome("error", "forward"), exc, _NOTHING, shape
            logger.debug("rank %d: %s", distributed.rank(), str(exc).splitlines()[0])
        # Out of the except block the traceback, and the activations its frames hold, are gone.
        try:
            shape = shape or inspect_batch(batch, self.pad_token_id)
            rows = np.arange(shape.size) if self._rows is None else self._rows
            longest = int(shape.lengths[rows].max())
            cost = _as_run(shape).cost(self.cost, rows)
            failed = Outcome("oom", "forward", cost=cost, longest=longest, rows=len(rows))
            return failed, None, _NOTHING, shape
        except Exception as unreadable:  # a batch we cannot read: report it rather than guess
            return Outcome("error", "forward"), unreadable, _NOTHING, shape

    def _pieces(self, batch: Any, shape: BatchShape, budget: float) -> list[Piece]:
        """Micro-batches of rows costed at the batch's padded width (a pack's: smaller packs), with shares."""
        groups = plan_micro_batches(_as_run(shape), self.cost, budget)
        parts = [take_rows(batch, shape, rows, None) for rows in groups]
        try:
            shares = piece_shares(shape, self.weight, parts, groups)
        except ValueError:  # nothing to weight by (no labelled item anywhere): by rows
            shares = piece_shares(shape, "samples", parts, groups)
        return [(part, s, rows) for part, s, rows in zip(parts, shares, groups, strict=True)]

    def _run(
        self, batch: Any, pieces: Sequence[Piece] | None, fn: Callable[[Any], Any], shape: BatchShape | None
    ) -> Any:
        if pieces is None:
            if self._ddp is not None:
                self._ddp.before_forward()
            return fn(batch)
        results = []
        for part, _, rows in pieces:
            self._rows = rows
            if self._ddp is not None:
                self._ddp.before_forward()
            results.append(fn(part))
        self._rows = None  # what fails from here on (putting results together) is not a micro-batch's
        packed = None if shape is None else shape.packed
        return combine(results, [s for _, s, _ in pieces], [rows for _, _, rows in pieces], packed=packed)


def _as_run(shape: BatchShape) -> BatchShape:
    """``shape`` as evaluation runs it: micro-batches keep the padded width (a pack's examples their own)."""
    if shape.packed is not None:
        return shape
    return dataclasses.replace(shape, lengths=np.full(shape.size, shape.width, np.int64))


def combine(
    results: Sequence[Any],
    shares: Sequence[float],
    rows: Sequence[np.ndarray],
    *,
    packed: PackedExamples | None = None,
) -> Any:
    """The results of micro-batches ``rows`` put together as the whole batch's result.

    Tensors and arrays with a row per sample are concatenated in row order;
    scalars are summed weighted by ``shares``; containers are combined item by item.
    Of a pack (``packed``; ``rows`` are its examples), tensors with a value per
    token, of shape ``(1, tokens of the micro-batch, ...)``, go back to their
    tokens' places in the pack's ``(rows, width, ...)``.

    Example:
        >>> parts = [torch.tensor([[1.0], [2.0]]), torch.tensor([[3.0]])]
        >>> combine([(parts[0], 0.5), (parts[1], 2.0)], [2 / 3, 1 / 3], [np.array([0, 1]), np.array([2])])
        (tensor([[1.],
                [2.],
                [3.]]), 1.0)
    """
    first = results[0]
    order = np.concatenate(list(rows))
    if first is None:
        return None
    if isinstance(first, torch.Tensor | np.ndarray) and first.ndim > 0:
        if packed is not None:
            places = [packed.positions(part) for part in rows]
            per_token = all(
                isinstance(result, type(first))
                and result.ndim >= 2
                and tuple(result.shape[:2]) == (1, len(place))
                and result.shape[2:] == first.shape[2:]
                for result, place in zip(results, places, strict=True)
            )
            if per_token:
                return _place_tokens(results, places, packed)
        for result, part in zip(results, rows, strict=True):
            if not isinstance(result, type(first)) or result.ndim == 0 or result.shape[0] != len(part):
                raise TypeError(
                    f"fn should return tensors with one row per sample (or scalars), but it returned "
                    f"{type(result).__name__} of shape {tuple(getattr(result, 'shape', ()))} for a "
                    f"micro-batch of {len(part)} rows"
                )
        if isinstance(first, torch.Tensor):
            joined: Any = torch.cat(list(results))
            inverse: Any = torch.as_tensor(np.argsort(order), device=joined.device)
        else:
            joined, inverse = np.concatenate(list(results)), np.argsort(order)
        return joined if np.array_equal(order, np.arange(len(order))) else joined[inverse]
    if isinstance(first, torch.Tensor | np.ndarray | float | int) and not isinstance(first, bool):
        terms = [result * s for result, s in zip(results, shares, strict=True) if s != 0]
        return sum(terms[1:], terms[0])
    if isinstance(first, Mapping):
        data = {key: combine([r[key] for r in results], shares, rows, packed=packed) for key in first}
        kind: Any = type(first)
        if dataclasses.is_dataclass(type(first)):  # transformers' ModelOutput
            return kind(**data)
        try:
            return kind(data)
        except TypeError:
            return data
    if isinstance(first, tuple | list):
        items = [combine([r[i] for r in results], shares, rows, packed=packed) for i in range(len(first))]
        if isinstance(first, tuple) and type(first) is not tuple:  # a named tuple
            return type(first)(*items)
        return type(first)(items)
    if all(result == first for result in results[1:]):
        return first
    raise TypeError(
        f"cannot put together the micro-batches' results of type {type(first).__name__}: fn should "
        f"return tensors with one row per sample, scalars, or containers of them"
    )


def _place_tokens(results: Sequence[Any], places: Sequence[np.ndarray], packed: PackedExamples) -> Any:
    """Per-token results of smaller packs, each ``(1, its tokens, ...)``, at their places in the pack."""
    first = results[0]
    rest = tuple(first.shape[2:])
    where = np.concatenate(list(places))
    size = (packed.rows * packed.width, *rest)
    if isinstance(first, torch.Tensor):
        tokens = torch.cat([result[0] for result in results])
        placed = tokens.new_zeros(size)
        placed[torch.as_tensor(where, device=tokens.device)] = tokens
        return placed.reshape(packed.rows, packed.width, *rest)
    values = np.concatenate([result[0] for result in results])
    out: np.ndarray = np.zeros(size, dtype=values.dtype)
    out[where] = values
    return out.reshape(packed.rows, packed.width, *rest)
