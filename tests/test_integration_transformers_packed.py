"""TokenBudgetTrainer with transformers' ``DataCollatorWithFlattening``: padding-free packs of whole examples.

A tiny Llama (eager attention) learns emotion texts as a causal LM. The
trainer recognises the collator and plans packs (``packing="full"``: eager
attention scores the whole row, masked per example from ``position_ids``).
Which examples each optimizer step trained is read from the gradients
(``marks``, tests/scripts/trl_common.py: the collator below adds each token's
example ``idx``). Checked: every example once per epoch; each step's loss is
that of a plain ``Trainer`` on the same examples padded (within 1e-5); halve
mode after out-of-memory in the backward pass still trains each example once.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))

import trl_common as tc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
COUNT, MAX_TOKENS, OOM_LIMIT = 48, 300.0, 150.0


def flattening_with_idx() -> Any:
    """``DataCollatorWithFlattening`` (recognised as such) that also passes each token's example ``idx``."""
    import torch
    from transformers import DataCollatorWithFlattening

    class FlatWithIdx(DataCollatorWithFlattening):  # type: ignore[misc]
        def __call__(self, features: list[dict[str, Any]], *args: Any, **kwargs: Any) -> Any:
            batch = super().__call__([{"input_ids": f["input_ids"]} for f in features], *args, **kwargs)
            lengths = torch.tensor([len(f["input_ids"]) for f in features])
            batch["idx"] = torch.repeat_interleave(torch.tensor([f["idx"] for f in features]), lengths)[None]
            return batch

    return FlatWithIdx()


def padding_with_idx(tok: Any) -> Any:
    from transformers import DataCollatorForLanguageModeling

    return tc.WithIdx(DataCollatorForLanguageModeling(tok, mlm=False))


def texts(data_dir: Path, tok: Any) -> Any:
    import datasets

    rows = [{"text": text, "idx": i} for i, text in enumerate(tc.texts(data_dir, COUNT))]
    data = datasets.Dataset.from_list(rows)
    return data.map(lambda row: {"input_ids": tok(row["text"])["input_ids"]}, remove_columns=["text"])


def arguments(output_dir: Path) -> Any:
    from transformers import TrainingArguments

    return TrainingArguments(
        str(output_dir),
        num_train_epochs=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        remove_unused_columns=False,  # idx reaches the collator
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )


def run(
    data: Any, tok: Any, output_dir: Path, *, plain: bool = False, oom: Any = None, **options: Any
) -> dict[str, Any]:
    """One epoch; ``plain``: a ``Trainer`` on the token budget's packs, padded; else ``TokenBudgetTrainer``.

    ``oom``: ``inject_oom`` keywords.
    """
    from torch.utils.data import DataLoader
    from transformers import Trainer

    from tokenbatch import CostModel, TokenBudgetBatchSampler
    from tokenbatch.integrations.transformers import TokenBudgetTrainer
    from tokenbatch.testing import inject_oom

    model = tc.tiny_llama(len(tok))
    record = tc.recorder(tc.add_marks(model, COUNT))
    kwargs = {"model": model, "args": arguments(output_dir), "train_dataset": data, "callbacks": [record]}

    class SamePacksPadded(Trainer):  # type: ignore[misc]
        def get_train_dataloader(self) -> Any:
            lengths = [len(ids) for ids in self.train_dataset["input_ids"]]
            packs = list(TokenBudgetBatchSampler(lengths, MAX_TOKENS, cost=CostModel(packing="full"), seed=0))
            loader = DataLoader(self.train_dataset, batch_sampler=packs, collate_fn=self.data_collator)
            return self.accelerator.prepare(loader)

    if plain:
        trainer = SamePacksPadded(**kwargs, data_collator=padding_with_idx(tok))
    else:
        trainer = TokenBudgetTrainer(
            **kwargs, data_collator=flattening_with_idx(), max_tokens=MAX_TOKENS, **options
        )
    injector = None if oom is None else inject_oom(trainer.model, **oom)
    trainer.train()
    return {
        "steps": record.steps,
        "losses": record.losses,
        "packing": getattr(trainer, "token_cost", CostModel()).packing,
        "events": [str(e) for e in getattr(trainer, "oom_events", [])],
        "injected": 0 if injector is None else injector.count,
    }


