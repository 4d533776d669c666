"""Flattened (packed) batches: the examples a collated pack holds, and a pack of some of them.

transformers' ``DataCollatorWithFlattening`` and TRL's padding-free collator
put whole examples one after another in one row, with no ``attention_mask``;
where one example ends and the next starts is in ``position_ids`` (which
restart per example), or in ``cu_seq_lens_q`` or ``seq_idx`` where the
collator returns those instead::

    input_ids     [[ 5  9  4 | 7  3 | 8  6  2  1]]
    position_ids  [[ 0  1  2 | 0  1 | 0  1  2  3]]
    labels        [[-100 9 4 | -100 3 | -100 6 2 1]]   (each example's first label is -100)
    cu_seq_lens_q [0 3 5 9]  max_length_q 4  seq_idx [[0 0 0 1 1 2 2 2 2]]

:func:`packed_examples` finds each example's row, start and length (and its
labelled tokens); :func:`take_examples` builds the flattened batch of some of
them, as the collator would have built it from those examples alone: the
per-token tensors cut and joined in one row, ``cu_seq_lens_*``,
``max_length_*`` and ``seq_idx`` computed again. The OOM guard (splitting a
pack, costing it), ``tokenbatch.testing.inject_oom`` (costing a model call)
and the integrations read packs through these two functions.

A padded batch (it has an ``attention_mask``, or several rows of one example
each) is not a pack: :func:`packed_examples` returns None for it. Padding a
pack to a multiple (TRL's ``pad_to_multiple_of``) appends tokens at position
0, which count as 1-token examples here as in TRL's own ``cu_seq_lens``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
"""The label transformers' losses skip; the flattening collators put it at each example's first token."""

BOUNDARY_KEYS = ("cu_seq_lens_q", "cu_seq_lens_k")
LONGEST_KEYS = ("max_length_q", "max_length_k")
SEQUENCE_KEY = "seq_idx"


@dataclass(frozen=True)
class PackedExamples:
    """Where the examples of a flattened batch are: its shape, then per example its row, start and length."""

    rows: int
    """Rows of the batch (1 for the flattening collators)."""
    width: int
    """Columns of the batch: its row's length."""
    row: np.ndarray
    start: np.ndarray
    """Each example's first column in its row."""
    lengths: np.ndarray
    labelled: np.ndarray | None
    """Each example's tokens with a label other than -100 (what a token-mean loss averages over), or
    None where the batch has no per-token ``labels``."""

    def positions(self, chosen: Sequence[int] | np.ndarray) -> np.ndarray:
        """The flat positions (``row * width + column``) of the tokens of ``chosen``, in that order."""
        chosen = np.asarray(chosen, dtype=np.int64)
        if len(chosen) == 0:
            return np.empty(0, np.int64)
        lengths = self.lengths[chosen]
        firsts = self.row[chosen] * self.width + self.start[chosen]
        # Each example's run of positions: its first one, then +1 per token.
        offsets = np.repeat(firsts - np.cumsum(lengths) + lengths, lengths)
        return offsets + np.arange(int(lengths.sum()), dtype=np.int64)


def _tensor(batch: Mapping[str, Any], key: str, dims: int) -> torch.Tensor | None:
    value = batch.get(key)
    return value if isinstance(value, torch.Tensor) and value.dim() == dims else None


