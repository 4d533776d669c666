"""Trainer's own log lines about batch sizes and step counts, told in the token budget's terms.

Trainer logs (logger ``transformers.trainer``, at info level) a run's batch
size from ``per_device_*_batch_size`` and its step counts from the training
loader's length; a token-budget run uses neither (its loader's length is a
bound, see :mod:`tokenbatch.integrations.transformers._feed`). Nothing public changes what
those lines print, so while ``train`` or an evaluation runs a
:class:`logging.Filter` on that logger rewrites them in place: the line keeps
Trainer's logger, level and handlers, so it shows wherever Trainer's own lines
show (``transformers.logging.set_verbosity_info()``, ``log_level="info"``).
For example ``Instantaneous batch size per device = 8`` becomes::

    Token budget per batch and device = max_tokens=320 (mean batch 11.6 samples in epoch 0's plan; ...)
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence

from tokenbatch import _checks
from tokenbatch.integrations.transformers._schedule import Run, planned_updates
from tokenbatch.sampler import TokenBudgetBatchSampler

TRAINER_LOGGER = "transformers.trainer"

Rule = tuple[str, Callable[[], str | None]]
"""``(prefix, text)``: a message that starts with ``prefix`` (leading blanks aside) becomes ``text()``.

``text()`` returning None leaves the message as it is; an empty string drops it.
"""


class Rewrite(logging.Filter):
    """Rewrites (or drops) the records whose message starts with one of ``rules``' prefixes."""

    def __init__(self, rules: Sequence[Rule]) -> None:
        super().__init__()
        self.rules = list(rules)

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        text = message.lstrip()
        for prefix, replace in self.rules:
            if text.startswith(prefix):
                new = replace()
                if new == "":
                    return False
                if new is not None:  # Trainer's indentation (and leading newline) kept
                    record.msg, record.args = message[: len(message) - len(text)] + new, ()
                break
        return True


@contextlib.contextmanager
def rewritten(rules: Sequence[Rule]) -> Iterator[None]:
    """While inside: Trainer's log lines that ``rules`` name are rewritten."""
    logger = logging.getLogger(TRAINER_LOGGER)
    rewrite = Rewrite(rules)
    logger.addFilter(rewrite)
    try:
        yield
    finally:
        logger.removeFilter(rewrite)


def mean_batch(sampler: TokenBudgetBatchSampler) -> float:
    """Samples per batch in the sampler's current plan."""
    plan = sampler.plan
    return len(plan.order) / max(1, plan.num_batches)


def training_rules(run: Callable[[], Run | None], *, accumulation: int, epochs: int) -> list[Rule]:
    """Trainer's training summary in the plans' terms; ``run()`` is the token-budget run (None: none).

    ``epochs``: the run's ``num_train_epochs`` (0 with ``max_steps``: only the current epoch is told).
    """

    def per_epoch(sampler: TokenBudgetBatchSampler) -> list[int]:
        first = sampler.epoch
        last = max(first + 1, epochs)
        return [planned_updates(sampler, e, sampler.max_tokens, accumulation) for e in range(first, last)]

    def said(make: Callable[[Run, TokenBudgetBatchSampler], str]) -> Callable[[], str | None]:
        def text() -> str | None:
            current = run()
            sampler = None if current is None else current.loader.sampler
            # A stream (an iterable train set) has no plan to tell: Trainer's line, with max_steps, stands.
            if current is None or not isinstance(sampler, TokenBudgetBatchSampler):
                return None
            return make(current, sampler)

        return text

    def steps_per_epoch(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        counts, first = per_epoch(sampler), sampler.epoch
        if len(counts) == 1:
            return f"Num update steps per epoch = {counts[0]} (epoch {first}'s token-budget plan)"
        last = first + len(counts) - 1
        low, high = min(counts), max(counts)
        number = f"{low}" if low == high else f"{low} to {high}"
        return f"Num update steps per epoch = {number} (the token-budget plans of epochs {first} to {last})"

    def batch(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        return (
            f"Token budget per batch and device = max_tokens={_checks.budget(sampler.max_tokens)} "
            f"(mean batch {mean_batch(sampler):.1f} samples in epoch {sampler.epoch}'s plan; "
            f"per_device_train_batch_size is not used for batching)"
        )

    def step_size(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        samples = len(sampler.plan.order) / max(1, per_epoch(sampler)[0])
        return f"Mean samples per optimizer step (w. parallel, distributed & accumulation) = {samples:.1f}"

    def continuing(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        return "Continuing training from checkpoint: the sampler resumes at the next sample, no batch skipped"

    def total(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        return f"Total optimization steps = {run.max_steps:,}"

    def resumed(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        return (
            f"Resuming training from checkpoint at epoch {sampler.epoch}, step {sampler.start_step} of "
            f"its plan, global step {run.first_step} (the sampler resumes at the next sample)"
        )

    def continued(run: Run, sampler: TokenBudgetBatchSampler) -> str:
        return f"Continuing training from epoch {sampler.epoch}, step {sampler.start_step} of its plan"

    return [
        ("Num update steps per epoch = ", said(steps_per_epoch)),  # transformers 5
        ("Instantaneous batch size per device = ", said(batch)),
        ("Training with DataParallel so batch size", said(lambda run, sampler: "")),
        ("Total train batch size (w. parallel, distributed & accumulation) = ", said(step_size)),
        ("Total optimization steps = ", said(total)),
        ("Resuming training from checkpoint with epoch", said(resumed)),  # transformers 5
        ("Continuing training from checkpoint, will skip", said(continuing)),  # 4.x
        ("Continuing training from epoch ", said(continued)),  # 4.x
    ]


def evaluation_rules(sampler: TokenBudgetBatchSampler | None) -> list[Rule]:
    """``Batch size = N`` of an evaluation or prediction over ``sampler``'s plan (None: left as it is)."""

    def batch() -> str | None:
        if sampler is None:
            return None
        return (
            f"Token budget per batch = max_tokens={_checks.budget(sampler.max_tokens)} "
            f"({sampler.plan.num_batches} batches, mean batch {mean_batch(sampler):.1f} samples; "
            f"per_device_eval_batch_size is not used)"
        )

    return [("Batch size = ", batch)]
