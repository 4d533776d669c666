"""FlakyAdam: a real Adam whose step raises a real torch.OutOfMemoryError on chosen calls and ranks.

Shared by tests/test_oom_optimizer.py and tests/scripts/oom_steps_ddp.py.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from typing import Any

import torch

from tokenbatch import _distributed as distributed


class FlakyAdam(torch.optim.Adam):
    """``torch.optim.Adam`` that runs out of memory in the ``fail``-th calls of ``step`` on ``ranks``.

    ``partial`` says what the failing call does first: ``"states"`` allocates
    half of the states, as Adam's first step does before it updates anything;
    ``"params"`` updates a parameter, as a step that fails half-way does;
    ``"value_error"`` raises a ValueError instead of running out of memory.
    """

    def __init__(
        self,
        params: Iterable[Any],
        *,
        fail: Collection[int] = (),
        partial: str = "states",
        ranks: Collection[int] | None = None,
        **options: Any,
    ) -> None:
        super().__init__(params, **options)
        self.fail, self.partial, self.ranks = set(fail), partial, ranks
        self.calls = 0

    def step(self, closure: Any = None) -> Any:
        self.calls += 1
        if self.calls in self.fail and (self.ranks is None or distributed.rank() in self.ranks):
            params = [p for group in self.param_groups for p in group["params"] if p.grad is not None]
            if self.partial == "value_error":
                raise ValueError(f"not an OOM: rank {distributed.rank()}, call {self.calls}")
            if self.partial == "states":
                for param in params[: len(params) // 2]:
                    self.state[param]["exp_avg"] = torch.zeros_like(param)
            elif self.partial == "params":
                with torch.no_grad():
                    params[0].add_(1.0)
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 2.00 GiB (injected in FlakyAdam.step, call "
                f"{self.calls}, rank {distributed.rank()})"
            )
        return super().step(closure)
