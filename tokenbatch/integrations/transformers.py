"""A transformers ``Trainer`` that batches by token budget and survives out-of-memory errors in place.

:class:`TokenBudgetTrainer` trains with a :class:`~tokenbatch.TokenBudgetBatchSampler`,
evaluates with one too, and guards every training step with an
:class:`~tokenbatch.OOMFallback`: on out-of-memory it shrinks the budget on
every rank and carries on from the same batch, with the same optimizer,
scheduler and global step (``auto_find_batch_size`` instead restarts the run).

How it fits Trainer's loop (transformers 5): the loop runs a count of
optimizer steps fixed from ``len(train_dataloader)`` and prefetches a group
of ``gradient_accumulation_steps`` batches at a time. Here the count is a
bound the epoch cannot reach, the epoch ends when the sampler's plan does,
the last group is filled with no-op slots, and a batch prefetched before a
halve-mode re-plan is swapped for the next batch of the new plan. The
scheduler is built for the exact number of optimizer steps the plans of all
epochs make; a halve-mode re-plan adds steps, and then ``state.max_steps``
grows so that no epoch is cut short and the schedule is stretched over the
extra steps (see :class:`~tokenbatch.integrations._schedule.StretchedSchedule`).
"""

from __future__ import annotations

import inspect
import logging
import math
import os
from collections.abc import Iterator
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.integrations._checkpoint import STATE_FILE, checkpoint_state, read_state, write_state
from tokenbatch.integrations._data import budget_dataloader
from tokenbatch.integrations._feed import Feed, inverse_order, reorder
from tokenbatch.integrations._guard import check_supported, guarded_step, make_fallback
from tokenbatch.integrations._schedule import EpochProgress, StretchedSchedule, grow_run, planned_updates
from tokenbatch.oom import OOMEvent, OOMFallback
from tokenbatch.plan import OVERSIZE_POLICIES
from tokenbatch.sampler import TokenBudgetBatchSampler

try:
    from transformers import Trainer, TrainingArguments
    from transformers.trainer_utils import (
        PREFIX_CHECKPOINT_DIR,
        PredictionOutput,
        TrainOutput,
        get_last_checkpoint,
    )
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "tokenbatch.integrations.transformers needs transformers and accelerate: "
        "pip install 'tokenbatch[transformers]'"
    ) from error

__all__ = ["STATE_FILE", "TokenBudgetTrainer"]

logger = logging.getLogger(__name__)
OOM_MODES = ("split", "halve")


