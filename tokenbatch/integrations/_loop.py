"""The token-budget training run inside transformers' ``Trainer`` loop (transformers 5).

Trainer's loop runs a count of optimizer steps fixed from
``len(train_dataloader)`` and prefetches a group of
``gradient_accumulation_steps`` batches at a time. :class:`BudgetLoop`
overrides the loop's hooks: the count is a bound the epoch cannot reach, the
epoch ends when the sampler's plan does (the batches come from a
:class:`~tokenbatch.integrations._feed.Feed`), the last group is filled with
no-op slots, and a batch prefetched before a halve-mode re-plan is swapped for
the next batch of the new plan. The scheduler is built for the exact number of
optimizer steps the plans of all epochs make; a halve-mode re-plan adds steps,
and then ``state.max_steps`` grows so that no epoch is cut short and the
schedule is stretched over the extra steps (see
:class:`~tokenbatch.integrations._schedule.StretchedSchedule`). Checkpoints
add where the sampler is and the budget in force; resuming reads them back.

This module is the one that depends on Trainer's private loop methods
(``_run_epoch``, ``get_batch_samples``, ``set_initial_training_values``,
``_init_training_state``); :class:`~tokenbatch.integrations.transformers.TokenBudgetTrainer`
adds the settings, the DataLoaders and the public surface.
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
from transformers import Trainer, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, TrainOutput, get_last_checkpoint

from tokenbatch.integrations import _schedule
from tokenbatch.integrations._checkpoint import checkpoint_state, read_state, write_state
from tokenbatch.integrations._feed import Feed
from tokenbatch.integrations._guard import guarded_backward, make_fallback, share_loss
from tokenbatch.integrations._schedule import EpochProgress, StretchedSchedule, planned_updates
from tokenbatch.oom import OOMFallback
from tokenbatch.sampler import TokenBudgetBatchSampler

logger = logging.getLogger("tokenbatch.integrations.transformers")


class BudgetLoop(Trainer):
    """Trainer's training loop over a token-budget sampler, with each step guarded by an ``OOMFallback``.

    The subclass sets the settings below before calling ``__init__`` and sets
    ``_sampler`` when it builds the training DataLoader.
    """

    max_tokens: float
    oom_mode: str | None
    oom_factor: float
    min_tokens: float | None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
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
        super().__init__(*args, **kwargs)
        self.add_callback(EpochProgress(lambda: self._sampler))

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
        accumulation = args.gradient_accumulation_steps
        per_epoch = planned_updates(self._sampler, 0, self.max_tokens, accumulation)
        if args.max_steps > 0:  # a margin for shorter epochs: the run stops at max_steps anyway
            epochs = math.ceil(args.max_steps / per_epoch * 1.05) + 1
        elif self._resume is not None:
            max_steps = int(self._resume["schedule_length"])
        else:  # exact: the plans are pure functions of (seed, epoch)
            max_steps = sum(
                planned_updates(self._sampler, epoch, self.max_tokens, accumulation)
                for epoch in range(epochs)
            )
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
                loss = self._guarded_step(model, batch, num_items_in_batch)
            if loss is not None:
                if step is not None:
                    self._samples_since_log += feed.mark_trained(step)
                break
            replanned = True  # halve mode: the rest of the epoch was re-planned from this batch on
            feed.restart()
            item = feed.next_batch()
        if replanned and self.args.max_steps <= 0:  # a run of a fixed number of steps stays that long
            self._grow_run(feed)
        return loss if loss is not None else torch.zeros((), device=self.args.device)

    def _guarded_step(
        self, model: nn.Module, batch: Any, num_items: torch.Tensor | int | None
    ) -> torch.Tensor | None:
        """``Trainer.training_step`` for one batch, with forward and backward run by the fallback.

        Returns the detached loss, or None when the fallback re-planned the epoch
        (halve mode) instead of training this batch.
        """
        fallback = self._fallback_for(model)
        model.train()
        optimizer: Any = self.optimizer
        if callable(getattr(optimizer, "train", None)):
            optimizer.train()
        batch = self._prepare_inputs(batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # as Trainer.training_step decides it
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items is not None
            ) or self.compute_loss_func is not None

        def compute(inputs: Any, items: torch.Tensor | float | None) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=cast(Any, items))
            return cast(torch.Tensor, loss)

        shifts = bool(getattr(self, "_loss_shifts_labels", False))
        divisor = 1 if scaled else self.current_gradient_accumulation_steps
        loss_fn = share_loss(compute, batch, num_items, shifts_labels=shifts, divisor=divisor)
        return guarded_backward(fallback, model, batch, loss_fn)

    def _fallback_for(self, model: nn.Module) -> OOMFallback:
        """The fallback for the model as Trainer wrapped it (made at the first step, kept across re-wraps)."""
        fallback = self._fallback
        if fallback is None or fallback.model is not model:
            assert self._sampler is not None
            state = fallback.state_dict() if fallback is not None else (self._resume or {}).get("fallback")
            fallback = self._fallback = make_fallback(self, self._sampler, model, state)
        return fallback

    def _grow_run(self, feed: Feed) -> None:
        """After a re-plan: raise ``state.max_steps`` to the steps now planned and stretch the schedule."""
        sampler = feed.sampler
        total = _schedule.grown_length(
            sampler,
            remaining=feed.remaining_after_pending(),
            global_step=self.state.global_step,
            accumulation=self.args.gradient_accumulation_steps,
            epochs=int(self.args.num_train_epochs),
        )
        if total > self.state.max_steps:
            logger.info(
                "max_tokens=%g: %d optimizer steps instead of %d",
                sampler.max_tokens,
                total,
                self.state.max_steps,
            )
            _schedule.grow_run(self.state, self.lr_scheduler, self.callback_handler.callbacks, total)

    # -- logs and checkpoints -------------------------------------------------------

    def _budget(self) -> float:
        if self._fallback is not None:
            return self._fallback.max_tokens
        return self._sampler.max_tokens if self._sampler is not None else self.max_tokens

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._sampler is not None and "loss" in logs and self.state.global_step > self._logged_step:
            steps = self.state.global_step - self._logged_step
            logs = {
                **logs,
                "max_tokens": self._budget(),
                "step_samples": self._samples_since_log / steps,
                "oom_events": float(0 if self._fallback is None else len(self._fallback.events)),
            }
            self._samples_since_log, self._logged_step = 0, self.state.global_step
        super().log(logs, start_time)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        if self._sampler is not None and self.args.should_save:
            name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
            state = checkpoint_state(
                oom_mode=self.oom_mode,
                sampler=self._sampler,
                fallback=self._fallback,
                max_steps=self.state.max_steps,
                schedule_length=self._schedule_length,
            )
            write_state(os.path.join(self._get_output_dir(trial=trial), name), state)
        super()._save_checkpoint(model, trial)
