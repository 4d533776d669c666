"""tokenbatch.testing: injected OOM errors are real ones, raised where real ones would be."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tokenbatch import CostModel, TokenBudgetBatchSampler, TokenBudgetStream, is_oom
from tokenbatch.testing import inject_oom


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(10, 4)
        self.head = torch.nn.Linear(4, 1)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.embed(input_ids)).mean()


def ids(rows: int, length: int) -> torch.Tensor:
    return torch.ones(rows, length, dtype=torch.long)


def test_forward_raises_a_real_oom_above_the_limit_only() -> None:
    model = Tiny()
    with inject_oom(model, max_tokens=12) as injector:
        model(ids(3, 4))  # 12 padded tokens: at the limit, fine
        with pytest.raises(torch.OutOfMemoryError, match="CUDA out of memory") as info:
            model(input_ids=ids(2, 7), attention_mask=ids(2, 7))
    assert is_oom(info.value) and "14 > max_tokens=12" in str(info.value)
    assert (injector.count, injector.calls, injector.costs) == (1, 2, [12.0, 14.0])
    model(ids(5, 5))  # hooks removed on leaving the block
    assert injector.calls == 2


def test_backward_raises_from_inside_autograd() -> None:
    model = Tiny()
    with inject_oom(model, max_tokens=4, where="backward") as injector:
        loss = model(ids(2, 3))  # forward passes
        assert injector.count == 0
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()
        # The head's gradient was computed before the embedding's, as in a real mid-backward failure.
        assert model.head.weight.grad is not None and model.embed.weight.grad is None
        with torch.no_grad():
            model(ids(4, 4))  # no backward coming: nothing armed
        model(ids(1, 3)).backward()  # under the limit
    assert injector.count == 1


def test_ranks_times_cost_and_cpu_kind() -> None:
    model = Tiny()
    with inject_oom(model, 1, ranks=[1]):  # this process is rank 0
        model(ids(4, 4))
    with inject_oom(model, 1, times=2) as injector:
        for _ in range(4):
            with contextlib.suppress(torch.OutOfMemoryError):
                model(ids(2, 2))
    assert (injector.count, injector.calls) == (2, 4)
    with inject_oom(model, 0, after=2, times=1) as injector:
        model(ids(2, 2))
        model(ids(2, 2))
        with pytest.raises(torch.OutOfMemoryError):
            model(ids(1, 1))  # the third call, however small
        model(ids(2, 2))
    assert (injector.count, injector.calls) == (1, 4)
    with inject_oom(model, 40, cost=CostModel.attention(crossover=4)) as injector:
        model(ids(4, 4))  # 16 tokens, cost 32
        with pytest.raises(RuntimeError, match="out of memory"):
            model(ids(4, 6))  # 24 tokens, cost 60
    with inject_oom(model, 1, kind="cpu"), pytest.raises(RuntimeError) as info:
        model(ids(2, 2))
    assert type(info.value) is RuntimeError and "DefaultCPUAllocator" in str(info.value)
    assert is_oom(info.value)


def test_cost_can_be_the_samplers_or_the_streams() -> None:
    """Issue 21.8: a rehearsal in the budget's own units, with the sampler (or stream) it guards."""
    attention = CostModel.attention(crossover=4)
    sampler = TokenBudgetBatchSampler([4, 6] * 8, 64, cost=attention)
    stream = TokenBudgetStream(lambda: iter([[1] * 4, [1] * 6]), 64, cost=attention)
    for source in (sampler, stream, attention):
        model = Tiny()
        with inject_oom(model, 40, cost=source) as injector:
            model(ids(4, 4))  # 16 tokens, cost 32
            with pytest.raises(torch.OutOfMemoryError, match="costs 60 > max_tokens=40"):
                model(ids(4, 6))  # 24 tokens, cost 60
        assert injector.costs == [32.0, 60.0]
    with inject_oom(model, 40) as injector:  # by default padded tokens, the default sampler's cost
        model(ids(4, 6))
    assert injector.costs == [24.0]
    with pytest.raises(TypeError, match=r"cost should be the TokenBudgetBatchSampler .* cost='attention'"):
        inject_oom(Tiny(), 1, cost="attention")  # type: ignore[arg-type]


def test_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="where should be one of 'forward', 'backward'"):
        inject_oom(Tiny(), 1, where="optimizer")
    with pytest.raises(ValueError, match="kind should be one of"):
        inject_oom(Tiny(), 1, kind="tpu")
    with pytest.raises(TypeError, match=r"torch\.nn\.Module"):
        inject_oom(lambda x: x, 1)  # type: ignore[arg-type]