class TokenBudgetTrainer(Trainer):
    """A ``Trainer`` whose batches fit a token budget and which recovers from out-of-memory in place.

    Use it as ``Trainer`` (same arguments), with ``max_tokens`` instead of a
    batch size (``per_device_*_batch_size`` and ``group_by_length`` are not
    used). Token lengths come from the datasets as in ``group_by_length``:
    the ``args.length_column_name`` column if present, else the tokenizer's
    first model input (``input_ids``); the collator must pad to the longest
    sequence in a batch (the default with a tokenizer). Logs add
    ``max_tokens`` (the budget in force), ``step_samples`` (samples per
    optimizer step, over all ranks and accumulated batches) and ``oom_events``.
    ``train(resume_from_checkpoint=...)`` resumes at the same sample with the
    same budget. Works with ``accelerate launch`` (DDP); not with DeepSpeed,
    FSDP or ``DataParallel`` unless ``oom_mode=None``.

    Args:
        max_tokens: the training budget per batch and rank, in ``cost`` units
            (padded tokens by default).
        eval_max_tokens: the budget for evaluation and prediction (default
            ``max_tokens``; without gradients it can usually be larger).
        cost: the memory estimate; ``CostModel()`` counts padded tokens.
        oom_mode: ``"split"`` runs a batch that ran out of memory as smaller
            micro-batches (same batches and optimizer steps); ``"halve"``
            re-plans the rest of training under a smaller budget (more, smaller
            batches); None: no guard.
        oom_factor: the budget multiplier per out-of-memory event.
        min_tokens: stop with :class:`~tokenbatch.SampleTooLargeError` rather than go below this budget.
        max_batch_size: an optional cap on samples per batch.
        batch_size_multiple: round batch sizes down to a multiple of this.
        oversize: what to do with a sample that alone exceeds the budget (see
            the sampler); ``"alone"`` (default) trains it in a batch of its own,
            so a budget shrunk by an out-of-memory event never stops a later epoch.

    Example:
        >>> from tokenbatch.integrations.transformers import TokenBudgetTrainer
        >>> trainer = TokenBudgetTrainer(  # doctest: +SKIP
        ...     model=model, args=TrainingArguments("out", num_train_epochs=3),
        ...     train_dataset=tokenized["train"], eval_dataset=tokenized["validation"],
        ...     processing_class=tokenizer, max_tokens=8192, oom_mode="split")
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(
        self,
        *args: Any,
        max_tokens: float,
        eval_max_tokens: float | None = None,
        cost: CostModel | None = None,
        oom_mode: str | None = "split",
        oom_factor: float = 0.5,
        min_tokens: float | None = None,
        max_batch_size: int | None = None,
        batch_size_multiple: int = 1,
        oversize: str = "alone",
        **kwargs: Any,
    ) -> None:
        self.max_tokens = _checks.positive_number("max_tokens", max_tokens)
        self.eval_max_tokens = (
            self.max_tokens
            if eval_max_tokens is None
            else _checks.positive_number("eval_max_tokens", eval_max_tokens)
        )
        if cost is not None and not isinstance(cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        self.token_cost = CostModel() if cost is None else cost
        if oom_mode is not None and oom_mode not in OOM_MODES:
            raise ValueError(f"oom_mode should be 'split', 'halve' or None, but got oom_mode={oom_mode!r}")
        self.oom_mode = oom_mode
        self.oom_factor = _checks.positive_number("oom_factor", oom_factor)
        if self.oom_factor >= 1:
            raise ValueError(f"oom_factor should be below 1 (the budget must shrink), but got {oom_factor!r}")
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
        self.sampler_options: dict[str, Any] = {
            "max_batch_size": max_batch_size,
            "batch_size_multiple": batch_size_multiple,
            "oversize": _checks.one_of("oversize", oversize, OVERSIZE_POLICIES),
        }
        for name in (
            "_run_epoch",
            "get_batch_samples",
            "set_initial_training_values",
            "_init_training_state",
        ):
            if not hasattr(Trainer, name):
                raise ImportError(f"TokenBudgetTrainer needs transformers>=5 (Trainer.{name} is missing)")
        self._sampler: TokenBudgetBatchSampler | None = None
        self._fallback: OOMFallback | None = None
        self._feed: Feed | None = None
        self._resume: dict[str, Any] | None = None
        self._group_size = 1
        self._schedule_length = 0
        self._samples_since_log = 0
        self._logged_step = 0
        self._test_order: Any = None
        super().__init__(*args, **kwargs)
        check_supported(self)
        self.add_callback(EpochProgress(self))

    # -- what it exposes -------------------------------------------------------------

    @property
    def train_sampler(self) -> TokenBudgetBatchSampler | None:
        """The sampler of the training DataLoader (set by ``get_train_dataloader``)."""
        return self._sampler

    @property
    def oom_fallback(self) -> OOMFallback | None:
        """The out-of-memory guard (created at the first training step)."""
        return self._fallback

    @property
    def oom_events(self) -> list[OOMEvent]:
        """Every out-of-memory event of this run (resumed runs included)."""
        return [] if self._fallback is None else list(self._fallback.events)

    def _budget(self) -> float:
        if self._fallback is not None:
            return self._fallback.max_tokens
        return self._sampler.max_tokens if self._sampler is not None else self.max_tokens

    # -- data --------------------------------------------------------------------------

    def get_train_dataloader(self) -> Any:
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        loader, sampler = budget_dataloader(
            self, self.train_dataset, "Training", self.max_tokens, training=True
        )
        if self._resume is not None:
            sampler.load_state_dict(self._resume["sampler"])
            if len(sampler) == 0:  # saved at the end of an epoch: resume at the start of the next
                sampler.set_epoch(sampler.epoch + 1)
        self._sampler = sampler
        return loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        cached = getattr(self, "_eval_dataloaders", {})
        if self.args.dataloader_persistent_workers and key in cached:
            return cached[key]
        if isinstance(eval_dataset, str):
            dataset = cast(dict[str, Any], self.eval_dataset)[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        loader, _ = budget_dataloader(self, dataset, "Evaluation", self.eval_max_tokens, training=False)
        if self.args.dataloader_persistent_workers:
            self._eval_dataloaders = {**cached, key: loader}
        return loader

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        loader, sampler = budget_dataloader(self, test_dataset, "test", self.eval_max_tokens, training=False)
        self._test_order = sampler.plan.order.copy()
        return loader

    def predict(
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """``Trainer.predict``, with predictions and labels put back in dataset order."""
        self._test_order = None
        output = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        order, self._test_order = self._test_order, None
        if order is None:
            return output
        index, count = inverse_order(order), len(order)
        return output._replace(
            predictions=reorder(output.predictions, index, count),
            label_ids=reorder(output.label_ids, index, count),
        )

    # -- the training run --------------------------------------------------------------

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """``Trainer.train``; a checkpoint to resume from must have been saved by TokenBudgetTrainer."""
        self._fallback = self._resume = None
        checkpoint: Any = resume_from_checkpoint
        if checkpoint is True:
            # None: Trainer raises its own error below
            checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
        if isinstance(checkpoint, str | os.PathLike):
            self._resume = read_state(os.fspath(checkpoint), self.oom_mode)
        return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def set_initial_training_values(
        self, args: TrainingArguments, dataloader: Any
    ) -> tuple[int, int, int, int, int, int | None, int]:
        values = super().set_initial_training_values(args, dataloader)
        if self._sampler is None:
            return values
        epochs, _, examples, samples, total_batch, steps_in_epoch, max_steps = values
        per_epoch = planned_updates(self, 0, self.max_tokens)
        if args.max_steps > 0:  # a margin for shorter epochs: the run stops at max_steps anyway
            epochs = math.ceil(args.max_steps / per_epoch * 1.05) + 1
        elif self._resume is not None:
            max_steps = int(self._resume["schedule_length"])
        else:  # exact: the plans are pure functions of (seed, epoch)
            max_steps = sum(planned_updates(self, epoch, self.max_tokens) for epoch in range(epochs))
        self._schedule_length = max_steps
        return epochs, per_epoch, examples, samples, total_batch, steps_in_epoch, max_steps

    def _init_training_state(self, *args: Any, **kwargs: Any) -> tuple[int, int]:
        epochs_trained, steps = super()._init_training_state(*args, **kwargs)
        sampler = self._sampler
        if sampler is None:
            return epochs_trained, steps
        if self._resume is not None:
            if self.args.ignore_data_skip:
                logger.warning("ignore_data_skip=True is ignored: the sampler resumes at the next sample")
            epochs_trained = sampler.epoch
            if self.args.max_steps <= 0:
                self.state.max_steps = int(self._resume["max_steps"])
        self._samples_since_log, self._logged_step = 0, self.state.global_step
        return epochs_trained, 0  # Trainer must not skip batches: the sampler starts at the right one

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> LRScheduler:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # Metric-driven schedulers (ReduceLROnPlateau, GreedyLR) do not count steps: nothing to stretch.
        stepped = isinstance(scheduler, LRScheduler) and not isinstance(scheduler, ReduceLROnPlateau)
        stepped = stepped and type(scheduler).__name__ != "GreedyLR"
        if self.oom_mode == "halve" and self.args.max_steps <= 0 and stepped:
            self.lr_scheduler = cast(Any, StretchedSchedule(scheduler, num_training_steps))
        return cast(LRScheduler, self.lr_scheduler)

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        if self._sampler is None:
            return super()._run_epoch(*args, **kwargs)  # type: ignore[no-untyped-call]
        bound = inspect.signature(super()._run_epoch).bind(*args, **kwargs)
        values = bound.arguments
        self._sampler.set_epoch(values["epoch"])
        self._feed = Feed(values["train_dataloader"], self._sampler)
        # A count of groups no epoch reaches (every step holds a sample): get_batch_samples ends the epoch.
        groups = len(self._sampler.lengths) + 1
        values["num_update_steps_per_epoch"] = groups
        values["steps_in_epoch"] = groups * self.args.gradient_accumulation_steps
        try:
            return super()._run_epoch(*bound.args, **bound.kwargs)  # type: ignore[no-untyped-call]
        finally:
            self._feed.close()
            self._feed = None

    def get_batch_samples(
        self, epoch_iterator: Iterator[Any], num_batches: int, device: torch.device
    ) -> tuple[list[Any], torch.Tensor | int | None]:
        feed = self._feed
        if feed is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        batches = feed.take(num_batches)
        if not batches:
            self.control.should_epoch_stop = True
            return [], None
        _, num_items = super().get_batch_samples(iter(batches), len(batches), device)
        self._group_size = len(batches)
        # Full groups only: Trainer steps the optimizer at the end of a group of gradient_accumulation_steps.
        main_input = getattr(self.model, "main_input_name", "input_ids")
        return feed.pad(batches, num_batches, main_input), num_items

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        feed = self._feed
        if feed is None:
            return super().training_step(model, inputs, num_items_in_batch)
        self.current_gradient_accumulation_steps = self._group_size  # real batches, not padding slots
        item = feed.resolve(inputs)
        replanned = False
        loss = None
        while item is not None:
            batch, step = item
            if self.oom_mode is None:
                loss = super().training_step(model, batch, num_items_in_batch)
            else:
                loss = guarded_step(self, self._fallback_for(model), model, batch, num_items_in_batch)
            if loss is not None:
                if step is not None:
                    self._samples_since_log += feed.global_samples(step)
                break
            replanned = True  # halve mode: the rest of the epoch was re-planned from this batch on
            feed.restart()
            item = feed.next_batch()
        if replanned:
            grow_run(self, feed)
        return loss if loss is not None else torch.zeros((), device=self.args.device)

    def _fallback_for(self, model: nn.Module) -> OOMFallback:
        """The fallback for the model as Trainer wrapped it (made at the first step, kept across re-wraps)."""
        fallback = self._fallback
        if fallback is None or fallback.model is not model:
            assert self._sampler is not None
            state = fallback.state_dict() if fallback is not None else (self._resume or {}).get("fallback")
            fallback = self._fallback = make_fallback(self, self._sampler, model, state)
        return fallback

    # -- logs and checkpoints -------------------------------------------------------

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._sampler is not None and "loss" in logs and self.state.global_step > self._logged_step:
            steps = self.state.global_step - self._logged_step
            logs = {
                **logs,
                "max_tokens": self._budget(),
                "step_samples": self._samples_since_log / steps,
                "oom_events": float(len(self.oom_events)),
            }
            self._samples_since_log, self._logged_step = 0, self.state.global_step
        super().log(logs, start_time)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self._sampler is not None and self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            write_state(os.path.join(self._get_output_dir(trial=trial), name), checkpoint_state(self))
        super()._save_checkpoint(model, trial)
