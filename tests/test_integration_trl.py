"""TokenBudgetSFTTrainer with real TRL: a tiny Llama fine-tuned on emotion texts, on 1 and 2 processes.

Which examples each optimizer step trained is read from the gradients
(``marks``, see tests/scripts/trl_common.py). Every run is one epoch; the
checks: every example TRL kept trained exactly once; with no out-of-memory
error the logged per-token loss of each step is a plain ``SFTTrainer``'s on
the same batches (within 1e-5), and so it stays in split mode after an
out-of-memory error (the micro-batches' losses add up to the batch's);
halve mode re-plans and still trains each example once; a resumed run
continues with the next example and the uninterrupted run's losses.

On 1 process the data is conversational with ``assistant_only_loss``, on 2
processes prompt/completion pairs with TRL's completion-only loss and
gradient accumulation 2: out-of-memory in the backward pass (split) and the
forward pass (halve) here, the other way round there.

The padding-free mode (``padding_free=True``: packs of whole examples in one
row) runs the same checks, against a plain ``SFTTrainer`` that trains the
same packs as padded batches: the tiny Llama's eager attention masks each
example of a pack off from the others, so the losses agree to float rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))

import trl_common as tc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_TOKENS, OOM_LIMIT, MAX_LENGTH, CHECKPOINT = 400.0, 200.0, 40, 2
RUNS_2P = ("plain", "budget", "split", "halve")


def once(run: dict[str, Any]) -> tuple[int, int]:
    """(examples trained, distinct ones); asserts they are exactly the examples TRL kept."""
    seen = [i for step in run["steps"] for i in step]
    assert sorted(seen) == sorted(run["idx"]), "every example once per epoch"
    return len(seen), len(set(seen))


@pytest.fixture(scope="module")
def runs(emotion_data_dir: Path, minilm_path: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The 1-process runs, each made once, on the first use: ``runs("budget")``."""
    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bar()
    out = tmp_path_factory.mktemp("trl")
    tok = tc.tokenizer(minilm_path, tc.texts(emotion_data_dir, 64))
    data = tc.pairs(emotion_data_dir, 64, conversational=True)
    arguments = {"assistant_only_loss": True, "max_length": MAX_LENGTH, "disable_tqdm": True}
    options: dict[str, dict[str, Any]] = {
        "plain": {"plain": True},
        "budget": {"save_at": CHECKPOINT},
        "resumed": {"resume": str(out / "budget" / f"checkpoint-{CHECKPOINT}")},
        "split": {"oom": {"max_tokens": OOM_LIMIT, "where": "backward"}},
        "halve": {"oom": {"max_tokens": OOM_LIMIT}, "oom_mode": "halve"},
        # padding-free: eager attention over the whole row, so packing="full"
        "packed_plain": {"plain": True, "packed": "full"},
        "packed": {"packed": "full", "save_at": CHECKPOINT},
        "packed_resumed": {"packed": "full", "resume": str(out / "packed" / f"checkpoint-{CHECKPOINT}")},
        "packed_halve": {"packed": "full", "oom": {"max_tokens": OOM_LIMIT}, "oom_mode": "halve"},
        "packed_split": {"packed": "full", "oom": {"max_tokens": OOM_LIMIT, "where": "backward"}},
    }
    done: dict[str, Any] = {}

    def get(name: str) -> dict[str, Any]:
        nonlocal data
        if name.endswith("resumed"):
            get(name.replace("resumed", "").rstrip("_") or "budget")
        if name not in done:
            done[name] = tc.train(
                data, tok, out / name, max_tokens=MAX_TOKENS, arguments=arguments, **options[name]
            )
            data = done[name]["dataset"]  # prepared by TRL once
        return done[name]

    get.raw = lambda: tc.pairs(emotion_data_dir, 64, conversational=True)  # type: ignore[attr-defined]
    get.tokenizer = tok  # type: ignore[attr-defined]
    return get


