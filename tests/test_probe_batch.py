"""The probe from one real batch (``batch=``): a model whose forward needs labels, with no config of its own.

A linear head on a tiny BERT with cross-entropy, as examples/emotion has it:
``synthetic_batch`` cannot build its inputs (no ``config.vocab_size``, and the
labels it needs), so the probe copies one collated batch at every shape.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertModel, DataCollatorWithPadding

from tokenbatch import TokenBudgetBatchSampler, auto_budget
from tokenbatch.probe import find_max_tokens
from tokenbatch.probe._measure import BatchLike

MiB = 2**20
LIMIT = 64 * MiB
LENGTHS = [int(n) for n in np.random.default_rng(0).integers(12, 97, 120)]


class LabelledClassifier(torch.nn.Module):
    """A linear layer on the encoder's first hidden state; the loss needs ``labels``. Records its inputs."""

    def __init__(self) -> None:
        super().__init__()
        config = BertConfig(
            vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37
        )
        config._attn_implementation = "eager"
        torch.manual_seed(0)
        self.encoder = BertModel(config, add_pooling_layer=False)
        self.linear = torch.nn.Linear(32, 6)
        self.seen: list[dict[str, tuple[tuple[int, ...], torch.dtype]]] = []

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        labels: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inputs = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        self.seen.append({k: (tuple(v.shape), v.dtype) for k, v in inputs.items()})
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.linear(hidden[:, 0, :])
        return torch.nn.functional.cross_entropy(logits, labels), logits


@pytest.fixture(autouse=True)
def _setup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TOKENBATCH_CACHE", str(tmp_path / "budgets.json"))
    monkeypatch.delenv("TOKENBATCH_MEMORY_LIMIT", raising=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: a second thread only waits for a core
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def real_batch(minilm_tokenizer: Any) -> Any:
    """Three texts as the example collates them: ids, token types, mask, and one label per row."""
    texts = ["i feel so happy today", "im scared", "i love the way this little song makes me feel"]
    rows = [{**minilm_tokenizer(t), "labels": label} for t, label in zip(texts, (1, 4, 2), strict=True)]
    return DataCollatorWithPadding(minilm_tokenizer)(rows)


def test_the_copies_keep_keys_dtypes_and_draw_from_the_real_batch(real_batch: Any) -> None:
    real = {**real_batch, "label_weights": torch.tensor([1.0, 2.0]), "task": "emotion"}  # not per row: as is
    like = BatchLike(real)
    ids, mask = real_batch["input_ids"], real_batch["attention_mask"]
    for size, length in ((1, 1), (5, 40), (64, 7)):
        batch = like(size, length, torch.Generator().manual_seed(size))
        assert list(batch) == list(real)
        for key in ("input_ids", "token_type_ids", "attention_mask"):
            assert batch[key].shape == (size, length) and batch[key].dtype == real[key].dtype, key
        assert batch["labels"].shape == (size,) and batch["labels"].dtype == torch.int64
        assert set(batch["labels"].tolist()) <= {1, 4, 2}
        assert set(batch["input_ids"].unique().tolist()) <= set(ids[mask.bool()].tolist())  # no pad ids
        assert int(batch["attention_mask"].sum()) == size * length - (length > 1)  # one pad: a real mask
        assert torch.equal(batch["label_weights"], real["label_weights"]) and batch["task"] == "emotion"
    again = like(64, 7, torch.Generator().manual_seed(64))
    assert torch.equal(again["input_ids"], batch["input_ids"])  # drawn from the generator only


def test_a_model_that_needs_labels_is_probed_from_one_real_batch(real_batch: Any) -> None:
    model = LabelledClassifier()
    with pytest.raises(ValueError, match=r"LabelledClassifier has no config.vocab_size .* pass make_batch="):
        find_max_tokens(model, lengths=LENGTHS, memory_limit=LIMIT)
    model.seen.clear()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    result = find_max_tokens(model, lengths=LENGTHS, memory_limit=LIMIT, batch=real_batch)
    assert result.fit is not None and result.max_tokens > max(LENGTHS) and result.steps >= 6
    # Every measured step ran on a copy of the real batch at the shape measured, labels included.
    shapes = {(m.batch_size, m.length) for m in (*result.measurements, *result.checks)}
    seen = {(s["input_ids"][0][0], s["input_ids"][0][1]) for s in model.seen}
    assert shapes <= seen
    for inputs in model.seen:
        rows, length = inputs["input_ids"][0]
        assert inputs["attention_mask"] == ((rows, length), torch.int64)
        assert inputs["labels"] == ((rows,), torch.int64)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # restored
    # The budget holds: the worst batches it allows fit under the target.
    target = LIMIT * (1 - result.margin)
    assert all(not c.oom and c.peak_bytes <= target for c in result.checks)


def test_auto_budget_from_one_real_batch(real_batch: Any) -> None:
    model = LabelledClassifier()
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    result = auto_budget(model, sampler, memory_limit=LIMIT, batch=real_batch)
    assert result.source == "probe" and result.probe is not None and result.estimate is None  # no config
    assert sampler.max_tokens == result.max_tokens > max(LENGTHS)
    assert result.key.model.startswith("LabelledClassifier[")
    again = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    assert auto_budget(model, again, memory_limit=LIMIT, batch=real_batch).source == "cache"


def test_a_batch_that_cannot_be_copied_says_what_to_pass(real_batch: Any) -> None:
    model = LabelledClassifier()
    sampler = TokenBudgetBatchSampler(LENGTHS, max_tokens="auto")
    with pytest.raises(ValueError, match=r"pass batch= .* or make_batch= .*, but got both; drop one"):
        auto_budget(model, sampler, memory_limit=LIMIT, batch=real_batch, make_batch=BatchLike(real_batch))
    with pytest.raises(TypeError, match=r"should be one collated batch.*got batch of type list; pass"):
        auto_budget(model, sampler, memory_limit=LIMIT, batch=[real_batch["input_ids"]])
    with pytest.raises(
        ValueError, match=r"'attention_mask' or 'input_ids' .* but got batch=\{'labels': \(3,\)\}; pass"
    ):
        find_max_tokens(model, lengths=LENGTHS, memory_limit=LIMIT, batch={"labels": real_batch["labels"]})
    empty = {"input_ids": torch.zeros(2, 3, dtype=torch.long), "attention_mask": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"at least one real token .* batch\['attention_mask'\] of shape"):
        find_max_tokens(model, lengths=LENGTHS, memory_limit=LIMIT, batch=empty)
    assert not sampler.resolved and not model.seen  # every error before a step ran
