"""The token-budget training run inside transformers' ``Trainer`` loop, through its public extension points.

Trainer's loop is left as it is (transformers 4.50 to 5.x): it runs epochs over
what ``get_train_dataloader`` returns, a group of
``gradient_accumulation_steps`` batches per optimizer step, each batch through
``training_step``. The pieces that make that loop follow a token-budget plan:

- the training loader is a :class:`~tokenbatch.integrations._feed.BudgetLoader`:
  each pass is one epoch of the sampler's plan in full groups (the last one
  filled with no-op slots), re-plan-aware, and its length is a bound no epoch
  reaches (no length with ``max_steps``);
- :class:`~tokenbatch.integrations._schedule.RunProgress` (a callback) sets
  ``state.max_steps`` to the exact number of optimizer steps of all epochs'
  plans, ``state.epoch`` from the plan, and ends each epoch when its plan is trained;
- ``create_scheduler`` builds the schedule for that exact count; a halve-mode
  re-plan adds steps, and then ``state.max_steps`` grows so that no epoch is
  cut short and the schedule is stretched over the extra steps (see
  :class:`~tokenbatch.integrations._schedule.StretchedSchedule`);
- ``training_step`` runs each batch under the :class:`~tokenbatch.OOMFallback`,
  and swaps a batch prefetched before a halve-mode re-plan for the next batch of the new plan;
- :class:`~tokenbatch.integrations._lr.StepScaling` (a callback, inert unless ``lr_scaling``
  is on) scales each optimizer step's rate by what ``training_step`` reports trained;
- :class:`~tokenbatch.integrations._checkpoint.CheckpointWriter` (a callback)
  adds where the sampler is and the budget in force to every checkpoint;
  ``train(resume_from_checkpoint=...)`` reads them back, with Trainer's own
  batch skipping off (the sampler starts at the next sample).

No Trainer method with a leading underscore is overridden. What remains
private: the guarded step calls ``Trainer._prepare_inputs`` (as
``training_step`` does) and reads ``_loss_shifts_labels`` where it exists
(transformers 5; 4.x counts labelled items unshifted), and a re-plan resizes
the progress bar's ``training_bar``.
:class:`~tokenbatch.integrations.transformers.TokenBudgetTrainer` adds the
settings, the DataLoaders, evaluation and the public surface.
"""

from __future__ import annotations

import logging
import os
from typing import Any, cast

import torch
from torch import nn
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
from transformers import Trainer
from transformers.trainer_utils import TrainOutput, get_last_checkpoint

from tokenbatch.cost import CostModel
from tokenbatch.integrations import _schedule
from tokenbatch.integrations._checkpoint import (
    CheckpointWriter,
    checkpoint_state,
    read_state,
    sampler_resumes,
)
from tokenbatch.integrations._data import loader_options
from tokenbatch.integrations._feed import BudgetLoader, Feed, SizedBudgetLoader
from tokenbatch.integrations._guard import guarded_backward, make_fallback, share_loss
from tokenbatch.integrations._logs import rewritten, training_rules
from tokenbatch.integrations._lr import StepScaling
from tokenbatch.integrations._schedule import Run, RunProgress, StretchedSchedule, run_length
from tokenbatch.integrations._stream import StreamLoader, check_max_steps, stream_dataloader
from tokenbatch.oom import Grow, OOMEvent, OOMFallback
from tokenbatch.sampler import TokenBudgetBatchSampler
from tokenbatch.stream import TokenBudgetStream

logger = logging.getLogger("tokenbatch.integrations.transformers")


