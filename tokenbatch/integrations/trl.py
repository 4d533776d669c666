"""TRL's ``SFTTrainer`` with token-budget batches and the out-of-memory guard: :class:`TokenBudgetSFTTrainer`.

:class:`TokenBudgetSFTTrainer` is :class:`~tokenbatch.integrations.transformers.TokenBudgetMixin`
(the code of ``TokenBudgetTrainer``) on ``trl.SFTTrainer``: batches under a
token budget, the guard (split or halve on out-of-memory, then growth),
guarded evaluation, exact mid-epoch resume and ``lr_scaling``, with TRL's data
preparation and loss. What it adds for TRL:

- ``SFTTrainer`` tokenizes in its constructor (chat templates, prompt and
  completion masks); the lengths are read after that, from the prepared
  ``input_ids`` (or a ``length`` column), which TRL has truncated to
  ``max_length``; where TRL's collator truncates instead (TRL 1.0), the
  lengths are capped at its ``max_length``;
- ``padding_free=True`` packs whole examples (TRL's padding-free collator,
  a packed cost model); ``packing=True`` (bfd) is taken as the same, since
  the token budget packs whole examples afresh every epoch, where TRL packs
  the dataset once;
- an example over the budget is named by its row in TRL's prepared data and
  in the dataset passed in (TRL drops rows that truncation left untrained);
- TRL's ``compute_loss`` gathers its logged metrics (entropy, token accuracy,
  tokens seen) across processes in the middle of the forward pass, a
  collective that a process whose forward ran out of memory never reaches; under
  the guard they are each process's own (the main process's are logged).
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from tokenbatch.cost import CostModel
from tokenbatch.integrations.transformers import TokenBudgetMixin
from tokenbatch.integrations.transformers._layout import layout_cost
from tokenbatch.lengths import column_lengths
from tokenbatch.plan import OversizeSampleError

MIN_TRL = "1.0"
"""The oldest TRL that pyproject.toml's ``trl`` extra allows."""

try:
    import trl
    from packaging.version import Version
    from trl.trainer.sft_trainer import SFTTrainer

    if Version(trl.__version__) < Version(MIN_TRL):
        raise ImportError(
            f"tokenbatch.integrations.trl needs trl>={MIN_TRL}, but trl {trl.__version__} is installed: "
            f"pip install 'tokenbatch[trl]'"
        )
except ImportError as error:  # pragma: no cover - the extra is not installed, or too old
    if "needs trl>=" in str(error):
        raise
    raise ImportError("tokenbatch.integrations.trl needs TRL: pip install 'tokenbatch[trl]'") from error

__all__ = ["TokenBudgetSFTTrainer"]

logger = logging.getLogger(__name__)

ROW_COLUMN = "tokenbatch_row"
"""A column of the user's row numbers, put on the train set while TRL prepares it, then taken off."""

_SAMPLE = re.compile(r"\bsample (\d+)\b")


def packed_batches(args: Any) -> bool:
    """Whether SFTConfig ``args`` ask for packed batches (``padding_free``, or ``packing`` mapped to it).

    Raises:
        ValueError: a packing that cuts examples (``packing_strategy`` other than ``"bfd"``), or
            ``eval_packing=True`` with padded training; the message says what to use.
    """
    padding_free = bool(getattr(args, "padding_free", False))
    packing = bool(getattr(args, "packing", False))
    strategy = getattr(args, "packing_strategy", "bfd")
    if packing and strategy != "bfd":
        raise ValueError(
            f"packing_strategy should be 'bfd' with TokenBudgetSFTTrainer, but got "
            f"packing_strategy={strategy!r}, which cuts examples across rows; the token budget packs whole "
            f"examples: use packing_strategy='bfd' or padding_free=True (an example longer than max_length "
            f"is truncated to it, as bfd does), or trl.SFTTrainer to pack this way"
        )
    if getattr(args, "eval_packing", None) and not (packing or padding_free):
        raise ValueError(
            "TokenBudgetSFTTrainer does not take eval_packing=True with padded training: evaluation "
            "batches use the training collator; set eval_packing=False, or padding_free=True to pack both"
        )
    return padding_free or packing


