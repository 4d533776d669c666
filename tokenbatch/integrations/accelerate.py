"""What a token-budget training loop under ``accelerate launch`` needs beyond accelerate itself.

- :func:`gather_samples`: gather evaluation outputs whose batch sizes differ
  between processes (token-budget batches do), so that every validation
  example is scored exactly once;
- :func:`progress`: ``fallback.iterate(dataloader)`` behind a progress bar that
  follows re-plans and shows the budget in force;
- :func:`finish`: end a distributed run without the DDP shutdown hang;
- :func:`token_cost`: the model's analytic cost for the device and precision
  accelerate runs it in, in token units;
- :func:`save_checkpoint`, :func:`last_checkpoint`: ``accelerator.save_state``
  into numbered folders that appear complete or not at all, and the newest of
  them, for a job that restarts (docs/restarts.md).

A loop with them::

    def train(accelerator):
        cost = token_cost(accelerator, model.config)  # the sampler's cost, in padded tokens
        ...  # samplers, loaders, optimizer, accelerator.prepare(...), OOMFallback
        for epoch in range(num_epochs):
            sampler.set_epoch(epoch)
            for batch in progress(fallback, train_loader, desc=f"epoch {epoch}"):
                if fallback.backward(batch, lambda b: model(**b).loss) is not None:
                    fallback.step(optimizer)
                    optimizer.zero_grad()
            for batch in eval_loader:  # token-budget batches too: their sizes differ between processes
                with torch.no_grad():
                    predictions = model(**batch).logits.argmax(-1)
                predictions, labels = gather_samples(accelerator, (predictions, batch["labels"]))

    accelerator = Accelerator()
    train(accelerator)
    finish(accelerator)  # after train() returned: its references to the DDP model are gone
"""

from __future__ import annotations

import gc
import logging
import os
import re
import shutil
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import recursively_apply
except ImportError as error:  # pragma: no cover - the extra is not installed
    raise ImportError(
        "tokenbatch.integrations.accelerate needs accelerate: pip install 'tokenbatch[accelerate]'"
    ) from error

from tokenbatch import _checks
from tokenbatch.cost import CostModel
from tokenbatch.integrations import _upstream
from tokenbatch.probe import MemoryModel

if TYPE_CHECKING:
    from tokenbatch.oom import OOMFallback

__all__ = ["finish", "gather_samples", "last_checkpoint", "progress", "save_checkpoint", "token_cost"]

logger = logging.getLogger(__name__)

T = TypeVar("T")
_CHECKPOINT = re.compile(r"checkpoint_(\d+)")  # the names of accelerate's automatic naming


def token_cost(
    accelerator: Accelerator, config: Any, *, task: str = "auto", pad_to_multiple_of: int = 1
) -> CostModel:
    """The cost of a batch for ``config`` on the device and mixed precision ``accelerator`` trains in.

    It is the analytic estimate, :meth:`tokenbatch.probe.MemoryModel.from_config`,
    in token units (its ``token_cost()``, ``linear = 1``). A budget then stays
    a number of padded tokens, and a long sequence costs more in proportion to
    the attention scores its model keeps: eager attention and CPU sdpa with
    attention dropout store them, fused kernels on CUDA hardly anything.
    ``task`` names the head, as for ``from_config``.

    Example:
        >>> from accelerate import Accelerator
        >>> from transformers import BertConfig
        >>> cost = token_cost(Accelerator(cpu=True), BertConfig(), task="base")
        >>> cost.linear, round(1 / cost.quadratic)  # a 395-token sequence costs twice its length
        (1.0, 395)
    """
    precision = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(str(accelerator.mixed_precision))
    device = "cuda" if accelerator.device.type == "cuda" else "cpu"
    model = MemoryModel.from_config(
        config,
        dtype=precision or torch.float32,
        device=device,
        task=task,
        pad_to_multiple_of=pad_to_multiple_of,
    )
    return model.token_cost()