class BudgetLoop(Trainer):
    """Trainer's training loop over a token-budget sampler, with each step guarded by an ``OOMFallback``.

    The subclass sets the settings below before calling ``__init__``, and
    passes its training DataLoader through ``_training_loader``.
    """

    max_tokens: float
    oom_mode: str | None
    oom_factor: float
    min_tokens: float | None
    oom_grow: bool | Grow
    token_cost: CostModel
    sampler_options: dict[str, Any]
    _lr_step: StepScaling

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._sampler: TokenBudgetBatchSampler | TokenBudgetStream | None = None
        self._run: Run | None = None
        self._fallback: OOMFallback | None = None
        self._resume: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        # First: every other callback (the progress bar, the user's) sees the run's true counts.
        progress = (CheckpointWriter(self._checkpoint_state), RunProgress(lambda: self._run))
        for callback in (*progress, self._lr_step):  # the rate in force, to callbacks' on_pre_optimizer_step
            self.callback_handler.callbacks.insert(0, callback)

    @property
    def train_sampler(self) -> TokenBudgetBatchSampler | TokenBudgetStream | None:
        """The training DataLoader's sampler, or the stream of an iterable train set."""
        return self._sampler

    @property
    def oom_fallback(self) -> OOMFallback | None:
        """The out-of-memory guard (created at the first training step)."""
        return self._fallback

    @property
    def oom_events(self) -> list[OOMEvent]:
        """Every out-of-memory event of this run (resumed runs included)."""
        return [] if self._fallback is None else list(self._fallback.events)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """``Trainer.train``; a checkpoint to resume from must have been saved by TokenBudgetTrainer."""
        self._fallback = self._resume = self._run = None
        checkpoint: Any = resume_from_checkpoint
        if checkpoint is True:
            # None: Trainer raises its own error below
            checkpoint = get_last_checkpoint(self.args.output_dir)  # type: ignore[no-untyped-call]
        if isinstance(checkpoint, str | os.PathLike):
            self._resume = read_state(os.fspath(checkpoint), self.oom_mode)
            if self.args.ignore_data_skip:
                logger.warning("ignore_data_skip=True is ignored: the sampler resumes at the next sample")
        epochs = int(self.args.num_train_epochs) if self.args.max_steps <= 0 else 0
        lines = training_rules(
            lambda: self._run, accumulation=self.args.gradient_accumulation_steps, epochs=epochs
        )
        resumes = sampler_resumes(self.args, self._resume is not None)
        with resumes, rewritten(lines), self._lr_step.restoring():
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval)

    def _training_loader(self, loader: Any, sampler: TokenBudgetBatchSampler) -> BudgetLoader:
        """What Trainer trains on: ``loader`` (the prepared DataLoader over ``sampler``) as a BudgetLoader."""
        if self._resume is not None:
            sampler.load_state_dict(self._resume["sampler"])
            if len(sampler) == 0:  # saved at the end of an epoch: resume at the start of the next
                sampler.set_epoch(sampler.epoch + 1)
        self._sampler = sampler
        args = self.args
        options: dict[str, Any] = {
            "accumulation": args.gradient_accumulation_steps,
            "main_input_name": getattr(self.model, "main_input_name", "input_ids"),
        }
        if args.max_steps > 0:  # no length: Trainer runs epochs until max_steps
            budget_loader = BudgetLoader(loader, sampler, **options)
        else:  # more batches than all epochs hold: Trainer counts its epochs from 0 even when resuming
            bound = args.gradient_accumulation_steps * (int(args.num_train_epochs) * len(sampler.lengths) + 1)
            budget_loader = SizedBudgetLoader(loader, sampler, bound=bound, **options)
        self._run = run_length(budget_loader, args, self.max_tokens, self._resume)
        return budget_loader

    def _stream_loader(self, dataset: Any) -> StreamLoader:
        """What Trainer trains on for an iterable ``dataset``: a stream per rank (``_stream.py``)."""
        args = self.args
        check_max_steps(args)
        if self._resume is not None:
            raise ValueError(
                "resume_from_checkpoint is not supported yet with an iterable train_dataset (each rank's "
                "stream position would have to be saved per rank); start afresh, or use a map-style dataset"
            )
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        columns = getattr(dataset, "column_names", None) or []
        options = {
            "collate_fn": self._get_collator_with_removed_columns(self.data_collator, description="training"),
            **{k: v for k, v in loader_options(args, training=True).items() if k != "worker_init_fn"},
        }
        loader, stream = stream_dataloader(
            dataset, self.max_tokens, cost=self.token_cost,
            length=args.length_column_name if args.length_column_name in columns else names[0],
            seed=args.data_seed if args.data_seed is not None else args.seed,
            oversize=self.sampler_options["oversize"], options=options,
        )  # fmt: skip
        self._sampler = stream
        main_input = getattr(self.model, "main_input_name", "input_ids")
        stream_loader = StreamLoader(
            loader, stream, accumulation=args.gradient_accumulation_steps, main_input_name=main_input
        )
        self._run = Run(stream_loader, args.max_steps, args.max_steps, resumed=False)
        return stream_loader

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> LRScheduler:
        if self._run is not None:  # Trainer's count comes from the loader's bound
            num_training_steps = self._run.schedule_length
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # Metric-driven schedulers (ReduceLROnPlateau, GreedyLR) do not count steps: nothing to stretch.
        stepped = isinstance(scheduler, LRScheduler) and not isinstance(scheduler, ReduceLROnPlateau)
        stepped = stepped and type(scheduler).__name__ != "GreedyLR"
        # Halve mode may add steps; a run resumed on another number of processes may have others left.
        stretchable = self.oom_mode == "halve" or (self._run is not None and self._run.resumed)
        if stretchable and self.args.max_steps <= 0 and stepped:
            self.lr_scheduler = cast(Any, StretchedSchedule(scheduler, num_training_steps))
        return cast(LRScheduler, self.lr_scheduler)

    # -- the training step -----------------------------------------------------------

    def training_step(
        self,
        model: nn.Module,
        inputs: dict[str, torch.Tensor | Any],
        num_items_in_batch: torch.Tensor | int | None = None,
    ) -> torch.Tensor:
        feed = None if self._run is None else self._run.loader.feed
        if feed is None:
            self._lr_step.count(inputs)
            return super().training_step(model, inputs, num_items_in_batch)
        item = feed.resolve(inputs)
        self.current_gradient_accumulation_steps = feed.group_size  # real batches, not padding slots
        replanned = False
        loss = None
        while item is not None:
            batch, step = item
            generation = feed.sampler.position.generation if isinstance(feed, Feed) else 0
            if self.oom_mode is None:
                loss = super().training_step(model, batch, num_items_in_batch)
            else:
                loss = self._guarded_step(model, batch, num_items_in_batch)
            if loss is not None:
                self._lr_step.count(batch)  # once, however many micro-batches it ran as
                if step is not None:
                    assert self._run is not None
                    self._run.samples_since_log += feed.mark_trained(step)
                if isinstance(feed, Feed) and feed.sampler.position.generation != generation:
                    # Halve mode grew the budget after this step: the rest of the epoch is a new plan.
                    replanned = True
                    feed.restart()
                break
            replanned = True  # halve mode: the rest of the epoch was re-planned from this batch on
            feed.restart()
            item = feed.next_batch()
        # A run of a fixed number of steps stays that long (a stream's step is never re-planned).
        if replanned and self.args.max_steps <= 0 and isinstance(feed, Feed):
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
        """After a re-plan: make ``state.max_steps`` the steps now planned and stretch the schedule to it."""
        sampler = feed.sampler
        total = _schedule.grown_length(
            sampler,
            remaining=feed.remaining_after_pending(),
            global_step=self.state.global_step,
            accumulation=self.args.gradient_accumulation_steps,
            epochs=int(self.args.num_train_epochs),
        )
        if total != self.state.max_steps:  # more steps after a halving, fewer after growth
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
        run = self._run
        if run is not None and "loss" in logs and self.state.global_step > run.logged_step:
            steps = self.state.global_step - run.logged_step
            logs = {
                **logs,
                "max_tokens": self._budget(),
                "step_samples": run.samples_since_log / steps,
                "oom_events": float(0 if self._fallback is None else len(self._fallback.events)),
                **self._lr_step.pop_logs(),
            }
            run.samples_since_log, run.logged_step = 0, self.state.global_step
        super().log(logs, start_time)

    def _checkpoint_state(self) -> dict[str, Any] | None:
        """What ``CheckpointWriter`` adds to a checkpoint of this run (None outside a token-budget run)."""
        if self._run is None or self._sampler is None:
            return None
        return checkpoint_state(
            oom_mode=self.oom_mode,
            sampler=self._sampler,
            fallback=self._fallback,
            max_steps=self.state.max_steps,
            schedule_length=self._run.schedule_length,
        )