@contextlib.contextmanager
def prepared_as_padded(args: Any, packed: bool) -> Iterator[None]:
    """TRL prepares the data as for padded batches while the block runs; after, ``args`` say padding-free.

    TRL would pack the prepared dataset once for ``packing=True``, and refuses
    ``max_length`` and a custom collator with ``padding_free=True``; the token
    budget packs whole examples itself every epoch, and TRL (>= 1.16)
    truncates to ``max_length`` in the prepared data either way. The collator
    is switched to padding-free after (:func:`make_padding_free`).
    """
    if not packed:
        yield
        return
    if getattr(args, "packing", False):
        logger.info(
            "packing=True: whole examples packed into rows of up to max_tokens, padding-free, packed "
            "afresh every epoch by the token budget (TRL's bfd packing would pack the dataset once); "
            "SFTConfig is set to packing=False, padding_free=True"
        )
    args.packing, args.padding_free, args.eval_packing = False, False, False
    try:
        yield
    finally:
        args.padding_free = True


def make_padding_free(collator: Any) -> None:
    """Switch TRL's collator to padding-free (its ``padding_free`` field); leave other collators as they are.

    Raises:
        ValueError: TRL's collator truncates to ``max_length`` itself (TRL 1.0), which its padding-free
            path does not do.
    """
    if getattr(collator, "padding_free", None) is not False:
        return
    if getattr(collator, "max_length", None) is not None:
        raise ValueError(
            f"max_length should be None for padding-free batches with trl {trl.__version__}, whose collator "
            f"truncates only padded batches, but got max_length={collator.max_length}; set max_length=None "
            f"(an example over the budget is then an error), or upgrade TRL (it truncates in the prepared "
            f"data)"
        )
    collator.padding_free = True


def _argument(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, position: int) -> Any:
    return kwargs.get(name, args[position] if len(args) > position else None)


