"""``fallback.step(optimizer)`` on one process: a real OutOfMemoryError raised inside optimizer.step().

The 2-process runs are in tests/test_oom_steps_distributed.py.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent / "scripts"))

from flaky_optimizer import FlakyAdam
from oom_common import collate, flat_params, loss_fn, make_rows, quiet, tiny_bert

from tokenbatch import OOMFallback, TokenBudgetBatchSampler, is_oom
from tokenbatch.oom import OptimizerOOMError

quiet()
ROWS = make_rows(64)
LENGTHS = [len(r["input_ids"]) for r in ROWS]


def train(optimizer_class: type[torch.optim.Optimizer] = torch.optim.Adam, **options: Any) -> dict[str, Any]:
    """One epoch (5 steps) with ``fallback.step(optimizer)``; ``options`` go to the optimizer."""
    model = tiny_bert(0)
    optimizer = optimizer_class(model.parameters(), lr=1e-3, **options)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=0)
    fallback = OOMFallback(sampler, model)
    result: dict[str, Any] = {"optimizer": optimizer, "error": None}
    for batch in fallback.iterate(DataLoader(ROWS, batch_sampler=sampler, collate_fn=collate)):
        fallback.backward(batch, loss_fn(model))
        result["before"] = flat_params(model)
        try:
            fallback.step(optimizer)
        except OptimizerOOMError as error:
            result["error"] = error
            break
        optimizer.zero_grad()
    result["params"] = flat_params(model)
    return result


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    return train()["params"]


def test_an_oom_that_changed_nothing_is_retried_once(
    reference: torch.Tensor, caplog: pytest.LogCaptureFixture
) -> None:
    # The first step's states half allocated, then out of memory: the retry starts them afresh.
    with caplog.at_level(logging.WARNING, logger="tokenbatch.oom"):
        run = train(FlakyAdam, fail={1}, partial="states")
    assert run["error"] is None and run["optimizer"].calls == 5 + 1
    assert torch.equal(run["params"], reference)
    assert "FlakyAdam.step() ran out of memory on rank(s) [0] at epoch 0, step 0" in caplog.text


def test_an_oom_again_after_the_retry_raises_a_named_error() -> None:
    run = train(FlakyAdam, fail={1, 2}, partial="states")
    error = run["error"]
    assert isinstance(error, OptimizerOOMError) and run["optimizer"].calls == 2
    assert (error.optimizer, error.ranks, error.retried) == ("FlakyAdam", (0,), True)
    message = str(error)
    assert message.startswith("FlakyAdam.step() ran out of memory on rank(s) [0] at epoch 0, step 0")
    assert "Tried to allocate 2.00 GiB" in message and "its optimizer is as before the step" in message
    assert torch.equal(run["params"], run["before"]) and not run["optimizer"].state  # half-made states gone
    assert is_oom(error.__cause__) and not is_oom(error)  # a final verdict, like SampleTooLargeError


@pytest.mark.parametrize(
    ("options", "reason"),
    [
        ({"partial": "params"}, "its update had begun; what it updated is not rolled back"),
        ({"partial": "states", "fused": True}, "a fused or non-torch.optim update cannot be checked"),
    ],
)
def test_a_step_that_may_have_changed_something_is_not_retried(options: dict[str, Any], reason: str) -> None:
    run = train(FlakyAdam, fail={1}, **options)
    error = run["error"]
    assert isinstance(error, OptimizerOOMError) and run["optimizer"].calls == 1 and not error.retried
    assert "was not retried" in str(error) and reason in str(error)


def test_other_errors_in_the_step_pass_through_unchanged() -> None:
    model = tiny_bert(0)
    optimizer = FlakyAdam(model.parameters(), fail={1}, partial="value_error")
    fallback = OOMFallback(TokenBudgetBatchSampler(LENGTHS, 256, seed=0), model)
    with pytest.raises(ValueError, match="not an OOM") as info:
        fallback.step(optimizer)
    assert optimizer.calls == 1 and not isinstance(info.value, OptimizerOOMError)


def _mutate(optimizer: torch.optim.Optimizer, how: str) -> None:
    first, second = optimizer.param_groups[0]["params"]
    with torch.no_grad():
        if how == "new_state":  # what Adam's first step allocates, before it updates anything
            optimizer.state[second]["exp_avg"] = torch.zeros_like(second)
        elif how == "new_state_updated":
            optimizer.state[second]["exp_avg"] = torch.zeros_like(second).add_(1.0)
        elif how == "old_state_updated":
            optimizer.state[first]["exp_avg"].mul_(0.9)
        elif how == "old_state_replaced":
            optimizer.state[first]["exp_avg"] = torch.zeros_like(first)
        elif how == "param_updated":
            second.add_(1.0)


@pytest.mark.parametrize(
    ("how", "retryable"),
    [
        ("nothing", True),
        ("new_state", True),
        ("new_state_updated", False),
        ("old_state_updated", False),
        ("old_state_replaced", False),
        ("param_updated", False),
    ],
)
def test_the_record_tells_what_a_failed_step_changed(how: str, retryable: bool) -> None:
    from tokenbatch.oom._optimizer import StepRecord

    first, second = torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.Adam([first, second])
    first.grad = torch.ones(3)
    optimizer.step()  # only `first` has states
    record = StepRecord(optimizer)
    _mutate(optimizer, how)
    assert (record.changed() is None) == retryable
    if retryable:
        record.discard_new_states()
        assert list(optimizer.state) == [first]
