"""A transformers ``Trainer`` that batches by token budget and survives out-of-memory errors in place.

:class:`TokenBudgetTrainer` trains with a :class:`~tokenbatch.TokenBudgetBatchSampler`,
evaluates with one too, and guards every training step with an
:class:`~tokenbatch.OOMFallback`: on out-of-memory it shrinks the budget on
every rank and carries on from the same batch, with the same optimizer,
scheduler and global step (``auto_find_batch_size`` instead restarts the run).
Evaluation batches are guarded by an :class:`~tokenbatch.oom.EvalGuard`
(split into micro-batches), and gathered across ranks row for row
(:mod:`tokenbatch.integrations._evaluation`).
How it fits Trainer's loop is :mod:`tokenbatch.integrations._loop`'s business.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any, cast

from tokenbatch import _checks
from tokenbatch._budget import is_auto
from tokenbatch.cost import CostModel
from tokenbatch.oom import MODES, EvalGuard, Grow, OOMEvent
from tokenbatch.plan import OVERSIZE_POLICIES
from tokenbatch.sampler import TokenBudgetBatchSampler

MIN_TRANSFORMERS = "4.50"
"""The oldest transformers TokenBudgetTrainer is tested with (pyproject.toml's bound; .ci/run tests it)."""

try:
    import torch
    import transformers
    from packaging.version import Version
    from torch import nn
    from torch.utils.data import DataLoader

    if Version(transformers.__version__) < Version(MIN_TRANSFORMERS):
        raise ImportError(
            f"tokenbatch.integrations.transformers needs transformers>={MIN_TRANSFORMERS}, but "
            f"transformers {transformers.__version__} is installed: pip install 'tokenbatch[transformers]'"
        )
    from transformers.trainer_utils import EvalLoopOutput, PredictionOutput

    from tokenbatch.integrations._checkpoint import STATE_FILE
    from tokenbatch.integrations._data import budget_sampler, dataset_lengths, loader_options
    from tokenbatch.integrations._evaluation import EvalLoss, gather_rows, rank_local_loss
    from tokenbatch.integrations._feed import inverse_order, reorder
    from tokenbatch.integrations._guard import check_supported, labelled_items
    from tokenbatch.integrations._logs import evaluation_rules, rewritten
    from tokenbatch.integrations._loop import BudgetLoop
    from tokenbatch.integrations._lr import StepScaling
    from tokenbatch.integrations._stream import is_iterable
    from tokenbatch.probe import auto_budget
except ImportError as error:  # pragma: no cover - the extra is not installed, or too old
    if "needs transformers>=" in str(error):
        raise
    raise ImportError(
        "tokenbatch.integrations.transformers needs transformers and accelerate: "
        "pip install 'tokenbatch[transformers]'"
    ) from error

__all__ = ["STATE_FILE", "TokenBudgetTrainer"]

logger = logging.getLogger(__name__)


class TokenBudgetTrainer(BudgetLoop):
    """A ``Trainer`` whose batches fit a token budget and which recovers from out-of-memory in place.

    Use it as ``Trainer`` (same arguments), with ``max_tokens`` instead of a
    batch size (``per_device_*_batch_size`` and ``group_by_length`` do not
    batch; see ``lr_scaling``). Token lengths come from the datasets as in ``group_by_length``:
    the ``args.length_column_name`` column if present, else the tokenizer's
    first model input (``input_ids``); the collator must pad to the longest
    sequence in a batch (the default with a tokenizer). Logs add
    ``max_tokens`` (the budget in force), ``step_samples`` (samples per
    optimizer step, over all ranks and accumulated batches) and ``oom_events``.
    ``train(resume_from_checkpoint=...)`` resumes at the same sample with the
    same budget. Evaluation and prediction score every example once on any
    number of processes (``predict`` in dataset order), report ``eval_loss``
    as the mean over examples (or labelled tokens), and survive out-of-memory
    by splitting the batch (``eval_oom_events``; the training budget stays).
    Works with ``accelerate launch`` (DDP); not with DeepSpeed, FSDP or
    ``DataParallel`` unless ``oom_mode=None``.

    Args:
        max_tokens: the training budget per batch and rank, in ``cost`` units
            (padded tokens by default); ``"auto"``: resolved by
            :func:`tokenbatch.auto_budget` when the first DataLoader is made
            (the remembered budget, else the probe, on every rank; on CPU
            it needs ``memory_limit``, ``$TOKENBATCH_MEMORY_LIMIT`` or ``RLIMIT_AS``).
        eval_max_tokens: the budget for evaluation and prediction (default
            ``max_tokens``; without gradients it can usually be larger).
        memory_limit: bytes, for ``max_tokens="auto"`` (default: as :func:`~tokenbatch.auto_budget`).
        cost: the memory estimate; ``CostModel()`` counts padded tokens.
        oom_mode: ``"split"`` runs a batch that ran out of memory as smaller
            micro-batches (same batches and optimizer steps); ``"halve"``
            re-plans the rest of training under a smaller budget (more, smaller
            batches); None: no guard.
        oom_factor: the budget multiplier per out-of-memory event.
        min_tokens: stop with :class:`~tokenbatch.SampleTooLargeError` rather than go below this budget.
        oom_grow: after an out-of-memory event, try larger budgets again (True, or a
            :class:`~tokenbatch.oom.Grow`); halve mode re-plans, and the run's length and
            schedule follow. False (default): shrink only. Not for an iterable ``train_dataset``.
        max_batch_size: an optional cap on samples per batch.
        batch_size_multiple: round batch sizes down to a multiple of this.
        oversize: what to do with a sample that alone exceeds the budget (see
            the sampler); ``"alone"`` (default) trains it in a batch of its own,
            so a budget shrunk by an out-of-memory event never stops a later epoch.
        lr_scaling: ``"linear"`` or ``"sqrt"``: each optimizer step's learning rate times rule(step size
            / ``lr_reference``), put back after the step for the scheduler (logs add ``lr_scale``, the
            mean multiplier; :mod:`tokenbatch.integrations._lr`); ``"none"`` (default): unscaled.
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
        min_tokens: float | None = None,
        oom_grow: bool | Grow = False,
        max_batch_size: int | None = None,
        batch_size_multiple: int = 1,
        oversize: str = "alone",
        lr_scaling: str = "none",
        lr_scaling_by: str = "tokens",
        lr_reference: float | None = None,
        **kwargs: Any,
    ) -> None:
        # "auto" stays a string until _budget_dataloader resolves it (then both become that number).
        auto = is_auto(max_tokens)
        self.max_tokens: Any = "auto" if auto else _checks.positive_number("max_tokens", max_tokens)
        eval_auto = (eval_max_tokens is None and auto) or is_auto(eval_max_tokens)
        self.eval_max_tokens: Any = (
            "auto" if eval_auto else self.max_tokens if eval_max_tokens is None
            else _checks.positive_number("eval_max_tokens", eval_max_tokens)
        )  # fmt: skip
        self.memory_limit = (
            None if memory_limit is None else _checks.positive_number("memory_limit", memory_limit)
        )
        if cost is not None and not isinstance(cost, CostModel):
            raise TypeError(f"cost should be a tokenbatch.CostModel, but got cost={cost!r}")
        self.token_cost = CostModel() if cost is None else cost
        if oom_mode is not None and oom_mode not in MODES:
            modes = ", ".join(repr(mode) for mode in MODES)
            raise ValueError(f"oom_mode should be {modes} or None, but got oom_mode={oom_mode!r}")
        self.oom_mode = oom_mode
        self.oom_factor = _checks.shrink_factor("oom_factor", oom_factor)
        self.min_tokens = None if min_tokens is None else _checks.positive_number("min_tokens", min_tokens)
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
        self._test_order: Any = None
        self._eval_loaders: dict[str, Any] = {}  # with dataloader_persistent_workers
        self._loader_samplers: weakref.WeakKeyDictionary[Any, TokenBudgetBatchSampler] = (
            weakref.WeakKeyDictionary()
        )  # what evaluation_loop's log tells of an evaluation loader
        self._eval_guard: EvalGuard | None = None
        self._eval_loss: EvalLoss | None = None
        self._lr_step = StepScaling(lr_scaling, lr_scaling_by, lr_reference, sampler=lambda: self._sampler)
        super().__init__(*args, **kwargs)
        sharded = bool(self.is_deepspeed_enabled or self.is_fsdp_enabled)
        check_supported(self.args, self.oom_mode, sharded=sharded)
        self._lr_step.check(deepspeed=bool(self.is_deepspeed_enabled), stream=is_iterable(self.train_dataset))

    # -- what it exposes -------------------------------------------------------------

    # train_sampler, oom_fallback, oom_events: BudgetLoop's (_loop.py)

    @property
    def eval_oom_events(self) -> list[OOMEvent]:
        """Every out-of-memory event of evaluation and prediction (each split a batch into micro-batches)."""
        return [] if self._eval_guard is None else list(self._eval_guard.events)

    # -- data --------------------------------------------------------------------------

    def _budget_dataloader(
        self, dataset: Any, plain: Callable[[], Any], max_tokens: float, *, training: bool
    ) -> tuple[Any, TokenBudgetBatchSampler]:
        """A DataLoader over ``dataset`` batched by ``max_tokens``, prepared by the accelerator.

        ``plain()`` is Trainer's own DataLoader for ``dataset``: its dataset
        (unused columns removed) and its collator are kept, with the sampler as
        ``batch_sampler``; the sampler yields the global plan, which
        accelerate's ``BatchSamplerShard`` shares out by rank.
        """
        names = getattr(self.processing_class, "model_input_names", None)
        lengths = dataset_lengths(dataset, self.args.length_column_name, names[0] if names else "input_ids")
        sampler = budget_sampler(
            lengths,
            max_tokens,
            cost=self.token_cost,
            seed=self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            num_replicas=self.accelerator.num_processes,
            training=training,
            options=self.sampler_options,
        )
        if not sampler.resolved:  # max_tokens="auto": resolve once, before accelerate reads the sampler
            budget = auto_budget(
                cast(nn.Module, self.model), sampler, memory_limit=self.memory_limit
            ).max_tokens
            self.max_tokens = budget if self.max_tokens == "auto" else self.max_tokens
            self.eval_max_tokens = budget if self.eval_max_tokens == "auto" else self.eval_max_tokens
        base = plain()
        options = loader_options(self.args, training=training)
        loader = DataLoader(base.dataset, batch_sampler=sampler, collate_fn=base.collate_fn, **options)
        prepared = self.accelerator.prepare(loader)
        self._loader_samplers[prepared] = sampler
        return prepared, sampler

    def get_train_dataloader(self) -> Any:
        """What Trainer trains on: a :class:`~tokenbatch.integrations._feed.BudgetLoader` over the plan."""
        if self.train_dataset is None:
            raise ValueError("Trainer: training requires a train_dataset.")
        if is_iterable(self.train_dataset):  # no lengths up front: a stream per rank (_stream.py)
            return self._stream_loader(self.train_dataset)
        loader, sampler = self._budget_dataloader(
            self.train_dataset, super().get_train_dataloader, self.max_tokens, training=True
        )
        return self._training_loader(loader, sampler)

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
        if self._eval_loss is not None and output[0] is not None:
            self._eval_loss.add(output[0], items)
        return output

    def _guard_for_eval(self) -> EvalGuard:
        if self._eval_guard is None:
            self._eval_guard = EvalGuard(
                cost=self.token_cost,
                factor=self.oom_factor,
                min_tokens=self.min_tokens,
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
        order, self._test_order = self._test_order, None
        if order is None:
            return output
        index, count = inverse_order(order), len(order)
        return output._replace(
            predictions=reorder(output.predictions, index, count),
            label_ids=reorder(output.label_ids, index, count),
        )
