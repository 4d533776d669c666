"""``tokenbatch._checks``: what the argument checks accept, and that each refusal says what to pass."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from tokenbatch import TokenBudgetBatchSampler, _checks

# -- booleans (item 14: "False" and "no" used to mean True) -------------------------------


@pytest.mark.parametrize("value", [True, False, np.bool_(True), np.bool_(False)])
def test_boolean_accepts_bools(value: Any) -> None:
    result = _checks.boolean("drop_last", value)
    assert result is bool(value)


@pytest.mark.parametrize("value", ["False", "no", "", 0, 1, None, 1.0, torch.tensor(True)])
def test_boolean_refuses_everything_else(value: Any) -> None:
    with pytest.raises(TypeError) as caught:
        _checks.boolean("drop_last", value)
    assert str(caught.value) == f"drop_last should be True or False, but got drop_last={value!r}"


@pytest.mark.parametrize("name", ["shuffle", "drop_last"])
@pytest.mark.parametrize("value", ["False", "no"])
def test_sampler_refuses_string_booleans(name: str, value: str) -> None:
    with pytest.raises(TypeError, match=f"{name} should be True or False, but got {name}='{value}'"):
        TokenBudgetBatchSampler([5, 3, 8], 16, **{name: value})


def test_sampler_keeps_real_booleans() -> None:
    sampler = TokenBudgetBatchSampler([5, 3, 8], 16, shuffle=np.bool_(False), drop_last=True)
    assert sampler.shuffle is False and sampler.drop_last is True


def test_oom_fallback_refuses_a_string_trim_padding() -> None:
    from tokenbatch import oom

    sampler = TokenBudgetBatchSampler([5, 3, 8], 16)
    with pytest.raises(TypeError, match="trim_padding should be True or False, but got trim_padding='False'"):
        if hasattr(oom, "Split"):  # after the structural refactor the option lives on the split strategy
            oom.Split(trim_padding="False")
        else:
            oom.OOMFallback(sampler, torch.nn.Linear(2, 2), trim_padding="False")
