import math

import numpy as np
import pytest

from tokenbatch import CostModel


def test_default_cost_counts_padded_tokens() -> None:
    assert CostModel().cost(8, 100) == 800.0
    assert CostModel().cost(1, 1) == 1.0


def test_cost_rounds_length_up_to_multiple() -> None:
    model = CostModel(pad_to_multiple_of=8)
    assert model.padded_length(1) == 8
    assert model.padded_length(8) == 8
    assert model.padded_length(9) == 16
    assert model.cost(3, 9) == 48.0


def test_cost_formula_with_every_term() -> None:
    model = CostModel(linear=2.0, quadratic=0.5, per_sample=7.0, pad_to_multiple_of=4)
    # L = 10 -> 12: 2*12 + 0.5*144 + 7 = 103 per sample
    assert model.cost(5, 10) == 5 * 103.0


def test_cost_vectorised_matches_scalar() -> None:
    model = CostModel(quadratic=1 / 1024, pad_to_multiple_of=8)
    sizes = np.array([1, 4, 17, 300])
    lengths = np.array([1, 63, 511, 4096])
    expected = [model.cost(int(b), int(length)) for b, length in zip(sizes, lengths, strict=True)]
    np.testing.assert_allclose(model.cost(sizes, lengths), expected)
    assert isinstance(model.cost(2, 3), float)
    assert model.cost(sizes, 10).shape == (4,)


def test_attention_preset_crossover_doubles_cost_at_crossover() -> None:
    model = CostModel.attention(crossover=1024)
    assert model.cost(1, 1024) == 2 * 1024
    assert math.isclose(model.cost(1, 8), 8 * (1 + 8 / 1024))
    assert model.quadratic == 1 / 1024


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"linear": -1.0}, "linear should be a finite number >= 0, but got linear=-1.0"),
        ({"quadratic": float("nan")}, "quadratic"),
        ({"per_sample": float("inf")}, "per_sample"),
        ({"pad_to_multiple_of": 0}, "pad_to_multiple_of should be an integer >= 1"),
        ({"linear": 0.0}, "at least one positive term"),
    ],
)
def test_cost_model_rejects_bad_values(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        CostModel(**kwargs)  # type: ignore[arg-type]


def test_cost_model_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="pad_to_multiple_of"):
        CostModel(pad_to_multiple_of=2.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="linear"):
        CostModel(linear="1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="crossover"):
        CostModel.attention(crossover=0)
