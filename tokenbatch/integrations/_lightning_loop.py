"""How Lightning's fit loop counts a token-budget epoch: its length, each epoch, and where a checkpoint is.

Lightning (2.x) sizes the training epoch once, from ``len(train_dataloader)``
at the start of ``fit``, and ends every epoch when its count of the epoch's
batches reaches that size; token-budget epochs differ by a few batches (and a
resumed one has only the batches left), so :func:`size_epoch` sets the count
to the epoch's own plan each epoch (a later, longer epoch was cut short).

Lightning checkpoints its loops' counters but not a plain DataLoader's
position (only a "stateful" DataLoader's, such as torchdata's). Resumed
mid-epoch, it would start the epoch's DataLoader afresh and end the epoch
after as many batches as were left: the epoch's first batches trained twice,
its last ones never. :class:`TokenBudgetCallback
<tokenbatch.integrations.lightning.TokenBudgetCallback>` saves the training
sampler's state (:func:`save`) and restores it (:func:`load`); the resumed
epoch is then as long as the sampler's batches left, so the checkpoint's count
of the epoch's batches already trained is set back to 0. The only visible
difference: ``batch_idx`` in the resumed epoch counts from 0.

The counts live on Lightning's fit loop (``max_batches``, the combined
loader's ``limits``, ``trainer.val_check_batch``); where a later release moves
them, :func:`size_epoch` changes nothing.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable
from typing import Any, cast

from tokenbatch.sampler import TokenBudgetBatchSampler

KEY = "tokenbatch"
_PROGRESS = ("epoch_loop.batch_progress", "current")
_COUNTERS = ("ready", "started", "processed", "completed")
# Lightning 2.x's warning for a mid-epoch resume with a DataLoader it cannot checkpoint itself.
_NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"


def trained_batches(trainer: Any) -> int:
    """Batches of the current epoch trained so far, as Lightning counts them (a resumed epoch from 0)."""
    return int(trainer.fit_loop.epoch_loop.batch_progress.current.processed)


def save(
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
    lightning = trained_batches(trainer)
    steps = offset + lightning
    return {
        "index": samplers.index(sampler) if sampler in samplers else None,
        "sampler": sampler.state_dict(steps_done=steps),
        "lightning_batches": lightning,
        "mid_epoch": 0 < steps < sampler.plan.num_steps,
    }


def load(checkpoint: dict[str, Any], samplers: list[TokenBudgetBatchSampler]) -> tuple[int, int]:
    """Restore the saved training sampler; returns ``(epoch, steps of it trained)``, ``(-1, 0)``: none.

    Raises:
        ValueError: the checkpoint is mid-epoch and its sampler was not given to the callback.
    """
    saved = checkpoint.get(KEY)
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


def size_epoch(trainer: Any) -> None:
    """Make Lightning's count of the epoch's training batches the training DataLoader's length now."""
    loop = trainer.fit_loop
    combined = getattr(loop, "_combined_loader", None)
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


def mute_not_resumable_warning() -> Callable[[], None]:
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
            # What warnings.filterwarnings does after a change: drop the modules' cached decisions.
            getattr(warnings, "_filters_mutated", lambda: None)()

    return unmute