def with_rows(dataset: Any) -> Any:
    """``dataset`` with a :data:`ROW_COLUMN` of its row numbers, for a ``datasets.Dataset`` without one."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list) or ROW_COLUMN in names or not hasattr(dataset, "add_column"):
        return dataset
    return dataset.add_column(ROW_COLUMN, np.arange(len(dataset), dtype=np.int64))


def take_rows(dataset: Any) -> tuple[Any, np.ndarray | None]:
    """``dataset`` without its :data:`ROW_COLUMN`, and that column (the user's row of each prepared row)."""
    names = getattr(dataset, "column_names", None)
    if not isinstance(names, list) or ROW_COLUMN not in names:
        return dataset, None
    rows = np.asarray(dataset[ROW_COLUMN], dtype=np.int64)
    return dataset.remove_columns(ROW_COLUMN), rows


def name_user_row(message: str, rows: np.ndarray | None) -> str:
    """``message`` with its first ``sample N`` called TRL's prepared row N, and the user's row where known."""
    match = _SAMPLE.search(message)
    if match is None:
        return message
    index = int(match.group(1))
    where = f"sample {index} of trainer.train_dataset as TRL prepared it"
    if rows is not None and index < len(rows):
        where += f" (row {int(rows[index])} of the train_dataset passed in)"
    else:
        where += " (TRL may have dropped or reordered rows of the train_dataset passed in)"
    return message[: match.start()] + where + message[match.end() :]


def capped_lengths(dataset: Any, max_length: int | None, column: str) -> Any:
    """``dataset`` with a ``column`` of lengths capped at ``max_length``, where a length is above it.

    The lengths are ``column``'s if the dataset has one, else its ``input_ids``'.
    Anything else (no ``max_length``, an iterable dataset, nothing over it) is returned as it is.
    """
    names = getattr(dataset, "column_names", None)
    if max_length is None or not isinstance(names, list) or not hasattr(dataset, "add_column"):
        return dataset
    source = column if column in names else "input_ids"
    if source not in names:
        return dataset
    lengths = column_lengths(dataset, source)
    if len(lengths) == 0 or int(lengths.max()) <= max_length:
        return dataset
    if column in names:
        dataset = dataset.remove_columns(column)
    return dataset.add_column(column, np.minimum(lengths, max_length).tolist())


def _rank_local(tensor: Any, *args: Any, **kwargs: Any) -> Any:
    return tensor


@contextlib.contextmanager
def local_metric_gathers(accelerator: Any) -> Iterator[None]:
    """``accelerator.gather_for_metrics`` returns this process's values while the block runs.

    A collective in the middle of a guarded step would wait forever for a
    process whose forward ran out of memory before it, or that runs its batch
    as more micro-batches; the guard's own agreement follows the step.
    """
    accelerator.gather_for_metrics = _rank_local  # shadows the method on this object only
    try:
        yield
    finally:
        del accelerator.gather_for_metrics


class TokenBudgetSFTTrainer(TokenBudgetMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` whose batches fit a token budget and which recovers from out-of-memory in place.

    Takes ``SFTTrainer``'s arguments (``SFTConfig``, prompt-completion or
    conversational datasets, ``completion_only_loss``, ``assistant_only_loss``,
    ``max_length``) and :class:`~tokenbatch.integrations.transformers.TokenBudgetMixin`'s
    (``max_tokens``, ``oom_mode``, ``lr_scaling``, ...). The loss is TRL's:
    the mean over the tokens it trains on, over accumulated batches and
    processes; a batch split into micro-batches after out-of-memory gives
    the same loss and gradients as the whole batch.

    ``padding_free=True`` (or ``packing=True``, mapped to it) makes each batch a
    pack: whole examples, truncated to ``max_length`` as padded ones are, one
    after another in one row (TRL's padding-free collator), costed with
    ``CostModel(packing=...)`` for the model's attention (``"varlen"`` for
    flash or flex attention, ``"full"`` for eager and sdpa; ``cost=`` to choose)
    and packed afresh every epoch to fill ``max_tokens``.

    Raises:
        ValueError: a ``packing_strategy`` that cuts examples, ``eval_packing=True`` with padded
            training, or a collator that disagrees with ``padding_free``.
        OversizeSampleError: (when training starts) an example alone over the budget; the message
            names its row in TRL's prepared dataset and in the dataset passed in.

    Example:
        >>> from trl import SFTConfig
        >>> from tokenbatch.integrations.trl import TokenBudgetSFTTrainer
        >>> trainer = TokenBudgetSFTTrainer(  # doctest: +SKIP
        ...     model=model, args=SFTConfig("out", max_length=1024, padding_free=True), train_dataset=pairs,
        ...     processing_class=tokenizer, max_tokens=16384, lr_scaling="linear")
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # SFTTrainer's own order: model, args, data_collator, train_dataset, ...; checked before it tokenizes.
        config = _argument(args, kwargs, "args", 1)
        self._packed = packed_batches(config)
        # The user's row of each prepared row: TRL drops rows (and shuffle_dataset reorders them).
        if "train_dataset" in kwargs:
            kwargs["train_dataset"] = with_rows(kwargs["train_dataset"])
        elif len(args) > 3:
            args = (*args[:3], with_rows(args[3]), *args[4:])
        with prepared_as_padded(config, self._packed):
            super().__init__(*args, **kwargs)
        self.train_dataset, self._user_rows = take_rows(self.train_dataset)
        # The budget plans the lengths the model sees: TRL 1.0 truncates in its collator, not in the data.
        limit = getattr(self.data_collator, "max_length", None)
        cap = partial(capped_lengths, max_length=limit, column=self.args.length_column_name)
        self.train_dataset = cap(self.train_dataset)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: cap(dataset) for name, dataset in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = cap(self.eval_dataset)

    def _layout_cost(self) -> CostModel:
        """The mixin's cost, with TRL's collator made padding-free first for ``padding_free=True``."""
        if self._packed:
            make_padding_free(self.data_collator)
        return layout_cost(self._given_cost, self.data_collator, self.model, packed=self._packed)

    def get_train_dataloader(self) -> Any:
        """The mixin's; an example over the budget is named by its row in TRL's data and in the user's."""
        try:
            return super().get_train_dataloader()
        except OversizeSampleError as error:
            raise OversizeSampleError(name_user_row(str(error), self._user_rows)) from None

    def compute_loss(
        self,
        model: Any,
        inputs: Any,
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """``SFTTrainer.compute_loss``; under the guard its metrics are gathered on this process only."""
        if self.oom_mode is None:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[no-untyped-call]
        with local_metric_gathers(self.accelerator):
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)  # type: ignore[no-untyped-call]
