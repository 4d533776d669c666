"""Argument checks shared by the public classes, and how a budget reads in messages.

Every message names the argument, the value it got and what to pass instead,
so a user can fix the call without reading our source.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping, Sized
from collections.abc import Set as AbstractSet
from numbers import Integral, Real
from typing import Any

import numpy as np


def budget(value: float) -> str:
    """A budget as people read it in logs and events: whole units from 100 to a billion (``2048``,
    not ``2047.5``), else 3 significant digits (``12.5``, ``1e+30``). State dicts keep the exact number."""
    return f"{value:.0f}" if 100 <= abs(value) < 1e9 else f"{value:.3g}"


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


def shrink_factor(name: str, value: Any) -> float:
    """Return ``value`` as a float, or raise if it is not a budget multiplier in (0, 1)."""
    factor = positive_number(name, value)
    if factor >= 1:
        raise ValueError(f"{name} should be below 1 (the budget must shrink), but got {name}={value!r}")
    return factor


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


#: The longest example the sampler takes: far beyond any model's context, and far from where
#: int64 arithmetic on lengths (rounding them up to a multiple, summing them) would overflow.
MAX_LENGTH = 2**40

_SEQUENCE = "a sequence with one length per example (list, numpy array or tensor)"


def lengths_array(lengths: Any) -> np.ndarray:
    """Turn a list, numpy array or torch tensor of lengths into a 1-D int64 array.

    One token list per example (``ds["input_ids"]`` of a ``datasets.Dataset``, or a
    list of lists) is taken as each row's ``len()``.

    Raises:
        TypeError: not a sequence, or an entry is not a number (the message names it).
        ValueError: empty, not 1-D, NaN, fractional, below 1 or above 2**40.
    """
    if hasattr(lengths, "detach") and hasattr(lengths, "cpu"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    if not isinstance(lengths, np.ndarray):
        lengths = _one_per_example(lengths)
    try:
        array = np.asarray(lengths)
    except (TypeError, ValueError):  # ragged: a token list among numbers, say
        array = _scan(lengths)
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
        # None, text, Python ints beyond int64: name the first, as given (numpy made 1 into "1")
        array = _scan(array.tolist() if isinstance(lengths, np.ndarray) else lengths)
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
    bad = np.flatnonzero(array > MAX_LENGTH)
    if bad.size:  # before the cast, which would turn 1e20 into a negative number (and warn)
        raise ValueError(_too_large(int(bad[0]), array[bad[0]].item()))
    return array.astype(np.int64, copy=False)


def _too_large(index: int, value: Any) -> str:
    return f"lengths should be at most 2**40 tokens per example, but lengths[{index}]={value!r}"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _is_row(value: Any) -> bool:
    """A token list (list, tuple, array, tensor) rather than a length."""
    return (
        isinstance(value, Sized)
        and not isinstance(value, str | bytes | Mapping)
        and getattr(value, "ndim", 1) != 0  # a 0-d array or tensor holds one number
    )


def _one_per_example(lengths: Any) -> Any:
    """``lengths`` as something numpy reads as one entry per example, or a TypeError saying what to pass."""
    kind = type(lengths).__name__
    if type(lengths).__module__.split(".")[0] == "datasets" and hasattr(lengths, "column_names"):
        raise TypeError(
            f"lengths should be {_SEQUENCE}, but got a datasets {kind}; pass "
            f"tokenbatch.column_lengths(dataset, 'input_ids') for a column of token ids (or of "
            f"lengths), or tokenbatch.text_lengths(dataset, tokenizer) to tokenize a text column"
        )
    if isinstance(lengths, Iterator):
        raise TypeError(
            f"lengths should be {_SEQUENCE}, but got a {kind}, which can be read only once; "
            f"pass list(...) of it"
        )
    if isinstance(lengths, AbstractSet):
        raise TypeError(
            f"lengths should be {_SEQUENCE} in example order, but got a {kind}, which has no order; "
            f"pass a list"
        )
    if isinstance(lengths, Mapping):
        keys = ", ".join(repr(key) for key in list(lengths)[:6])
        raise TypeError(
            f"lengths should be {_SEQUENCE}, but got a {kind} with keys {keys}; "
            f"pass the entry that holds the token ids or the lengths"
        )
    if isinstance(lengths, str | bytes) or not isinstance(lengths, Iterable):
        raise TypeError(f"lengths should be {_SEQUENCE}, but got lengths={_short(lengths)}")
    measured = _arrow_lengths(lengths)
    if measured is not None:
        return measured
    if not isinstance(lengths, list | tuple | range) and not hasattr(lengths, "__array__"):
        lengths = list(lengths)  # one pass (a datasets Column reads row by row when indexed)
    first = next(iter(lengths), None)
    if first is None or not _is_row(first):
        return lengths
    rows = np.empty(len(lengths), dtype=np.int64)
    for index, row in enumerate(lengths):
        if not _is_row(row):
            raise TypeError(
                f"lengths should hold one token list per example (as lengths[0] does) or one length "
                f"per example, but lengths[{index}]={_short(row)}"
            )
        rows[index] = len(row)
    return rows


def _arrow_lengths(column: Any) -> np.ndarray | None:
    """Row lengths of a ``datasets`` column (``ds["input_ids"]``), read from Arrow at once.

    None when ``column`` is not one, or holds neither lists nor integers (the
    checks that follow name the first bad row); row-by-row reading would take
    seconds per million rows.
    """
    source: Any = getattr(column, "source", None)
    if type(column).__module__.split(".")[0] != "datasets" or not hasattr(source, "with_format"):
        return None  # not a Column, or one of a nested column (its source is another Column)
    import pyarrow as pa
    import pyarrow.compute as pc

    # The arrow format applies any indices mapping (select, shuffle) and reads only this column.
    values = source.with_format("arrow")[getattr(column, "column_name", None)]
    if not isinstance(values, pa.Array | pa.ChunkedArray):
        return None
    kind = values.type
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        values = pc.list_value_length(values)
    elif not pa.types.is_integer(kind):
        return None
    if values.null_count:
        first = int(np.flatnonzero(pc.is_null(values).to_numpy(zero_copy_only=False))[0])
        raise TypeError(f"lengths should hold integers, but lengths[{first}]=None")
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    return np.asarray(values.to_numpy(zero_copy_only=False), dtype=np.int64)


def _scan(values: Any) -> np.ndarray:
    """The lengths one by one, so that the first that is not a number is named with its position."""
    numbers: list[int | float] = []
    for index, value in enumerate(values):
        if isinstance(value, bool | np.bool_) or not isinstance(value, Real):
            hint = ""
            if isinstance(value, str):
                hint = " is text; count its tokens with tokenbatch.text_lengths(texts, tokenizer)"
            elif _is_row(value):
                hint = " is a token list among lengths; pass one length, or one token list, per example"
            raise TypeError(f"lengths should hold integers, but lengths[{index}]={_short(value)}{hint}")
        if isinstance(value, Integral) and int(value) > MAX_LENGTH:  # beyond int64 for numpy too
            raise ValueError(_too_large(index, int(value)))
        numbers.append(int(value) if isinstance(value, Integral) else float(value))
    return np.asarray(numbers)