def gather_samples(accelerator: Accelerator, data: T) -> T:
    """Gather one evaluation batch's outputs from every process, each example exactly once.

    ``data`` is a tensor, or a tuple, list or dict of tensors, whose first
    dimension is this process's batch; the other dimensions must agree across
    processes. Token-budget batches differ in size between processes, and
    ``accelerator.gather`` needs equal shapes: the rows are padded to the
    largest batch, gathered, and each process's padding dropped again by its
    row count. Batches of equal size go through ``accelerator.gather_for_metrics``,
    which also drops the samples accelerate repeats to complete the last batch
    of a fixed-size DataLoader. Call it on every process, like any collective.

    Returns:
        The same structure on every process: process 0's rows, then process 1's, ...

    Raises:
        TypeError: ``data`` is not made of tensors.
        ValueError: its tensors do not share their first dimension, or their
            other dimensions differ between processes. Either error is raised on
            every process, so none is left waiting.

    Example:
        >>> from accelerate import Accelerator
        >>> accelerator = Accelerator(cpu=True)
        >>> ids, logits = gather_samples(accelerator, (torch.tensor([7, 3]), torch.zeros(2, 6)))
        >>> ids.tolist(), tuple(logits.shape)
        ([7, 3], (2, 6))
    """
    shapes: list[tuple[int, ...]] = []

    def note(tensor: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(tensor.shape))
        return tensor

    problem, error = "", cast(type[Exception], ValueError)
    try:
        recursively_apply(note, data, error_on_other_type=True)
    except TypeError:
        problem, error = f"an object of type {type(data).__name__}", TypeError
    else:
        if not shapes or not all(shapes) or len({shape[0] for shape in shapes}) != 1:
            problem = f"shapes {shapes}"
    # One small gather tells every process every batch size, and whether the shapes fit
    # together, before a gather that would fail or hang on mismatched shapes.
    rows = 0 if problem else shapes[0][0]
    trailing = 0 if problem else hash(tuple(shape[1:] for shape in shapes))  # ints hash alike everywhere
    signature = torch.tensor(
        [[int(not problem), rows, trailing]], dtype=torch.int64, device=accelerator.device
    )
    everyone = accelerator.gather(signature).cpu()
    if not bool(everyone[:, 0].all()):
        failed = everyone[:, 0].eq(0).nonzero().flatten().tolist()
        raise error(
            f"data should be a tensor, or a tuple, list or dict of tensors sharing their first dimension "
            f"(the batch), on every process, but process(es) {failed} passed something else"
            + (f": {problem}" if problem else "")
        )
    if len(set(everyone[:, 2].tolist())) > 1:
        raise ValueError(
            f"data's dimensions after the first should agree across processes, but got shapes {shapes} "
            f"on process {accelerator.process_index} and others elsewhere; pad them first, e.g. with "
            f"accelerator.pad_across_processes(tensor, dim=1)"
        )
    counts = everyone[:, 1].tolist()
    if min(counts) == max(counts):
        return cast(T, accelerator.gather_for_metrics(data))
    largest = max(counts)

    def pad(tensor: torch.Tensor) -> torch.Tensor:  # the counts are known: no pad_across_processes gathers
        return torch.cat([tensor, tensor.new_zeros((largest - tensor.shape[0], *tensor.shape[1:]))])

    gathered = accelerator.gather(recursively_apply(pad, data))
    keep = torch.cat([torch.arange(count) + rank * largest for rank, count in enumerate(counts)])
    return cast(T, recursively_apply(lambda tensor: tensor[keep.to(tensor.device)], gathered))


def progress(
    fallback: OOMFallback,
    dataloader: Iterable[T],
    *,
    desc: str | None = None,
    postfix: Callable[[], Mapping[str, Any]] | None = None,
) -> Iterator[T]:
    """``fallback.iterate(dataloader)`` behind a tqdm bar that follows re-plans.

    The bar counts the steps trained in this epoch against the steps planned,
    which a halve-mode re-plan changes, and shows the budget in force plus
    whatever ``postfix()`` returns (a running loss, say), updated after every
    step. Only the local main process shows it; log records (the OOM
    warnings) go above the bar rather than through it.

    Example::

        running = {"loss": 0.0}
        for batch in progress(fallback, train_loader, desc="epoch 1", postfix=lambda: running):
            ...
    """
    from tqdm.auto import tqdm
    from tqdm.contrib.logging import logging_redirect_tqdm

    show = PartialState().is_local_main_process
    sampler = fallback.sampler
    plan = getattr(sampler, "plan", None)  # a TokenBudgetStream has none: its length is unknown
    bar = tqdm(total=None if plan is None else plan.num_steps, desc=desc, disable=not show)
    batches = fallback.iterate(dataloader)
    try:
        with logging_redirect_tqdm() if show else nullcontext():
            for batch in batches:
                yield batch
                bar.total = bar.total if plan is None else getattr(sampler, "plan", plan).num_steps
                bar.n = fallback.steps_done
                bar.set_postfix(budget=_checks.budget(fallback.max_tokens), **(postfix() if postfix else {}))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:  # a loop left early: release the DataLoader's iterator now
            close()
        bar.close()


