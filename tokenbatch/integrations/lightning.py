"""Lightning: a :class:`~tokenbatch.TokenBudgetBatchSampler` in a ``LightningModule``, on one process or many.

What Lightning (2.x) does with a batch sampler, and what this module does about it:

- Under DDP with the default ``Trainer(use_distributed_sampler=True)``, Lightning
  rebuilds a custom batch sampler around a ``DistributedSampler`` by calling its
  class as ``cls(sampler, batch_size=..., drop_last=...)``. A token-budget sampler
  plans from lengths, not from a sampler, and shards itself, so this cannot work:
  :class:`TokenBudgetCallback` asks for ``use_distributed_sampler=False`` before
  Lightning fails with a bare ``TypeError``.
- With the replacement off, nothing tells the sampler its rank and every process
  would train every sample: the callback sets each sampler's ``rank`` to the
  trainer's ``global_rank`` in ``setup`` (before ``train_dataloader()`` is called),
  and refuses a sampler it finds in the training DataLoader unsharded.
- Lightning calls ``set_epoch`` on ``dataloader.sampler`` and on
  ``dataloader.batch_sampler.sampler``, never on the batch sampler itself, so every
  epoch would get the same plan: the callback calls ``set_epoch`` at the start of
  each epoch, before Lightning makes that epoch's DataLoader iterator.
- Lightning sizes the training epoch once, from ``len(train_dataloader)`` at
  the start of ``fit``, and ends every epoch when its count of the epoch's
  batches reaches that size; token-budget epochs differ by a few batches (a
  resumed one has only the batches left), so the callback sets the count to
  each epoch's own plan.
- Lightning's checkpoints do not carry a plain DataLoader's position (only a
  "stateful" one's): resumed mid-epoch, it would start the epoch afresh and
  end it after as many batches as were left, the first batches trained twice
  and the last never. The callback saves the training sampler's state at
  Lightning's count of batches trained in ``on_save_checkpoint`` and
  restores it in ``on_load_checkpoint``, so that ``trainer.fit(model,
  ckpt_path=...)`` resumes mid-epoch at the next sample; the resumed epoch is
  as long as the sampler's batches left, so the checkpoint's count of the
  epoch's batches already trained is set back to 0 (``batch_idx`` counts
  from 0 in a resumed epoch).
- Lightning owns the training loop, so the DataLoader cannot be iterated afresh
  after a re-plan: :func:`oom_fallback` gives an :class:`~tokenbatch.OOMFallback`
  in split mode for manual optimisation, and refuses halve mode. The callback
  checkpoints that fallback's state too (its lowered micro-batch budget, events
  and growth bracket), so a resumed run does not find the budget again by
  running out of memory.

Example::

    from tokenbatch.integrations.lightning import TokenBudgetCallback

    sampler = TokenBudgetBatchSampler(lengths, max_tokens=4096, seed=0)
    # in the LightningModule: DataLoader(train_set, batch_sampler=sampler, collate_fn=...)
    trainer = Trainer(devices=2, strategy="ddp", use_distributed_sampler=False,
                      callbacks=[TokenBudgetCallback(sampler)])
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any, cast

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    import lightning.pytorch as pl
except ImportError as error:  # an optional extra: say how to get it
    raise ImportError(
        "tokenbatch.integrations.lightning needs Lightning 2.x (the `lightning` package); install it "
        "with: pip install 'tokenbatch[lightning]'"
    ) from error

from tokenbatch import OOMFallback, TokenBudgetBatchSampler, _accelerate
from tokenbatch.integrations import _upstream

__all__ = ["TokenBudgetCallback", "oom_fallback"]

_FALLBACK_KEY = "tokenbatch_fallback"


class TokenBudgetCallback(pl.Callback):
    """Shards token-budget samplers across Lightning's processes and gives every epoch its own plan.

    Args:
        *samplers: the :class:`~tokenbatch.TokenBudgetBatchSampler` of each
            DataLoader that uses one (training, and validation or test if they
            do), made before ``trainer.fit``. In ``setup`` each one is given the
            trainer's ``global_rank``, so that it yields only this process's
            batches. A sampler made later, inside ``train_dataloader()``, needs
            ``rank=self.trainer.global_rank`` there; the callback finds it in the
            training DataLoader and calls its ``set_epoch`` too.

    Checkpoints hold the training sampler's position: ``trainer.fit(model,
    ckpt_path=...)`` resumes with exactly the samples not yet trained, on any
    number of processes; mid-epoch this needs the training sampler passed here.
    They hold the state of the fallback :func:`oom_fallback` made too (it
    tells the trainer's ``TokenBudgetCallback``): the resumed run's fallback
    starts from the saved micro-batch budget, events and growth bracket.

    On several processes it needs ``Trainer(use_distributed_sampler=False)``
    and raises a ``ValueError`` in ``setup`` without it. Validation and test
    DataLoaders are then not sharded by Lightning either: give them a
    ``TokenBudgetBatchSampler(..., shuffle=False)`` passed to this callback
    (every sample scored exactly once), or a ``DistributedSampler`` of your own.
    """

    def __init__(self, *samplers: TokenBudgetBatchSampler) -> None:
        for sampler in samplers:
            if not isinstance(sampler, TokenBudgetBatchSampler):
                raise TypeError(
                    f"samplers should be tokenbatch.TokenBudgetBatchSampler objects, but got a "
                    f"{type(sampler).__name__}"
                )
        self.samplers = list(samplers)
        self._resumed = (-1, 0)  # (epoch, its steps trained before this fit): counted in checkpoints
        self.fallback: OOMFallback | None = None
        """The fallback whose state checkpoints hold (set by :func:`oom_fallback`)."""
        self._fallback_state: dict[str, Any] | None = None  # loaded, for the fallback not yet made
        self._unmute: Callable[[], None] = lambda: None  # Lightning's resume warning, muted on a resume

    def attach(self, fallback: OOMFallback) -> None:
        """Checkpoint ``fallback``'s state from now on; a state loaded from a checkpoint is resumed into it.

        :func:`oom_fallback` calls it; call it yourself for an ``OOMFallback`` made otherwise.
        """
        self.fallback = fallback
        state, self._fallback_state = self._fallback_state, None
        if state is not None:
            fallback._load_own_state(state)  # the sampler was resumed in on_load_checkpoint

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        world = trainer.world_size
        if world > 1 and _upstream.lightning_replaces_samplers(trainer):
            raise ValueError(
                f"use_distributed_sampler should be False for TokenBudgetBatchSampler on {world} "
                f"processes, but got use_distributed_sampler=True (the Trainer's default): Lightning "
                f"would rebuild the sampler around a DistributedSampler as TokenBudgetBatchSampler("
                f"sampler, batch_size=..., drop_last=...), which fails, and the sampler shards itself. "
                f"Pass Trainer(..., use_distributed_sampler=False) and keep TokenBudgetCallback in "
                f"callbacks; shard any other validation or test DataLoader yourself (for example with "
                f"DistributedSampler(dataset, shuffle=False))"
            )
        for sampler in self.samplers:
            _shard(sampler, trainer)
            # Now, not at the epoch's start: Lightning makes the first epoch's DataLoader iterator
            # (and its workers read ahead) before any epoch hook, and a sampler used by an
            # earlier fit would still be at that fit's last epoch.
            sampler.set_epoch(trainer.current_epoch)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for sampler in _samplers_in(trainer.train_dataloader):
            if sampler not in self.samplers:
                _check_sharded(sampler, trainer)
        self._start_epoch(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # From the second epoch on, Lightning calls this before it makes the epoch's iterator.
        self._start_epoch(trainer)

    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        epoch, steps = self._resumed
        offset = steps if epoch == trainer.current_epoch else 0
        training = list(_samplers_in(trainer.train_dataloader))
        state = _save(trainer, self.samplers, training, offset)
        if state is not None:
            checkpoint[_KEY] = state
        if self.fallback is not None:
            fallback = self.fallback.state_dict()
            if state is not None and self.fallback.sampler in training:
                fallback["sampler"] = state["sampler"]  # one position: Lightning's count, which is the loop's
            checkpoint[_FALLBACK_KEY] = fallback
        elif self._fallback_state is not None:  # loaded, and no fallback made yet: keep it for the next run
            checkpoint[_FALLBACK_KEY] = self._fallback_state

    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning calls this after setup and before it asks for the training DataLoader.
        self._resumed = _load(checkpoint, self.samplers)
        if self._resumed[0] >= 0:  # the sampler is where training stopped: Lightning's warning is wrong
            self._unmute = _mute_not_resumable_warning()
        state = checkpoint.get(_FALLBACK_KEY)
        if state is not None:
            if self.fallback is not None:  # made before this fit: resume it now
                self.fallback._load_own_state(state)
            else:  # the fallback is made later (on_train_start, training_step): attach() resumes it
                self._fallback_state = state

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._unmute()  # Lightning has warned, or not, by the first batch

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._unmute()

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._unmute()
        if self._fallback_state is not None and trainer.global_rank == 0:
            warnings.warn(
                "the checkpoint held an OOMFallback's state (its lowered budget), but no fallback was "
                "made through tokenbatch.integrations.lightning.oom_fallback in this run, so it was not "
                "resumed; make the fallback with oom_fallback(self, sampler) or call "
                "TokenBudgetCallback.attach(fallback)",
                stacklevel=2,
            )

    def _start_epoch(self, trainer: pl.Trainer) -> None:
        found = [s for s in _samplers_in(trainer.train_dataloader) if s not in self.samplers]
        for sampler in [*self.samplers, *found]:
            sampler.set_epoch(trainer.current_epoch)
        _size_epoch(trainer)


def oom_fallback(module: pl.LightningModule, sampler: TokenBudgetBatchSampler, **options: Any) -> OOMFallback:
    """An :class:`~tokenbatch.OOMFallback` for a ``LightningModule``'s manual optimisation.

    Make it once the trainer has set its strategy up (in ``on_train_start``, or at
    the first ``training_step``); then in ``training_step``::

        opt = self.optimizers()
        loss = self.fallback.backward(batch, lambda b: self.net(**b).loss)
        self.fallback.step(opt)  # opt.step(), guarded like the passes
        opt.zero_grad()

    The fallback guards ``self.trainer.strategy.model`` (DDP-wrapped on several
    processes): it runs forward and backward under DDP's ``no_sync()``, with the
    backward pass through ``module.manual_backward`` as in any manual step (so
    Lightning's precision plugin and backward hooks see it), and averages
    the gradients itself once every rank has succeeded. On out-of-memory, the
    planned batch is run again as micro-batches; no sample is lost or repeated.

    Args:
        module: the ``LightningModule``, with ``self.automatic_optimization = False``.
        sampler: the training DataLoader's :class:`~tokenbatch.TokenBudgetBatchSampler`.
        options: :class:`~tokenbatch.OOMFallback`'s keyword options, with its defaults
            (``factor``, ``min_tokens``, ``grow``, ``weight``, ...); only ``mode="split"``
            works under Lightning.

    The trainer's :class:`TokenBudgetCallback` is told of the fallback
    (:meth:`TokenBudgetCallback.attach`): checkpoints carry its state, and one
    resumed from a checkpoint starts from the saved budget.

    Raises:
        ValueError: automatic optimisation, halve mode, or a strategy other than
            DDP on several processes (under FSDP and DeepSpeed out of memory in the passes leaves the
            other ranks inside the strategy's collectives; docs/restarts.md has an FSDP2 loop).
    """
    if module.automatic_optimization:
        raise ValueError(
            "automatic_optimization should be False for OOMFallback, but got automatic_optimization=True: "
            "the fallback runs the backward pass itself (again, as micro-batches, after running out of "
            "memory). Set self.automatic_optimization = False in __init__ and step in training_step: "
            "loss = fallback.backward(batch, loss_fn); fallback.step(opt); opt.zero_grad()"
        )
    trainer = module.trainer
    model = trainer.strategy.model
    if model is None:
        raise ValueError(
            "the trainer's strategy has no model yet; make the fallback in on_train_start or in training_step"
        )
    if trainer.world_size > 1 and not isinstance(model, DistributedDataParallel):
        raise ValueError(
            f"strategy should be DDP (strategy='ddp' or 'ddp_spawn') for OOMFallback on "
            f"{trainer.world_size} processes, but got strategy={type(trainer.strategy).__name__}: under "
            f"FSDP and DeepSpeed the model's passes hold the strategy's collectives, so out of memory on one "
            f"rank cannot be recovered from in place, and Lightning's callback does not restart the job "
            f"from a checkpoint with a lowered budget (the accelerate loop of docs/restarts.md does, under "
            f"FSDP2)"
        )
    if options.get("mode", "split") != "split":
        raise ValueError(
            f"mode should be 'split' under Lightning, but got mode={options['mode']!r}: halve mode re-plans "
            f"the rest of the epoch, which needs the DataLoader iterated afresh (OOMFallback.iterate), "
            f"and Lightning owns the training loop (it would end the epoch early, on batches fetched from "
            f"the old plan). Use mode='split': it keeps every planned batch and runs one that does not "
            f"fit as micro-batches"
        )
    fallback = OOMFallback(sampler, model, accelerator=_ManualBackward(module), **options)
    for callback in trainer.callbacks:  # type: ignore[attr-defined]
        if isinstance(callback, TokenBudgetCallback):
            callback.attach(fallback)
    return fallback


class _ManualBackward:
    """What :class:`~tokenbatch.OOMFallback` uses of an accelerator, done the Lightning way."""

    sync_gradients = True  # the fallback averages gradients after every successful step

    def __init__(self, module: pl.LightningModule) -> None:
        self.module = module

    def backward(self, loss: torch.Tensor) -> None:
        self.module.manual_backward(loss)


def _shard(sampler: TokenBudgetBatchSampler, trainer: pl.Trainer) -> None:
    """Make ``sampler`` yield only this process's batches (nothing to do on one process)."""
    if trainer.world_size > 1 and sampler.rank is None:
        sampler.rank = trainer.global_rank
    _check_sharded(sampler, trainer)


def _check_sharded(sampler: TokenBudgetBatchSampler, trainer: pl.Trainer) -> None:
    world, rank = trainer.world_size, trainer.global_rank
    if sampler.num_replicas != world:
        raise ValueError(
            f"num_replicas should be the trainer's world_size={world}, but got "
            f"num_replicas={sampler.num_replicas}; leave it unset (it is read from the process group)"
        )
    if world > 1 and sampler.rank is None:
        raise ValueError(
            f"rank should be set on the training DataLoader's TokenBudgetBatchSampler on {world} "
            f"processes, but got rank=None: every process would train every sample. Make the sampler "
            f"before trainer.fit and pass it to TokenBudgetCallback(sampler), or build it with "
            f"rank=self.trainer.global_rank in train_dataloader()"
        )
    if sampler.rank is not None and sampler.rank != rank:
        raise ValueError(
            f"rank should be this process's global_rank={rank}, but got rank={sampler.rank}; "
            f"leave it unset and let TokenBudgetCallback set it"
        )


def _samplers_in(loaders: Any) -> Iterator[TokenBudgetBatchSampler]:
    """Every TokenBudgetBatchSampler feeding ``loaders`` (a DataLoader, or a dict or list of them)."""
    if isinstance(loaders, Mapping):
        for value in loaders.values():
            yield from _samplers_in(value)
    elif isinstance(loaders, (list, tuple)):
        for value in loaders:
            yield from _samplers_in(value)
    else:  # a DataLoader -> a wrapper's batch sampler -> ... (a few levels at most)
        found = [s for s in _accelerate.batch_samplers(loaders) if isinstance(s, TokenBudgetBatchSampler)]
        yield from found[:1]


# -- how Lightning's fit loop counts a token-budget epoch, and where a checkpoint is ----------

_KEY = "tokenbatch"
_PROGRESS = ("epoch_loop.batch_progress", "current")
_COUNTERS = ("ready", "started", "processed", "completed")
# Lightning 2.x's warning for a mid-epoch resume with a DataLoader it cannot checkpoint itself.
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def _trained_batches(trainer: Any) -> int:
    """Batches of the current epoch trained so far, as Lightning counts them (a resumed epoch from 0)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def _save(
    trainer: Any,
    samplers: list[TokenBudgetBatchSampler],
    training: list[TokenBudgetBatchSampler],
    offset: int,
) -> dict[str, Any] | None:
    """What to put in a checkpoint: the training sampler's state at the batches trained (None: no sampler).

    ``samplers``: the callback's; ``training``: those feeding the training
    DataLoader; ``offset``: steps of the epoch's plan trained before Lightning's
    count of this epoch started (a resumed epoch's).
    """
    if not training:
        return None
    if len(training) > 1:
        raise ValueError(
            f"training DataLoaders should have one TokenBudgetBatchSampler to checkpoint its position, "
            f"but got {len(training)}: Lightning cycles several training DataLoaders, so no one count of "
            f"trained batches fits them all"
        )
    (sampler,) = training
    lightning = _trained_batches(trainer)
    steps = offset + lightning
    return {
        "index": samplers.index(sampler) if sampler in samplers else None,
        "sampler": sampler.state_dict(steps_done=steps),
        "lightning_batches": lightning,
        "mid_epoch": 0 < steps < sampler.plan.num_steps,
    }


def _load(checkpoint: dict[str, Any], samplers: list[TokenBudgetBatchSampler]) -> tuple[int, int]:
    """Restore the saved training sampler; returns ``(epoch, steps of it trained)``, ``(-1, 0)``: none.

    Raises:
        ValueError: the checkpoint is mid-epoch and its sampler was not given to the callback.
    """
    saved = checkpoint.get(_KEY)
    if saved is None:  # saved without TokenBudgetCallback, or without a token-budget training sampler
        return -1, 0
    index, state = saved["index"], saved["sampler"]
    if index is None or not 0 <= index < len(samplers):
        if not saved["mid_epoch"]:  # Lightning starts the next epoch, or this one, afresh
            return -1, 0
        raise ValueError(
            "TokenBudgetCallback should be given the training sampler to resume mid-epoch, but got "
            f"TokenBudgetCallback with {len(samplers)} sampler(s) and a checkpoint from step "
            f"{state['steps_done']} of epoch {state['epoch']}: Lightning sizes the epoch before it calls "
            "train_dataloader(), so a sampler made there cannot resume in time. Make the sampler before "
            "trainer.fit and pass it: TokenBudgetCallback(sampler)"
        )
    sampler = samplers[index]
    sampler.load_state_dict(state)
    if len(sampler) == 0:  # saved at the epoch's end: Lightning goes on with the next epoch
        sampler.set_epoch(sampler.epoch + 1)
        return -1, 0
    progress = checkpoint["loops"]["fit_loop"]
    for key in _PROGRESS:
        progress = progress[key]
    for counter in _COUNTERS:  # the resumed epoch is as long as the sampler's batches left
        progress[counter] -= saved["lightning_batches"]
    return sampler.epoch, sampler.start_step


def _size_epoch(trainer: Any) -> None:
    """Make Lightning's count of the epoch's training batches the training DataLoader's length now."""
    loop = trainer.fit_loop
    combined = _upstream.lightning_combined_loader(loop)
    flattened = getattr(combined, "flattened", None)
    if combined is None or not isinstance(flattened, list) or len(flattened) != 1:
        return  # several loaders (cycled): Lightning's counts stand
    if trainer.limit_train_batches != 1.0:
        return  # the user's own limit
    if not hasattr(loop, "max_batches") or loop.max_batches == float("inf"):
        return
    length = len(flattened[0])
    combined.limits = [length]  # what the data fetcher reads when the epoch's iterator is made
    loop.max_batches = length
    interval = trainer.val_check_interval
    if isinstance(interval, float) and trainer.val_check_batch not in (None, float("inf")):
        trainer.val_check_batch = max(1, int(length * interval))  # as Lightning sets it up


def _mute_not_resumable_warning() -> Callable[[], None]:
    """Mute Lightning's "your dataloader is not resumable" warning; returns what unmutes it.

    Lightning warns at the start of a fit resumed mid-epoch when the training
    DataLoader is not "stateful". A plain DataLoader over a token-budget sampler
    is not, but the sampler's position came back from the checkpoint, so the
    resumed epoch has exactly the samples not yet trained and the warning would
    be wrong. Muted from the checkpoint's load to the first training batch only.
    """
    warnings.filterwarnings("ignore", message=re.escape(_NOT_RESUMABLE), category=UserWarning)
    entry = warnings.filters[0]

    def unmute() -> None:
        filters = cast(list[Any], warnings.filters)  # a list in CPython; typeshed says Sequence
        if entry in filters:
            filters.remove(entry)  # this entry only: filters the user set meanwhile stay
            _upstream.warnings_changed()  # as warnings.filterwarnings does after a change

    return unmute
