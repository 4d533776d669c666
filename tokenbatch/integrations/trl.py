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
- ``packing`` and ``padding_free`` are refused: they are another batching;
- TRL's ``compute_loss`` gathers its logged metrics (entropy, token accuracy,
  tokens seen) across processes in the middle of the forward pass, a
  collective that a process whose forward ran out of memory never reaches; under
  the guard they are each process's own (the main process's are logged).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any

import numpy as np

from tokenbatch.integrations.transformers import TokenBudgetMixin
from tokenbatch.lengths import column_lengths

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

# What TokenBudgetSFTTrainer refuses in SFTConfig, and why: (option, what to use instead).
_OTHER_BATCHING = (
    (
        "packing",
        "packing=True concatenates examples into rows of max_length tokens, a batching of its own; the "
        "token budget batches whole examples of similar length instead, with little padding: set "
        "packing=False, or use trl.SFTTrainer to pack",
    ),
    (
        "eval_packing",
        "eval_packing=True packs the evaluation set into rows of max_length tokens; evaluation batches "
        "follow eval_max_tokens instead: set eval_packing=False",
    ),
    (
        "padding_free",
        "padding_free=True flattens each batch into one row without padding, a batching of its own; the "
        "token budget pads batches of similar length, so little is padded: set padding_free=False, or use "
        "trl.SFTTrainer for padding-free batches",
    ),
)


def check_batching(args: Any) -> None:
    """Raise for SFTConfig ``args`` whose batching is not the token budget's (packing, padding-free).

    Raises:
        ValueError: ``packing``, ``eval_packing`` or ``padding_free`` is set; the message says what to use.
    """
    for option, why in _OTHER_BATCHING:
        if getattr(args, option, None):
            raise ValueError(f"TokenBudgetSFTTrainer does not take {option}=True: {why}")


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

    Raises:
        ValueError: ``packing``, ``eval_packing`` or ``padding_free`` in the config (another batching).

    Example:
        >>> from trl import SFTConfig
        >>> from tokenbatch.integrations.trl import TokenBudgetSFTTrainer
        >>> trainer = TokenBudgetSFTTrainer(  # doctest: +SKIP
        ...     model=model, args=SFTConfig("out", max_length=1024), train_dataset=pairs,
        ...     processing_class=tokenizer, max_tokens=16384, lr_scaling="linear")
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # SFTTrainer's own order: model, args, ...; checked before it tokenizes the datasets.
        check_batching(kwargs.get("args", args[1] if len(args) > 1 else None))
        super().__init__(*args, **kwargs)
        # The budget plans the lengths the model sees: TRL 1.0 truncates in its collator, not in the data.
        limit = getattr(self.data_collator, "max_length", None)
        cap = partial(capped_lengths, max_length=limit, column=self.args.length_column_name)
        self.train_dataset = cap(self.train_dataset)
        if isinstance(self.eval_dataset, dict):
            self.eval_dataset = {name: cap(dataset) for name, dataset in self.eval_dataset.items()}
        elif self.eval_dataset is not None:
            self.eval_dataset = cap(self.eval_dataset)

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