def finish(accelerator: Accelerator) -> None:
    """End the run on every process: release the prepared objects, then the process group.

    Call it last, once the function that trained has returned (or after
    ``del model``). The order matters: a DDP model still alive when
    ``end_training`` destroys the gloo process group takes the group down
    later, from its reducer, while holding the GIL, and can deadlock with
    gloo's worker threads: a hang at exit (pytorch/pytorch#56297). So this drops
    accelerate's own references to what it prepared, collects, and only then
    calls ``end_training``; a DDP model someone still holds is logged as a warning.

    Example::

        accelerator = Accelerator()
        train(accelerator)  # prepares, trains and returns: its references go with it
        finish(accelerator)
    """
    accelerator.wait_for_everyone()
    # Weak references only: a strong one here would keep alive what free_memory is meant to drop.
    prepared = _upstream.accelerate_prepared_models(accelerator)
    wrapped = [weakref.ref(model) for model in prepared if isinstance(model, DistributedDataParallel)]
    del prepared
    accelerator.free_memory()
    gc.collect()
    if any(ref() is not None for ref in wrapped):
        logger.warning(
            "finish(): a DDP model is still referenced; drop every reference to it (return from the "
            "function that trained, or `del model`) before finish(), or the process may hang at exit "
            "(pytorch/pytorch#56297)"
        )
    accelerator.end_training()


def save_checkpoint(accelerator: Accelerator, directory: str | os.PathLike[str], *, keep: int = 2) -> Path:
    """``accelerator.save_state`` into ``directory/checkpoint_<n>``, which appears complete or not at all.

    ``save_state`` writes file after file, the model's and the registered objects' on the main
    process and each process's random state on that process. A process killed meanwhile leaves a
    folder that looks like a checkpoint and is not one: overwritten in place, it mixes two steps.
    Here every process writes into ``directory/.checkpoint_<n>.partial``; once all have written,
    the main process flushes the files to disk and renames the folder ``checkpoint_<n>`` (a
    rename is atomic), then removes all but the newest ``keep``. ``n`` is one more than the
    newest complete checkpoint's, so a resumed run numbers on. A folder left partial by a killed
    save is removed at the next save. Call it on every process, as ``save_state``; ``directory``
    must be one that every process sees.

    Returns:
        The checkpoint's folder, for ``accelerator.load_state``.

    Raises:
        ValueError: ``keep`` is not at least 1, or the accelerator names its checkpoints itself
            (``ProjectConfiguration(automatic_checkpoint_naming=True)``).

    Example::

        if (checkpoint := last_checkpoint("checkpoints")) is not None:
            accelerator.load_state(checkpoint)  # the model, the optimizer, the guard with the sampler
        ...
        save_checkpoint(accelerator, "checkpoints")  # every k steps, on every process
    """
    keep = _checks.positive_int("keep", keep)
    if accelerator.project_configuration.automatic_checkpoint_naming:
        raise ValueError(
            "automatic_checkpoint_naming should be False for save_checkpoint, but got "
            "ProjectConfiguration(automatic_checkpoint_naming=True): save_state would write into its own "
            "folder, not the partial one save_checkpoint renames once complete; leave it False and pass "
            "the directory to save_checkpoint"
        )
    root = Path(directory)
    main = accelerator.is_main_process
    if main:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".checkpoint_*.partial"):  # a save (or a removal) that was killed
            shutil.rmtree(stale)
    accelerator.wait_for_everyone()  # nobody writes before the stale folders are gone
    # Every process reads the same numbers: nothing renames a checkpoint between the two barriers.
    complete = _checkpoints(root)
    final = root / f"checkpoint_{complete[-1][0] + 1 if complete else 0}"
    partial = root / f".{final.name}.partial"
    accelerator.save_state(str(partial))
    accelerator.wait_for_everyone()  # every process has written its part
    if main:
        for path in (*partial.rglob("*"), partial):  # on disk before the name says it is complete
            _fsync(path)
        partial.rename(final)
        _fsync(root)
        for _, old in _checkpoints(root)[:-keep]:
            doomed = root / f".{old.name}.partial"  # a removal cut short leaves no complete-looking name
            old.rename(doomed)
            shutil.rmtree(doomed)
    return final


def last_checkpoint(directory: str | os.PathLike[str]) -> Path | None:
    """The newest complete checkpoint :func:`save_checkpoint` wrote in ``directory``; None if there is none.

    Example::

        if (checkpoint := last_checkpoint("checkpoints")) is not None:
            accelerator.load_state(checkpoint)
    """
    complete = _checkpoints(Path(directory))
    return complete[-1][1] if complete else None


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete checkpoints in ``root``, oldest first, with their numbers."""
    if not root.is_dir():
        return []
    found = ((_CHECKPOINT.fullmatch(path.name), path) for path in root.iterdir() if path.is_dir())
    return sorted((int(match[1]), path) for match, path in found if match)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
