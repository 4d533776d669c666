"""A transformers ``Trainer`` that batches by token budget and survives out-of-memory errors in place.

:class:`TokenBudgetTrainer` trains with a :class:`~tokenbatch.TokenBudgetBatchSampler`
(or a :class:`~tokenbatch.TokenBudgetStream` for an iterable train set),
evaluates with one too, and guards every training step with an
:class:`~tokenbatch.OOMFallback`: on out-of-memory it shrinks the budget on
every rank and carries on from the same batch, with the same optimizer,
scheduler and global step (``auto_find_batch_size`` instead restarts the run).

Trainer's loop is left as it is (transformers 4.50 to 5.x): it runs epochs over
what ``get_train_dataloader`` returns, a group of
``gradient_accumulation_steps`` batches per optimizer step, each batch through
``training_step``. What makes that loop follow a token-budget plan:

- the training loader is a ``BudgetLoader`` (``_feed.py``): each pass is one
  epoch of the sampler's plan in full groups (the last one filled with no-op
  slots), restarted after a re-plan, and it counts the steps trained (what
  checkpoints record); its length is a bound no epoch reaches;
- ``RunProgress`` (``_schedule.py``, a callback) sets ``state.max_steps`` to the
  exact number of optimizer steps of all epochs' plans, ``state.epoch`` from
  the plan, and ends each epoch when its plan is trained; a re-plan changes
  ``max_steps`` and stretches the schedule over the new count;
- ``training_step`` runs each batch under the guard, and swaps a batch read
  ahead before a halve-mode re-plan for the next batch of the new plan;
- ``StepScaling`` (``_lr.py``, a callback, inert unless ``lr_scaling``) scales
  each optimizer step's rate by what trained in it;
- ``CheckpointWriter`` (``_checkpoint.py``, a callback) adds the sampler's
  position and the guard's state to every checkpoint, last (what
  ``last_checkpoint`` looks for);
- ``Preemption`` (``_preempt.py``, a callback, with ``enable_jit_checkpoint``)
  turns a SIGTERM into a checkpoint at the next step on every rank.

No Trainer method with a leading underscore is overridden; what is read of
Trainer's private API lives in :mod:`tokenbatch.integrations._upstream`.
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from tokenbatch import _accelerate, _checks
from tokenbatch.cost import CostModel
from tokenbatch.lengths import column_lengths
from tokenbatch.oom import EvalGuard, Grow, OOMEvent, OOMFallback
from tokenbatch.plan import OVERSIZE_POLICIES
from tokenbatch.sampler import TokenBudgetBatchSampler, is_auto
from tokenbatch.stream import TokenBudgetStream

MIN_TRANSFORMERS = "4.50"
"""The oldest transformers TokenBudgetTrainer is tested with (pyproject.toml's bound; .ci/run tests it)."""

try:
    import torch
    import transformers
    from packaging.version import Version
    from torch import nn
    from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau
    from torch.utils.data import DataLoader, IterableDataset

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"tokenbatch.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, but "
            f"transformers {transformers.__version__} is installed: pip install 'tokenbatch[transformers]'"
        )
    from transformers import Trainer
    from transformers.trainer_utils import EvalLoopOutput, PredictionOutput, TrainOutput

    from tokenbatch.integrations import _upstream
    from tokenbatch.integrations.transformers import _schedule
    from tokenbatch.integrations.transformers._checkpoint import (
        STATE_FILE,
        CheckpointWriter,
        checkpoint_state,
        last_checkpoint,
        read_state,
        sampler_resumes,
    )
    from tokenbatch.integrations.transformers._evaluation import (
        EvalLoss,
        gather_rows,
        inverse_order,
        rank_local_loss,
        real_steps_per_second,
        reorder,
    )
    from tokenbatch.integrations.transformers._feed import (
        BudgetLoader,
        Feed,
        SizedBudgetLoader,
        StreamLoader,
    )
    from tokenbatch.integrations.transformers._layout import layout_cost
    from tokenbatch.integrations.transformers._logs import evaluation_rules, rewritten, training_rules
    from tokenbatch.integrations.transformers._lr import StepScaling
    from tokenbatch.integrations.transformers._preempt import Preemption, wanted
    from tokenbatch.integrations.transformers._schedule import (
        Run,
        RunProgress,
        StretchedSchedule,
        run_length,
    )
    from tokenbatch.integrations.transformers._step import (
        check_supported,
        guarded_backward,
        labelled_items,
        make_fallback,
        share_loss,
    )
    from tokenbatch.probe import auto_budget