def test_same_per_token_loss_as_sft_trainer_on_the_same_batches(runs: Any) -> None:
    plain, budget = runs("plain"), runs("budget")
    assert once(budget) == once(plain)
    assert len(budget["losses"]) == len(plain["losses"]) >= 3
    assert budget["steps"] == plain["steps"]  # the same batches, step by step
    assert budget["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    assert budget["events"] == []


def test_lengths_are_read_after_trl_prepares_the_data(runs: Any) -> None:
    budget = runs("budget")
    prepared = budget["dataset"]
    lengths = [len(ids) for ids in prepared["input_ids"]]
    assert budget["lengths"] == lengths  # the chat template applied (and the truncation, below)
    templated = [len(runs.tokenizer.apply_chat_template(row["messages"])["input_ids"]) for row in runs.raw()]
    if "labels" in prepared.column_names:  # TRL >= 1.16 prepares labels, and truncates, in the data
        assert max(lengths) <= MAX_LENGTH < max(templated)
        # The labels keep TRL's assistant-only mask: the user's turn is not trained on.
        row = prepared[0]
        trained = [t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100]
        assert 0 < len(trained) < len(row["input_ids"])


def test_lengths_are_capped_where_the_collator_truncates() -> None:
    import datasets

    from tokenbatch.integrations.trl import capped_lengths

    data = datasets.Dataset.from_dict({"input_ids": [[1] * 5, [1] * 50], "length": [5, 50]})
    assert capped_lengths(data, 40, "length")["length"] == [5, 40]
    assert capped_lengths(data.remove_columns("length"), 40, "length")["length"] == [5, 40]
    assert capped_lengths(data, None, "length") is data  # nothing truncates: lengths as they are
    assert capped_lengths(data, 64, "length") is data


def test_split_after_out_of_memory_in_backward_keeps_the_loss(runs: Any) -> None:
    plain, split = runs("plain"), runs("split")
    assert split["injected"] > 0 and split["events"]
    assert "backward" in split["events"][0] and "micro-batches" in split["events"][0]
    once(split)
    assert split["losses"] == pytest.approx(plain["losses"], abs=1e-5)


def test_halve_after_out_of_memory_in_forward_trains_each_example_once(runs: Any) -> None:
    halve = runs("halve")
    assert halve["injected"] > 0 and "re-planned" in halve["events"][0] and "forward" in halve["events"][0]
    once(halve)
    assert len(halve["steps"]) > len(runs("plain")["steps"])  # smaller batches, more steps


def test_resume_mid_epoch_continues_at_the_next_example(runs: Any) -> None:
    budget, resumed = runs("budget"), runs("resumed")
    assert resumed["steps"] == budget["steps"][CHECKPOINT:]
    once({"steps": budget["steps"][:CHECKPOINT] + resumed["steps"], "idx": budget["idx"]})
    assert resumed["losses"] == pytest.approx(budget["losses"][CHECKPOINT:], abs=1e-5)


def test_padding_free_trains_each_example_once_with_the_loss_of_the_same_batches_padded(runs: Any) -> None:
    plain, packed = runs("packed_plain"), runs("packed")
    assert packed["packing"] == "full"  # eager attention: the whole row's scores
    assert once(packed) == once(plain) == once(runs("plain"))
    assert packed["steps"] == plain["steps"] and len(plain["steps"]) >= 3
    assert packed["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    # No padding, but eager attention scores the whole row, (sum L)^2: at this budget, no more steps than
    # padded batches (fewer where the linear term leads: the benchmarks' rows).
    assert len(packed["steps"]) <= len(runs("budget")["steps"])


def test_padding_free_split_after_out_of_memory_in_backward_keeps_the_loss(runs: Any) -> None:
    plain, split = runs("packed_plain"), runs("packed_split")
    assert split["injected"] > 0 and split["events"]
    assert "backward" in split["events"][0] and "micro-batches" in split["events"][0]
    once(split)
    assert split["steps"] == plain["steps"]  # the same packs, each run as smaller packs
    assert split["losses"] == pytest.approx(plain["losses"], abs=1e-5)


def test_padding_free_halve_after_out_of_memory_in_forward_trains_each_example_once(runs: Any) -> None:
    halve = runs("packed_halve")
    assert halve["injected"] > 0 and "re-planned" in halve["events"][0] and "forward" in halve["events"][0]
    once(halve)
    assert len(halve["steps"]) > len(runs("packed")["steps"])


def test_padding_free_resume_mid_epoch_continues_at_the_next_example(runs: Any) -> None:
    packed, resumed = runs("packed"), runs("packed_resumed")
    assert resumed["steps"] == packed["steps"][CHECKPOINT:]
    once({"steps": packed["steps"][:CHECKPOINT] + resumed["steps"], "idx": packed["idx"]})
    assert resumed["losses"] == pytest.approx(packed["losses"][CHECKPOINT:], abs=1e-5)


def make_trainer(runs: Any, tmp_path: Path, **options: Any) -> Any:
    """A TokenBudgetSFTTrainer on the raw conversational data, TRL's collator; ``options``: SFTConfig's."""
    from tokenbatch.integrations.trl import TokenBudgetSFTTrainer

    return TokenBudgetSFTTrainer(
        model=tc.tiny_llama(len(runs.tokenizer)),
        args=tc.config(tmp_path, **options),
        train_dataset=runs.raw(),
        processing_class=runs.tokenizer,
        max_tokens=MAX_TOKENS,
    )


def test_packing_is_taken_as_padding_free_packs_of_whole_examples(
    runs: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    with caplog.at_level(logging.INFO, logger="tokenbatch"):
        trainer = make_trainer(runs, tmp_path, packing=True, max_length=MAX_LENGTH)
    assert "packing=True: whole examples packed" in caplog.text
    assert (trainer.args.packing, trainer.args.padding_free) == (False, True)
    collator = trainer.data_collator
    assert isinstance(collator, DataCollatorForLanguageModeling) and collator.padding_free
    assert trainer.token_cost.packing == "full"
    # TRL truncated the examples and packed none of them together: one row per example
    assert "seq_lengths" not in trainer.train_dataset.column_names
    assert max(len(ids) for ids in trainer.train_dataset["input_ids"]) <= MAX_LENGTH


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"packing": True, "packing_strategy": "wrapped"}, r"packing_strategy should be 'bfd'.*'wrapped'"),
        ({"eval_packing": True}, r"eval_packing=True with padded training.*set eval_packing=False"),
    ],
)
def test_a_packing_that_cuts_examples_is_refused_with_what_to_use(
    runs: Any, tmp_path: Path, options: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        make_trainer(runs, tmp_path, **options)


def test_an_example_over_the_budget_is_named_in_trls_data_and_in_the_users(
    runs: Any, tmp_path: Path, emotion_data_dir: Path
) -> None:
    """TRL drops row 1 (its prompt alone fills max_length), so the user's row 4 is TRL's sample 3."""
    import datasets

    from tokenbatch import OversizeSampleError
    from tokenbatch.integrations.trl import TokenBudgetSFTTrainer

    words = " ".join(tc.texts(emotion_data_dir, 64))
    rows = [{"prompt": f"short {i}\nemotion:", "completion": " joy"} for i in range(6)]
    rows[1]["prompt"] = words  # longer than max_length: nothing of the completion is left
    rows[4]["prompt"] = " ".join(words.split()[:30])  # within max_length, over the budget alone
    tok = runs.tokenizer
    trainer = TokenBudgetSFTTrainer(
        model=tc.tiny_llama(len(tok)),
        args=tc.config(tmp_path, max_length=MAX_LENGTH, remove_unused_columns=True),
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        max_tokens=30,
    )
    assert len(trainer.train_dataset) == 5 and "tokenbatch_row" not in trainer.train_dataset.column_names
    with pytest.raises(
        OversizeSampleError,
        match=r"sample 3 of trainer.train_dataset as TRL prepared it "
        r"\(row 4 of the train_dataset passed in\)",
    ):
        trainer.train()


def test_two_processes(torchrun: Any, emotion_data_dir: Path, minilm_path: str, tmp_path: Path) -> None:
    """Prompt/completion pairs, completion-only loss, accumulation 2, out-of-memory on one rank."""
    torchrun(SCRIPTS / "trl_ddp.py", emotion_data_dir, minilm_path, tmp_path, env={"ACCELERATE_USE_CPU": "1"})
    result = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("plain", "budget")}
    result |= {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in ("split", "halve")}
    plain, budget, split, halve = (result[name] for name in ("plain", "budget", "split", "halve"))
    counts = {name: once(run) for name, run in result.items()}
    assert len(set(counts.values())) == 1
    assert budget["steps"] == plain["steps"] and len(plain["losses"]) >= 2
    assert budget["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    assert budget["eval_loss"] == pytest.approx(plain["eval_loss"], abs=1e-5)
    # rank 1 ran out of memory in forward; every rank ran the step as micro-batches
    assert "rank 1 (forward)" in split["events"][0] and "micro-batches" in split["events"][0]
    assert split["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    assert split["eval_loss_oom"] == pytest.approx(split["eval_loss"], abs=1e-5)
    assert "rank 0 (backward)" in halve["events"][0] and "re-planned" in halve["events"][0]
    assert halve["injected"] > 0


@pytest.mark.slow
def test_two_processes_padding_free(
    torchrun: Any, emotion_data_dir: Path, minilm_path: str, tmp_path: Path
) -> None:
    """The same runs with packs: out of memory in forward on rank 1 (split), in backward on rank 0 (halve)."""
    args = (SCRIPTS / "trl_ddp.py", emotion_data_dir, minilm_path, tmp_path, "packed")
    torchrun(*args, env={"ACCELERATE_USE_CPU": "1"})
    result = {name: json.loads((tmp_path / f"{name}.json").read_text()) for name in RUNS_2P}
    plain, budget, split, halve = (result[name] for name in RUNS_2P)
    assert budget["packing"] == split["packing"] == halve["packing"] == "full"
    counts = {name: once(run) for name, run in result.items()}
    assert len(set(counts.values())) == 1
    assert budget["steps"] == plain["steps"] and len(plain["steps"]) >= 2
    assert budget["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    assert "rank 1 (forward)" in split["events"][0] and "micro-batches" in split["events"][0]
    assert split["steps"] == plain["steps"]
    assert split["losses"] == pytest.approx(plain["losses"], abs=1e-5)
    assert split["eval_loss_oom"] == pytest.approx(split["eval_loss"], abs=1e-5)
    assert budget["eval_loss"] == pytest.approx(split["eval_loss"], abs=1e-5)
    assert "rank 0 (backward)" in halve["events"][0] and "re-planned" in halve["events"][0]
    assert halve["injected"] > 0 and len(halve["steps"]) > len(budget["steps"])
