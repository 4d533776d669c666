"""Argument checks shared by the public classes.

Every message names the argument, the value it got and what to pass instead,
so a user can fix the call without reading our source.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

import numpy as np


def positive_number(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} should be a positive number, but got {name}={value!r}")
    if not math.isfinite(float(value)) or value <= 0:
        raise ValueError(f"{name} should be a positive finite number, but got {name}={value!r}")
    return float(value)


def non_negative_number(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise if it is not a finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} should be a number >= 0, but got {name}={value!r}")
    if not math.isfinite(float(value)) or value < 0:
        raise ValueError(f"{name} should be a finite number >= 0, but got {name}={value!r}")
    return float(value)


def positive_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= 1."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} should be an integer >= 1, but got {name}={value!r}")
    if value < 1:
        raise ValueError(f"{name} should be an integer >= 1, but got {name}={value!r}")
    return int(value)


def non_negative_int(name: str, value: Any) -> int:
    """Return ``value`` as an int, or raise if it is not an integer >= 0."""
    if isinstance(value, bool) or not isinstance(value, Integral):
        raise TypeError(f"{name} should be an integer >= 0, but got {name}={value!r}")
    if value < 0:
        raise ValueError(f"{name} should be an integer >= 0, but got {name}={value!r}")
    return int(value)


def boolean(name: str, value: Any) -> bool:
    """Return ``value`` as a bool, or raise if it is not ``True`` or ``False``.

    ``bool(value)`` would turn ``"False"`` or ``"no"`` into ``True``; like torch's
    ``BatchSampler`` we refuse anything but a real bool (numpy's included).
    """
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise TypeError(f"{name} should be True or False, but got {name}={value!r}")


def one_of(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """Return ``value`` if it is one of ``choices``, else raise naming them."""
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{name} should be one of {options}, but got {name}={value!r}")
    return str(value)


def lengths_array(lengths: Any) -> np.ndarray:
    """Turn a list, numpy array or torch tensor of lengths into a 1-D int64 array.

    Raises:
        TypeError: the lengths are not numbers.
        ValueError: empty, not 1-D, NaN, fractional, or below 1.
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    try:
        array = np.asarray(lengths)
    except (TypeError, ValueError) as error:
        raise TypeError(
            f"lengths should be a sequence of integers (list, numpy array or tensor), "
            f"but got lengths of type {type(lengths).__name__}: {error}"
        ) from None
    if array.ndim != 1:
        raise ValueError(
            f"lengths should be one-dimensional (one length per example), "
            f"but got lengths with shape {array.shape}"
        )
    if array.size == 0:
        raise ValueError("lengths should hold one length per example, but got an empty lengths")
    if array.dtype == bool or not (
        np.issubdtype(array.dtype, np.integer) or np.issubdtype(array.dtype, np.floating)
    ):
        raise TypeError(
            f"lengths should hold integers, but got lengths of dtype {array.dtype} "
            f"(first value {array.flat[0]!r})"
        )
    if np.issubdtype(array.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(array))
        if bad.size:
            raise ValueError(
                f"lengths should be finite integers, but lengths[{bad[0]}]={array[bad[0]].item()!r}"
            )
        bad = np.flatnonzero(array != np.floor(array))
        if bad.size:
            raise ValueError(
                f"lengths should be whole numbers of tokens, but lengths[{bad[0]}]={array[bad[0]].item()!r}"
            )
    bad = np.flatnonzero(array < 1)
    if bad.size:
        raise ValueError(
            f"lengths should be integers >= 1 (the padded length of each example), "
            f"but lengths[{bad[0]}]={array[bad[0]].item()!r}"
        )
    return array.astype(np.int64, copy=False)