except ImportError as error:  # pragma: no cover - the extra is not installed, or too old
    if "needs transformers>=" in str(error):
        raise
    raise ImportError(
        "tokenbatch.integrations.transformers needs transformers and accelerate: "
        "pip install 'tokenbatch[transformers]'"
    ) from error

__all__ = ["TokenBudgetMixin", "TokenBudgetTrainer", "last_checkpoint"]

logger = logging.getLogger(__name__)

OOM_MODES = ("split", "halve")

# The mixin's methods are Trainer's, extended: type-checked as a Trainer subclass.
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class TokenBudgetMixin(_TrainerBase):
    """Token-budget batches and the out-of-memory guard for any ``Trainer`` subclass, put first in its bases.

    ``class MyTrainer(TokenBudgetMixin, SomeTrainer)``: :class:`TokenBudgetTrainer` is
    ``TokenBudgetMixin`` on ``Trainer``, ``tokenbatch.integrations.trl.TokenBudgetSFTTrainer``
    on TRL's ``SFTTrainer``; what follows holds for each.

    A ``Trainer`` whose batches fit a token budget and which recovers from out-of-memory in place.

    Use it as ``Trainer`` (same arguments), with ``max_tokens`` instead of a
    batch size (``per_device_*_batch_size`` and ``group_by_length`` do not
    batch; see ``lr_scaling``). Token lengths come from the datasets as
    ``group_by_length`` reads them: the ``args.length_column_name`` column if
    present, else the tokenizer's first model input (``input_ids``); the
    collator must pad to the longest sequence in a batch (the default with a
    tokenizer), or flatten each batch into one row (padding-free:
    ``transformers.DataCollatorWithFlattening``, TRL's ``padding_free=True``),
    which makes each batch a pack of whole examples costed as one
    (``CostModel(packing=...)``: ``"varlen"`` for flash or flex attention,
    ``"full"`` for eager and sdpa, read from the model). Logs add
    ``max_tokens`` (the budget in force), ``step_samples`` (samples per
    optimizer step, over all ranks and accumulated batches) and ``oom_events``.
    ``train(resume_from_checkpoint=...)`` resumes at the same sample with the
    same budget, also on another number of processes.
    Evaluation and prediction score every example once on any number of
    processes (``predict`` in dataset order), report ``eval_loss`` as the mean
    over examples (or labelled tokens), and survive out-of-memory by splitting
    the batch (``eval_oom_events``; the training budget stays). Works with
    ``accelerate launch`` (DDP); not with DeepSpeed, FSDP or ``DataParallel``
    unless ``oom_mode=None`` (under FSDP2, the accelerate loop of docs/restarts.md guards
    the steps and restarts the job after out-of-memory).

    The out-of-memory options are :class:`~tokenbatch.OOMFallback`'s, with the
    same defaults, prefixed ``oom_`` (Trainer's own arguments share this namespace).

    Args:
        max_tokens: the training budget per batch and rank, in ``cost`` units
            (padded tokens by default); ``"auto"``: resolved by
            :func:`tokenbatch.auto_budget` when the first DataLoader is made
            (the remembered budget, else the probe, on every rank; on CPU
            it needs ``memory_limit``, ``$TOKENBATCH_MEMORY_LIMIT`` or ``RLIMIT_AS``).
        eval_max_tokens: the budget for evaluation and prediction (default
            ``max_tokens``; without gradients it can usually be larger).
        memory_limit: bytes, for ``max_tokens="auto"`` (default: as :func:`~tokenbatch.auto_budget`).
        cost: the memory estimate; None: ``CostModel()``, which counts padded tokens, or
            ``CostModel(packing=...)`` for a collator that flattens (packed tokens, the packing
            of the model's attention). A given cost's ``packing`` must match the collator.
        oom_mode: ``"split"`` runs a batch that ran out of memory as smaller
            micro-batches (same batches and optimizer steps); ``"halve"``
            re-plans the rest of training under a smaller budget (more, smaller
            batches); None: no guard.
        oom_factor: the budget multiplier per out-of-memory event.
        oom_min_tokens: stop with :class:`~tokenbatch.SampleTooLargeError` rather than go below this.
        oom_grow: after an out-of-memory event, try larger budgets again (True, or a
            :class:`~tokenbatch.oom.Grow`; False: shrink only); halve mode re-plans, and the run's
            length and schedule follow. An iterable ``train_dataset`` only shrinks.
        max_batch_size: an optional cap on samples per batch.
        batch_size_multiple: round batch sizes down to a multiple of this.
        oversize: what to do with a sample that alone exceeds the budget, as the
            sampler's: a clear error (default), ``"skip"`` or ``"alone"``.
        lr_scaling: ``"linear"`` or ``"sqrt"``: each optimizer step's learning rate times rule(step size
            / ``lr_reference``), put back after the step for the scheduler (logs add ``lr_scale``, the
            mean multiplier); ``"none"`` (default): unscaled.
        lr_scaling_by: ``"tokens"`` (real tokens) or ``"samples"``, over all ranks and accumulated batches.
        lr_reference: the step size ``learning_rate`` suits; None: ``per_device_train_batch_size`` x
            processes x ``gradient_accumulation_steps`` samples (x the train set's mean length, by tokens).

    Example:
        >>> from tokenbatch.integrations.transformers import TokenBudgetTrainer
        >>> trainer = TokenBudgetTrainer(  # doctest: +SKIP
        ...     model=model, args=TrainingArguments("out", num_train_epochs=3),
        ...     train_dataset=tokenized["train"], eval_dataset=tokenized["validation"],
        ...     processing_class=tokenizer, max_tokens=8192, oom_mode="split",
        ...     lr_scaling="linear")  # learning_rate as set for per_device_train_batch_size
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(
        self,
        *args: Any,
        max_tokens: float | str,
        eval_max_tokens: float | str | None = None,
        memory_limit: float | None = None,
        cost: CostModel | None = None,
        oom_mode: str | None = "split",
        oom_factor: float = 0.5,
        oom_min_tokens: float | None = None,
        oom_grow: bool | Grow = True,
        max_batch_size: int | None = None,
        batch_size_multiple: int = 1,
        oversize: str = "error",
        lr_scaling: str = "none",
        lr_scaling_by: str = "tokens",
        lr_reference: float | None = None,
        **kwargs: Any,
    ) -> None:
        # "auto" stays a string until _budget_dataloader resolves it (then both become that number).
        auto = is_auto(max_tokens)
        self.max_tokens: Any = "auto" if auto else _checks.positive_number("max_tokens", max_tokens)
        if (eval_max_tokens is None and auto) or is_auto(eval_max_tokens):
            self.eval_max_tokens: Any = "auto"
        elif eval_max_tokens is None:
            self.eval_max_tokens = self.max_tokens
        else:
            self.eval_max_tokens = _checks.positive_number("eval_max_tokens", eval_max_tokens)
        self.memory_limit = (
            None if memory_limit is None else _checks.positive_number("memory_limit", memory_limit)
        )
        if cost is not None and not isinstance(cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        self._given_cost = cost
        self.token_cost = CostModel() if cost is None else cost  # settled by _layout_cost() below
        if oom_mode is not None and oom_mode not in OOM_MODES:
            raise ValueError(f"oom_mode should be 'split', 'halve' or None, but got oom_mode={oom_mode!r}")
        self.oom_mode = oom_mode
        self.oom_factor = _checks.shrink_factor("oom_factor", oom_factor)
        self.oom_min_tokens = (
            None if oom_min_tokens is None else _checks.positive_number("oom_min_tokens", oom_min_tokens)
        )
        if not isinstance(oom_grow, bool | Grow):
            raise TypeError(
                f"oom_grow should be True, False or a tokenbatch.oom.Grow, but got oom_grow={oom_grow!r}"
            )
        self.oom_grow = oom_grow
        self.sampler_options: dict[str, Any] = {
            "max_batch_size": max_batch_size,
            "batch_size_multiple": batch_size_multiple,
            "oversize": _checks.one_of("oversize", oversize, OVERSIZE_POLICIES),
        }
        self._sampler: TokenBudgetBatchSampler | TokenBudgetStream | None = None
        self._run: Run | None = None
        self._fallback: OOMFallback | None = None
        self._resume: dict[str, Any] | None = None
        self._test_order: Any = None
        self._eval_loaders: dict[str, Any] = {}  # with dataloader_persistent_workers
        self._loader_samplers: weakref.WeakKeyDictionary[Any, TokenBudgetBatchSampler] = (
            weakref.WeakKeyDictionary()
        )  # what evaluation_loop's log tells of an evaluation loader
        self._eval_guard: EvalGuard | None = None
        self._eval_loss: EvalLoss | None = None
        self._eval_steps: tuple[str, int] | None = None  # the last evaluation's prefix and batches
        self._lr_step = StepScaling(lr_scaling, lr_scaling_by, lr_reference, sampler=lambda: self._sampler)
        super().__init__(*args, **kwargs)
        # On every rank, before any step: Trainer's accelerator training alone on each process of a launch.
        _accelerate.check_processes(self.accelerator.num_processes)
        self.token_cost = self._layout_cost()
        sharded = "DeepSpeed" if self.is_deepspeed_enabled else "FSDP" if self.is_fsdp_enabled else None
        check_supported(self.args, self.oom_mode, sharded=sharded)
        self._lr_step.check(
            deepspeed=bool(self.is_deepspeed_enabled), stream=_is_iterable(self.train_dataset)
        )
        # First: every other callback (the progress bar, the user's) sees the run's true counts.
        progress: tuple[Any, ...] = (CheckpointWriter(self._checkpoint_state), RunProgress(lambda: self._run))
        if wanted(self.args):  # SIGTERM: a checkpoint at the next step on every rank, in Trainer's way
            progress = (*progress, Preemption())
        for callback in (*progress, self._lr_step):  # the rate in force, to callbacks' on_pre_optimizer_step
            self.callback_handler.callbacks.insert(0, callback)

    def _layout_cost(self) -> CostModel:
        """The cost of this trainer's batches: padded rows, or packs where its collator flattens them."""
        return layout_cost(self._given_cost, self.data_collator, self.model)

    # -- what it exposes -------------------------------------------------------------

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

    @property
    def eval_oom_events(self) -> list[OOMEvent]:
        """Every out-of-memory event of evaluation and prediction (each split a batch into micro-batches)."""
        return [] if self._eval_guard is None else list(self._eval_guard.events)

    def train(
        self,
        resume_from_checkpoint: str | bool | None = None,
        trial: Any = None,
        ignore_keys_for_eval: list[str] | None = None,
    ) -> TrainOutput:
        """``Trainer.train``; a checkpoint to resume from must have been saved by TokenBudgetTrainer."""
        self._fallback = self._resume = self._run = None
        checkpoint: Any = resume_from_checkpoint
        if checkpoint is True:  # the newest complete checkpoint (Trainer's choice may be half-written)
            checkpoint = last_checkpoint(str(self.args.output_dir))
            if checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir}): none holds "
                    f"{STATE_FILE}, which TokenBudgetTrainer writes once a checkpoint is complete"
                )
            resume_from_checkpoint = checkpoint
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

    # -- data --------------------------------------------------------------------------

    def _budget_dataloader(
        self, dataset: Any, plain: Callable[[], Any], max_tokens: float, *, training: bool
    ) -> tuple[Any, TokenBudgetBatchSampler]:
        """A DataLoader over ``dataset`` batched by ``max_tokens``, prepared by the accelerator.

        ``plain()`` is Trainer's own DataLoader for ``dataset``: its dataset
        (unused columns removed) and its collator are kept, with the sampler as
        ``batch_sampler``; the sampler yields the global plan, which
        accelerate's ``BatchSamplerShard`` shares out by rank. Evaluation never
        drops a sample (``oversize="alone"``).
        """
        names = getattr(self.processing_class, "model_input_names", None)
        lengths = dataset_lengths(dataset, self.args.length_column_name, names[0] if names else "input_ids")
        options = {**self.sampler_options, **({} if training else {"oversize": "alone"})}
        seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
        sampler = TokenBudgetBatchSampler(
            lengths,
            max_tokens,
            cost=self.token_cost,
            shuffle=training,
            seed=seed,
            num_replicas=self.accelerator.num_processes,
            **options,
        )
        if not sampler.resolved:  # max_tokens="auto": resolve once, before accelerate reads the sampler
            model = cast(nn.Module, self.model)
            budget = auto_budget(model, sampler, memory_limit=self.memory_limit).max_tokens
            self.max_tokens = budget if self.max_tokens == "auto" else self.max_tokens
            self.eval_max_tokens = budget if self.eval_max_tokens == "auto" else self.eval_max_tokens
        base = plain()
        loader_kwargs = loader_options(self.args, training=training)
        loader = DataLoader(base.dataset, batch_sampler=sampler, collate_fn=base.collate_fn, **loader_kwargs)
        prepared = self.accelerator.prepare(loader)
        self._loader_samplers[prepared] = sampler
        return prepared, sampler

    def get_train_dataloader(self) -> Any:
        """What Trainer trains on: a ``BudgetLoader`` over the plan (a ``StreamLoader`` over a stream)."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if _is_iterable(self.train_dataset):  # no lengths up front: a stream per rank
            return self._stream_loader(self.train_dataset)
        loader, sampler = self._budget_dataloader(
            self.train_dataset, super().get_train_dataloader, self.max_tokens, training=True
        )
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
        if self._run.resumed and self._run.max_steps <= self._run.first_step:
            # Resumed where the run ended. Trainer counts the epochs trained as global_step // (its loader's
            # length / accumulation) and, with the bound, would start an epoch and train one step past the
            # end. One group per epoch makes it count every epoch as trained: nothing runs, as in Trainer.
            budget_loader = SizedBudgetLoader(
                loader, sampler, bound=args.gradient_accumulation_steps, **options
            )
            self._run.loader = budget_loader
        return budget_loader

    def _stream_loader(self, dataset: Any) -> StreamLoader:
        """What Trainer trains on for an iterable ``dataset``: a stream per rank.

        Each rank reads its own part and all ranks yield the same number of
        batches (the stream's agreement); as for any iterable, Trainer needs
        ``max_steps``. The stream's DataLoader stays out of ``accelerator.prepare``.
        """
        args = self.args
        if args.max_steps <= 0:
            raise ValueError(
                f"max_steps should be a positive number of optimizer steps with an iterable train_dataset "
                f"(its epochs have no length, so num_train_epochs cannot size the run), but got "
                f"max_steps={args.max_steps}; pass TrainingArguments(max_steps=...)"
            )
        if self._resume is not None:
            raise ValueError(
                "resume_from_checkpoint is not supported yet with an iterable train_dataset (each rank's "
                "stream position would have to be saved per rank); start afresh, or use a map-style dataset"
            )
        names = getattr(self.processing_class, "model_input_names", None) or ["input_ids"]
        columns = getattr(dataset, "column_names", None) or []
        options = {
            "collate_fn": _upstream.collator_without_unused_columns(self, self.data_collator),
            **{k: v for k, v in loader_options(args, training=True).items() if k != "worker_init_fn"},
        }
        stream = TokenBudgetStream(
            dataset,
            self.max_tokens,
            cost=self.token_cost,
            length=args.length_column_name if args.length_column_name in columns else names[0],
            seed=args.data_seed if args.data_seed is not None else args.seed,
            oversize=self.sampler_options["oversize"],
        )
        self._sampler = stream
        main_input = getattr(self.model, "main_input_name", "input_ids")
        loader = DataLoader(stream, batch_size=None, **options)
        stream_loader = StreamLoader(
            loader, stream, accumulation=args.gradient_accumulation_steps, main_input_name=main_input
        )
        self._run = Run(stream_loader, args.max_steps, args.max_steps, resumed=False)
        return stream_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        if eval_dataset is None and self.eval_dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset.")
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        if self.args.dataloader_persistent_workers and key in self._eval_loaders:
            return self._eval_loaders[key]
        if isinstance(eval_dataset, str):
            dataset = cast(dict[str, Any], self.eval_dataset)[eval_dataset]
        else:
            dataset = eval_dataset if eval_dataset is not None else self.eval_dataset
        plain = partial(super().get_eval_dataloader, eval_dataset)
        loader, _ = self._budget_dataloader(dataset, plain, self.eval_max_tokens, training=False)
        if self.args.dataloader_persistent_workers:
            self._eval_loaders[key] = loader
        return loader

    def get_test_dataloader(self, test_dataset: Any) -> Any:
        plain = partial(super().get_test_dataloader, test_dataset)
        loader, sampler = self._budget_dataloader(test_dataset, plain, self.eval_max_tokens, training=False)
        self._test_order = sampler.plan.order.copy()
        return loader

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> LRScheduler:
        if self._run is not None:  # Trainer's count comes from the loader's bound
            num_training_steps = self._run.schedule_length
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        # Metric-driven schedulers (ReduceLROnPlateau, GreedyLR) do not count steps: nothing to stretch.
        stepped = isinstance(scheduler, LRScheduler) and not isinstance(scheduler, ReduceLROnPlateau)
        stepped = stepped and type(scheduler).__name__ != "GreedyLR"
        # Re-plans may add steps (halve) or take some away (growth); a run resumed on another number of
        # processes may have others left.
        stretchable = self.oom_mode is not None or (self._run is not None and self._run.resumed)
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
            restarts = feed.restarts
            if self.oom_mode is None:
                loss = super().training_step(model, batch, num_items_in_batch)
            else:
                loss = self._guarded_step(model, batch, num_items_in_batch, feed)
            if loss is not None:
                self._lr_step.count(batch)  # once, however many micro-batches it ran as
                if step is not None:
                    assert self._run is not None
                    self._run.samples_since_log += feed.mark_trained(step)
                replanned = replanned or feed.restarts != restarts  # growth re-planned after this step
                break
            replanned = True  # halve mode: the rest of the epoch was re-planned from this batch on
            item = feed.next_batch()
        # A run of a fixed number of steps stays that long (a stream's step is never re-planned).
        if replanned and self.args.max_steps <= 0 and isinstance(feed, Feed):
            self._grow_run(feed)
        return loss if loss is not None else torch.zeros((), device=self.args.device)

    def _guarded_step(
        self, model: nn.Module, batch: Any, num_items: torch.Tensor | int | None, feed: Any
    ) -> torch.Tensor | None:
        """``Trainer.training_step`` for one batch, with forward and backward run by the fallback.

        Returns the detached loss, or None when the fallback re-planned the epoch
        (halve mode) instead of training this batch.
        """
        fallback = self._fallback_for(model, feed)
        model.train()
        optimizer: Any = self.optimizer
        if callable(getattr(optimizer, "train", None)):
            optimizer.train()
        batch = _upstream.prepare_inputs(self, batch)
        scaled = getattr(self, "loss_is_scaled_for_ga", None)  # as Trainer.training_step decides it
        if scaled is None:
            scaled = (
                self.model_accepts_loss_kwargs and num_items is not None
            ) or self.compute_loss_func is not None

        def compute(inputs: Any, items: torch.Tensor | float | None) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, inputs, num_items_in_batch=cast(Any, items))
            return cast(torch.Tensor, loss)

        shifts = _upstream.loss_shifts_labels(self)
        divisor = 1 if scaled else self.current_gradient_accumulation_steps
        loss_fn = share_loss(compute, batch, num_items, shifts_labels=shifts, divisor=divisor)
        return guarded_backward(fallback, model, batch, loss_fn)

    def _fallback_for(self, model: nn.Module, feed: Any) -> OOMFallback:
        """The fallback for the model as Trainer wrapped it, following this epoch's feed.

        Made at the first step and kept across re-wraps (its state carried over).
        """
        fallback = self._fallback
        if fallback is None or fallback.model is not model:
            assert self._sampler is not None
            state = fallback.state_dict() if fallback is not None else (self._resume or {}).get("fallback")
            fallback = self._fallback = make_fallback(self, self._sampler, model, state)
        if isinstance(feed, Feed):
            feed.follow(fallback)  # halve mode restarts the feed's DataLoader after a re-plan
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
                "max_tokens=%s: %d optimizer steps instead of %d",
                _checks.budget(sampler.max_tokens),
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
        if self._eval_steps is not None:  # evaluate() logs its metrics, then returns this very dict
            real_steps_per_second(logs, *self._eval_steps)
        super().log(logs, start_time)

    def _checkpoint_state(self) -> dict[str, Any] | None:
        """What ``CheckpointWriter`` adds to a checkpoint of this run (None outside a token-budget run)."""
        if self._run is None or self._sampler is None:
            return None
        loader = self._run.loader
        return checkpoint_state(
            oom_mode=self.oom_mode,
            sampler=self._sampler,
            steps_done=loader.trained if isinstance(loader, BudgetLoader) else 0,
            fallback=self._fallback,
            max_steps=self.state.max_steps,
            schedule_length=self._run.schedule_length,
        )

    # -- evaluation --------------------------------------------------------------------

    def evaluation_loop(
        self,
        dataloader: Any,
        description: str,
        prediction_loss_only: bool | None = None,
        ignore_keys: list[str] | None = None,
        metric_key_prefix: str = "eval",
    ) -> EvalLoopOutput:
        """``Trainer.evaluation_loop`` over batches whose sizes differ between ranks.

        Outputs are gathered row for row (every example once, in the plan's
        order), and ``<prefix>_loss`` is the mean over the items the loss
        averages (samples, or labelled tokens), as one big batch would give it.
        """
        saved = self.gather_function
        if not self.args.eval_use_gather_object:
            self.gather_function = gather_rows(self.accelerator, saved)
        self._eval_loss = losses = EvalLoss(self.args.device)
        if self._eval_guard is not None:
            self._eval_guard.batches = 0  # its events number the batches of this evaluation
        try:
            lines = evaluation_rules(self._loader_samplers.get(dataloader))  # its budget, not a batch size
            with rank_local_loss(self.args), rewritten(lines):
                output = super().evaluation_loop(
                    dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix
                )
        finally:
            self.gather_function, self._eval_loss = saved, None
        # Trainer's <prefix>_steps_per_second counts ceil(examples / per_device_eval_batch_size) steps.
        self._eval_steps = (metric_key_prefix, losses.steps)
        mean = losses.mean(self.accelerator, finite_only=self.args.logging_nan_inf_filter)
        if mean is not None and output.metrics is not None and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = mean
        return output

    def prediction_step(
        self,
        model: nn.Module,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
        """``Trainer.prediction_step``, in micro-batches after out-of-memory (unless ``oom_mode=None``)."""
        step = super().prediction_step

        def predict(part: Any) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
            return step(model, part, prediction_loss_only, ignore_keys=ignore_keys)

        items = labelled_items(self, inputs)
        guard = None if self.oom_mode is None else self._guard_for_eval()
        output = predict(inputs) if guard is None else guard.evaluate(inputs, predict)
        if self._eval_loss is not None:
            self._eval_loss.steps += 1
            if output[0] is not None:
                self._eval_loss.add(output[0], items)
        return output

    def _guard_for_eval(self) -> EvalGuard:
        if self._eval_guard is None:
            self._eval_guard = EvalGuard(
                cost=self.token_cost,
                factor=self.oom_factor,
                min_tokens=self.oom_min_tokens,
                weight=lambda piece: labelled_items(self, piece),  # what the loss averages over
                pad_token_id=getattr(self.processing_class, "pad_token_id", None),
            )
        return self._eval_guard

    def predict(
        self, test_dataset: Any, ignore_keys: list[str] | None = None, metric_key_prefix: str = "test"
    ) -> PredictionOutput:
        """``Trainer.predict``, with predictions and labels put back in dataset order."""
        self._test_order = None
        output = super().predict(test_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        if self._eval_steps is not None and output.metrics is not None:
            real_steps_per_second(output.metrics, *self._eval_steps)
        order, self._test_order = self._test_order, None
        if order is None:
            return output
        index, count = inverse_order(order), len(order)
        return output._replace(
            predictions=reorder(output.predictions, index, count),
            label_ids=reorder(output.label_ids, index, count),
        )


class TokenBudgetTrainer(TokenBudgetMixin, Trainer):
    """A ``Trainer`` whose batches fit a token budget and which recovers from out-of-memory in place.

    :class:`TokenBudgetMixin` on ``transformers.Trainer``: see it for the arguments.

    Example:
        >>> from tokenbatch.integrations.transformers import TokenBudgetTrainer
        >>> trainer = TokenBudgetTrainer(  # doctest: +SKIP
        ...     model=model, args=TrainingArguments("out", num_train_epochs=3),
        ...     train_dataset=tokenized["train"], processing_class=tokenizer, max_tokens=8192)
    """


# -- token lengths and DataLoader options ----------------------------------------------------


def dataset_lengths(dataset: Any, length_column: str, input_name: str) -> np.ndarray:
    """Every example's length, read as ``group_by_length`` reads it.

    A ``datasets.Dataset``: its ``length_column`` if it has one, else the
    lengths of its ``input_name`` sequences. Another map-style dataset:
    ``len(dataset[i][input_name])`` for every ``i``.

    Raises:
        KeyError: neither column exists (the message says how to tokenize).
        TypeError: the dataset is iterable-only or its examples are not dicts.
    """
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"a token budget needs every example's length up front, but got an iterable dataset of type "
            f"{type(dataset).__name__}; use a map-style dataset (datasets.Dataset without streaming=True)"
        )
    columns = getattr(dataset, "column_names", None)
    if isinstance(columns, list):
        column = length_column if length_column in columns else input_name
        if column not in columns:
            raise KeyError(
                f"the dataset has neither a {length_column!r} column (TrainingArguments.length_column_name) "
                f"nor {input_name!r}; its columns are {columns}. Tokenize it first, for example "
                f"dataset.map(lambda rows: tokenizer(rows['text'], truncation=True), batched=True)"
            )
        return column_lengths(dataset, column)
    try:
        return np.asarray([len(dataset[i][input_name]) for i in range(len(dataset))], dtype=np.int64)
    except (KeyError, TypeError, IndexError) as error:
        raise TypeError(
            f"cannot read token lengths: each example should be a dict with {input_name!r} "
            f"(a sequence of token ids), but reading example 0 failed with {error!r}"
        ) from None


def loader_options(args: Any, *, training: bool) -> dict[str, Any]:
    """The DataLoader keywords Trainer's own DataLoaders take from ``TrainingArguments`` ``args``."""
    params: dict[str, Any] = {
        "num_workers": args.dataloader_num_workers,
        "pin_memory": args.dataloader_pin_memory,
        "persistent_workers": args.dataloader_persistent_workers,
        "prefetch_factor": args.dataloader_prefetch_factor,
    }
    for name, option in (
        ("multiprocessing_context", "dataloader_multiprocessing_context"),
        ("in_order", "dataloader_in_order"),
    ):
        if hasattr(args, option):
            params[name] = getattr(args, option)
    if training:
        from transformers.trainer_utils import seed_worker

        params["worker_init_fn"] = partial(
            seed_worker, num_workers=args.dataloader_num_workers, rank=args.process_index
        )
    return params


def _is_iterable(dataset: Any) -> bool:
    """True for a dataset with no ``len`` and no indexing (a torch or ``datasets`` IterableDataset)."""
    return isinstance(dataset, IterableDataset) or not (
        hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")
    )
