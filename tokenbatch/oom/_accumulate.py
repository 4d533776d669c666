"""Gradients accumulated before a guarded step: held aside while it runs, so that a failed step loses none.

With gradient accumulation (accelerate's ``accumulate()``, or several
``backward`` calls before ``optimizer.step()``) the parameters already hold
the gradients of the group's earlier batches when a step starts. Autograd
adds the step's gradients into them in place, so a step that fails half-way
through its backward pass would leave them mixed with a partial gradient that
cannot be taken out again.

The step therefore runs into fresh gradients: the earlier ones are moved
aside (references, not copies: no memory, no work) and added into the fresh
ones once the step has run on this rank. They are kept intact until every
rank has succeeded, so that a step dropped on every rank (halve mode) or
retried (split mode) only has to put the references back. The price, only
while earlier gradients exist, is one gradient-sized buffer more at the end of
the backward pass: the fresh gradients, allocated as the activations are freed.
Copying the earlier gradients before the step instead would cost the same
buffer for the whole forward pass, at its activation peak, and a copy on every
step that has earlier gradients. Zero gradients left by
``zero_grad(set_to_none=False)`` count as earlier ones (the default, None, costs nothing).
"""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType

import torch
from torch import nn


class KeptGradients:
    """The gradients of ``params`` before a step, put back unless :meth:`release` was called.

    Use it as a context manager around the step: on entry the parameters'
    gradients are moved aside (when there are any); :meth:`add_into_grads`,
    after this rank's passes succeed, adds them into the step's fresh
    gradients; :meth:`release` (every rank succeeded) lets them go;
    :meth:`restore` (the step is dropped) and leaving the block without a
    release (an error) drop the step's gradients and put the earlier ones back.

    Example:
        >>> import torch
        >>> weight = torch.nn.Parameter(torch.ones(2))
        >>> weight.grad = torch.full((2,), 10.0)  # from an earlier batch of the group
        >>> with KeptGradients([weight]) as kept:
        ...     (weight * 2).sum().backward()  # the step, into a fresh gradient
        ...     kept.add_into_grads()
        ...     kept.release()
        >>> weight.grad
        tensor([12., 12.])
        >>> with KeptGradients([weight]):
        ...     (weight * 3).sum().backward()  # a step that fails after this, or is dropped
        >>> weight.grad
        tensor([12., 12.])
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        grads = [p.grad for p in self.params]
        self._kept: list[torch.Tensor | None] | None = grads if any(g is not None for g in grads) else None

    def __enter__(self) -> KeptGradients:
        if self._kept is not None:
            for param in self.params:
                param.grad = None
        return self

    @property
    def earlier(self) -> list[torch.Tensor | None] | None:
        """The gradients held aside, per parameter (None: there were none); not to be changed."""
        return self._kept

    def add_into_grads(self) -> None:
        """This rank's step has run: the parameters' gradients become the step's plus the earlier ones.

        The earlier tensors stay unchanged (the sum goes into the fresh
        gradient), so :meth:`restore` can still put them back.
        """
        if self._kept is None:
            return
        with torch.no_grad():
            for param, kept in zip(self.params, self._kept, strict=True):
                if kept is None:
                    continue
                fresh = param.grad
                if fresh is None:  # not used by this step: the earlier gradient, as it is
                    param.grad = kept
                elif fresh.is_sparse and not kept.is_sparse:
                    param.grad = kept + fresh  # a sparse tensor cannot take a dense one in place
                else:
                    fresh.add_(kept)

    def drop_step(self) -> None:
        """Set the gradients to None: what a failed attempt left is partial (the earlier ones stay aside)."""
        for param in self.params:
            param.grad = None

    def restore(self) -> None:
        """Drop the step's gradients and put the earlier ones back."""
        if self._kept is None:
            self.drop_step()
            return
        for param, kept in zip(self.params, self._kept, strict=True):
            param.grad = kept
        self._kept = None

    def release(self) -> None:
        """Every rank's step succeeded: the parameters keep the sums, the earlier tensors go."""
        self._kept = None

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if self._kept is not None:
            self.restore()