@pytest.fixture(scope="module")
def runs(emotion_data_dir: Path, minilm_path: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The runs, each made once, on the first use: ``runs("packed")``."""
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bar()
    out = tmp_path_factory.mktemp("packed")
    tok = tc.tokenizer(minilm_path, tc.texts(emotion_data_dir, COUNT))
    data = texts(emotion_data_dir, tok)
    options: dict[str, dict[str, Any]] = {
        "plain": {"plain": True},
        "packed": {},
        "halve": {"oom": {"max_tokens": OOM_LIMIT, "where": "backward"}, "oom_mode": "halve"},
    }
    done: dict[str, Any] = {}

    def get(name: str) -> dict[str, Any]:
        if name not in done:
            done[name] = run(data, tok, out / name, **options[name])
        return done[name]

    return get


def once(steps: list[list[int]]) -> None:
    assert sorted(i for step in steps for i in step) == list(range(COUNT)), "every example once per epoch"


def test_flattening_collator_trains_packs_with_the_loss_of_the_same_examples_padded(runs: Any) -> None:
    plain, packed = runs("plain"), runs("packed")
    assert packed["packing"] == "full"  # recognised: DataCollatorWithFlattening, eager attention
    once(packed["steps"])
    assert packed["steps"] == plain["steps"] and len(packed["steps"]) >= 3
    assert packed["losses"] == pytest.approx(plain["losses"], abs=1e-5)


def test_flattening_collator_halve_after_out_of_memory_in_backward_trains_each_example_once(
    runs: Any,
) -> None:
    halve = runs("halve")
    assert halve["injected"] > 0 and "re-planned" in halve["events"][0] and "backward" in halve["events"][0]
    once(halve["steps"])
    assert len(halve["steps"]) > len(runs("packed")["steps"])


def test_the_cost_follows_the_collator_and_the_attention(minilm_path: str) -> None:
    from transformers import DataCollatorWithFlattening, DataCollatorWithPadding

    trl = pytest.importorskip("trl.trainer.sft_trainer")
    DataCollatorForLanguageModeling = trl.DataCollatorForLanguageModeling

    from tokenbatch import CostModel
    from tokenbatch.integrations.transformers._layout import layout_cost

    model = tc.tiny_llama(32)
    flat, tok = DataCollatorWithFlattening(), tc.tokenizer(minilm_path, ["a few words"])
    assert layout_cost(None, flat, model) == CostModel(packing="full")  # eager
    assert layout_cost(None, DataCollatorForLanguageModeling(0, padding_free=True), model).packing == "full"
    assert layout_cost(None, DataCollatorWithPadding(tok), model) == CostModel()
    assert layout_cost(None, object(), model) == CostModel()  # an unknown collator: padded, as before
    model.config._attn_implementation = "flash_attention_2"  # what from_pretrained(attn_implementation=) sets
    assert layout_cost(None, flat, model).packing == "varlen"
    given = CostModel(quadratic=1e-3, packing="full")
    assert layout_cost(given, flat, model) is given  # the user's choice stands
    with pytest.raises(ValueError, match=r"cost should be a packed cost model.*packing='varlen'"):
        layout_cost(CostModel(), flat, model)
    with pytest.raises(ValueError, match=r"cost should be padded \(packing=None\).*DataCollatorWithPadding"):
        layout_cost(given, DataCollatorWithPadding(tok), model)


def test_lr_scaling_counts_a_packs_examples_and_tokens() -> None:
    import torch
    from transformers import DataCollatorWithFlattening

    from tokenbatch.integrations.transformers._lr import StepScaling

    pack = DataCollatorWithFlattening()([{"input_ids": [5] * n} for n in (3, 7, 2)])
    for by, expected in (("samples", 3), ("tokens", 12)):
        scaling = StepScaling("linear", by, 10.0, sampler=lambda: None)
        scaling.count(pack)  # one row, no attention_mask: its examples and their tokens
        scaling.count({"attention_mask": torch.ones(2, 4, dtype=torch.long)})  # 2 padded rows, 8 tokens
        assert scaling._count == expected + (2 if by == "samples" else 8)


def test_an_iterable_train_set_is_packed_by_a_stream(
    emotion_data_dir: Path, minilm_path: str, tmp_path: Path
) -> None:
    # An iterable train set under the flattening collator: the trainer's stream yields packs, costed
    # as packs (eager attention: the whole row), each example once in an epoch.
    import dataclasses

    import datasets
    import transformers

    from tokenbatch import TokenBudgetStream
    from tokenbatch.integrations.transformers import TokenBudgetTrainer

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bar()
    tok = tc.tokenizer(minilm_path, tc.texts(emotion_data_dir, COUNT))
    data = texts(emotion_data_dir, tok)
    lengths = [len(ids) for ids in data["input_ids"]]
    model = tc.tiny_llama(len(tok))
    record = tc.recorder(tc.add_marks(model, COUNT))
    trainer = TokenBudgetTrainer(
        model=model,
        args=dataclasses.replace(arguments(tmp_path), max_steps=3),
        train_dataset=data.to_iterable_dataset(),
        callbacks=[record],
        data_collator=flattening_with_idx(),
        max_tokens=MAX_TOKENS,
    )
    trainer.train()
    stream = trainer.train_sampler
    assert isinstance(stream, TokenBudgetStream) and stream.cost.packing == "full"
    assert trainer.state.global_step == len(record.steps) == 3
    seen = [i for step in record.steps for i in step]
    assert len(seen) == len(set(seen)) and len(seen) > 3  # packs of several examples, none twice
    for step in record.steps:
        assert stream.cost.batch_cost([lengths[i] for i in step]) <= MAX_TOKENS
