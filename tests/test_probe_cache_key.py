"""What the budget cache calls a model: its hub name or path, else its class and its shapes."""

from __future__ import annotations

import torch
from transformers import BertConfig, BertModel

from tokenbatch.probe import BudgetKey
from tokenbatch.probe._auto import model_name


def bert(hidden: int, layers: int, seed: int = 0) -> BertModel:
    torch.manual_seed(seed)
    config = BertConfig(
        vocab_size=100,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=2,
        intermediate_size=2 * hidden,
        max_position_embeddings=64,
    )
    return BertModel(config)


def test_models_built_in_code_of_one_class_but_other_sizes_get_other_names() -> None:
    # One name for both would hand the small model's remembered budget to the large one.
    small, large = bert(16, 1), bert(64, 4)
    assert model_name(small).startswith("BertModel[") and model_name(large).startswith("BertModel[")
    assert model_name(small) != model_name(large)
    assert model_name(small) != model_name(bert(16, 2))  # one more layer is another model


def test_the_same_architecture_shares_its_name_whatever_its_weights() -> None:
    assert model_name(bert(16, 1, seed=0)) == model_name(bert(16, 1, seed=1))


def test_a_named_model_keeps_its_hub_name_or_path() -> None:
    model = bert(16, 1)
    model.config.name_or_path = "org/tiny-bert"
    assert model_name(model) == "org/tiny-bert"
    assert model_name(torch.nn.Linear(3, 2), config=model.config) == "org/tiny-bert"


def test_memory_sizes_below_a_gibibyte_get_keys_of_their_own() -> None:
    # As "0.1GiB" both, 64 MiB and 128 MiB shared one remembered budget (and 40 MiB and 64 KiB "0.0GiB").
    def key(memory: int) -> str:
        return str(BudgetKey("tiny", "cpu:x86_64", memory, "float32", 1))

    assert len({key(64 * 2**20), key(128 * 2**20), key(40 * 2**20), key(2**16)}) == 4
    assert key(8 * 2**30) == "tiny | cpu:x86_64 8.0GiB | float32 | x1"  # a GPU's or a larger limit: as before
    assert key(128 * 2**20) == "tiny | cpu:x86_64 128MiB | float32 | x1"