def packed_examples(batch: Any) -> PackedExamples | None:
    """The examples of ``batch`` if it is a flattened (packed) batch, else None.

    A pack is a mapping of tensors without an ``attention_mask`` whose
    examples are marked by ``position_ids`` (a new example wherever the
    position does not follow the one before), else by ``cu_seq_lens_q`` (one
    row), else by ``seq_idx``, and which holds one row or more than one example
    in some row.

    Example:
        >>> import torch
        >>> batch = {"input_ids": torch.tensor([[5, 9, 4, 7, 3]]),
        ...          "position_ids": torch.tensor([[0, 1, 2, 0, 1]]),
        ...          "labels": torch.tensor([[-100, 9, 4, -100, 3]])}
        >>> examples = packed_examples(batch)
        >>> examples.lengths.tolist(), examples.start.tolist(), examples.labelled.tolist()
        ([3, 2], [0, 3], [2, 1])
    """
    if not isinstance(batch, Mapping) or isinstance(batch.get("attention_mask"), torch.Tensor):
        return None
    positions, sequences = _tensor(batch, "position_ids", 2), _tensor(batch, SEQUENCE_KEY, 2)
    boundaries = _tensor(batch, BOUNDARY_KEYS[0], 1)
    starts: np.ndarray  # (rows, width): True where an example starts
    if positions is not None:
        marks = positions.detach().to("cpu").numpy().astype(np.int64)
        starts = np.ones(marks.shape, dtype=bool)
        starts[:, 1:] = marks[:, 1:] != marks[:, :-1] + 1
    elif sequences is not None:
        marks = sequences.detach().to("cpu").numpy().astype(np.int64)
        starts = np.ones(marks.shape, dtype=bool)
        starts[:, 1:] = marks[:, 1:] != marks[:, :-1]
    elif boundaries is not None:
        cuts = boundaries.detach().to("cpu").numpy().astype(np.int64)
        if len(cuts) < 2 or cuts[0] != 0 or np.any(np.diff(cuts) <= 0):
            return None
        ids = _tensor(batch, "input_ids", 2)
        if ids is not None and tuple(ids.shape) != (1, int(cuts[-1])):
            return None
        starts = np.zeros((1, int(cuts[-1])), dtype=bool)
        starts[0, cuts[:-1]] = True
    else:
        return None
    rows, width = int(starts.shape[0]), int(starts.shape[1])
    if width == 0 or (rows > 1 and not starts[:, 1:].any()):
        return None  # several rows of one example each: a padded batch without a mask
    row, start = np.nonzero(starts)
    flat = row * width + start
    lengths = np.diff(np.append(flat, rows * width))
    labels = _tensor(batch, "labels", 2)
    labelled = None
    if labels is not None and tuple(labels.shape) == (rows, width):
        counted = (labels.detach().to("cpu").reshape(-1) != IGNORE_INDEX).numpy().astype(np.int64)
        labelled = np.add.reduceat(counted, flat)
    return PackedExamples(rows, width, row.astype(np.int64), start.astype(np.int64), lengths, labelled)


def take_examples(
    batch: Mapping[str, Any], examples: PackedExamples, chosen: Sequence[int] | np.ndarray
) -> Any:
    """The flattened batch of the examples ``chosen`` (in that order) of ``batch``, in one row.

    Per-token tensors (their first two dimensions are the batch's rows and
    width: ids, labels, positions, embeddings) keep the chosen examples'
    tokens; ``cu_seq_lens_*``, ``max_length_*`` and ``seq_idx`` are computed
    for them; anything else is kept as it is (on a one-row batch).

    Raises:
        TypeError: a tensor or list of a several-row batch has one entry per row: which
            entries go with which examples cannot be told.
    """
    chosen = np.asarray(chosen, dtype=np.int64)
    lengths = examples.lengths[chosen]
    flat = torch.as_tensor(examples.positions(chosen))
    cuts = np.concatenate([[0], np.cumsum(lengths)])
    shape = (examples.rows, examples.width)

    def cut(key: str, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if key in BOUNDARY_KEYS and value.dim() == 1:
                return torch.as_tensor(cuts, dtype=value.dtype, device=value.device)
            if key in LONGEST_KEYS and value.dim() == 0:
                return torch.as_tensor(int(lengths.max()), dtype=value.dtype, device=value.device)
            if value.dim() >= 2 and tuple(value.shape[:2]) == shape:
                if key == SEQUENCE_KEY:
                    number = torch.arange(len(chosen), dtype=value.dtype, device=value.device)
                    counts = torch.as_tensor(lengths, device=value.device)
                    return torch.repeat_interleave(number, counts)[None]
                tokens = value.reshape(-1, *value.shape[2:])
                return tokens.index_select(0, flat.to(value.device)).unsqueeze(0)
        if key in LONGEST_KEYS and isinstance(value, int) and not isinstance(value, bool):
            return int(lengths.max())
        sized = isinstance(value, list) or (isinstance(value, torch.Tensor) and value.dim() > 0)
        per_row = sized and len(value) == examples.rows
        if per_row and examples.rows > 1:
            raise TypeError(
                f"cannot split a packed batch of {examples.rows} rows: batch[{key!r}] has one entry per row, "
                f"which does not say which of the row's examples it belongs to; collate the pack in one "
                f"row (DataCollatorWithFlattening does) or leave per-row values out of the batch"
            )
        return value

    data = {key: cut(key, value) for key, value in batch.items()}
    kind: Any = type(batch)  # dict, BatchEncoding, ...: keep the collator's type where it allows
    try:
        return kind(data)
    except TypeError:
        return data
