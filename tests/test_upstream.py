"""Every private attribute tokenbatch reads of another library still exists: a loud failure when one moves.

Each test names the attribute and what breaks without it, so that an upgrade
of transformers, Lightning, accelerate or Python that moves one fails here,
with the reason, rather than somewhere deep in a training run.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from packaging.version import Version

from tokenbatch.integrations import _upstream


def test_trainer_still_has_what_the_guarded_step_calls() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers import Trainer

    assert callable(getattr(Trainer, "_prepare_inputs", None)), (
        "Trainer._prepare_inputs is gone: the guarded training step can no longer move a batch to the "
        "device as training_step does (tokenbatch/integrations/_upstream.py:prepare_inputs)"
    )
    assert callable(getattr(Trainer, "_get_collator_with_removed_columns", None)), (
        "Trainer._get_collator_with_removed_columns is gone: a stream's DataLoader cannot get Trainer's "
        "collator (_upstream.collator_without_unused_columns)"
    )
    if Version(transformers.__version__) >= Version("5"):
        source = Trainer.__init__.__code__.co_names
        assert "_loss_shifts_labels" in source, (
            "Trainer no longer sets _loss_shifts_labels: labelled items of a causal LM's loss would be "
            "counted unshifted (_upstream.loss_shifts_labels)"
        )


def test_lightning_still_has_what_the_callback_reads() -> None:
    pl = pytest.importorskip("lightning.pytorch")
    trainer = pl.Trainer(
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False
    )
    connector = getattr(trainer, "_accelerator_connector", None)
    assert hasattr(connector, "use_distributed_sampler"), (
        "Lightning's Trainer._accelerator_connector.use_distributed_sampler is gone: TokenBudgetCallback "
        "cannot tell that Lightning will replace the batch sampler (_upstream.lightning_replaces_samplers)"
    )
    assert hasattr(trainer.fit_loop, "_combined_loader"), (
        "Lightning's fit_loop._combined_loader is gone: a token-budget epoch keeps Lightning's first "
        "epoch's length (_upstream.lightning_combined_loader)"
    )
    assert _upstream.lightning_replaces_samplers(trainer) is True  # Lightning's default


def test_accelerate_still_lists_what_it_prepared() -> None:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(torch.nn.Linear(2, 2))
    assert _upstream.accelerate_prepared_models(accelerator) == [model], (
        "Accelerator._models no longer lists the prepared models: finish() cannot warn of a DDP model "
        "that outlives the process group (_upstream.accelerate_prepared_models)"
    )
    accelerator.free_memory()


def test_python_still_lets_a_filter_be_removed_by_hand() -> None:
    assert callable(getattr(warnings, "_filters_mutated", None)), (
        "warnings._filters_mutated is gone: TokenBudgetCallback's muted Lightning warning may stay cached "
        "after it is unmuted (_upstream.warnings_changed)"
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", message="muted for a moment")
        entry = warnings.filters[0]
        warnings.warn("muted for a moment", UserWarning, stacklevel=1)
        warnings.filters.remove(entry)  # type: ignore[attr-defined]
        _upstream.warnings_changed()
        warnings.warn("muted for a moment", UserWarning, stacklevel=1)
    assert len(caught) == 1


def test_transformers_configs_still_say_which_attention_runs() -> None:
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2
    )
    for kernel in ("eager", "sdpa"):
        model = LlamaForCausalLM(LlamaConfig(**config.to_dict(), attn_implementation=kernel))
        assert _upstream.attention_implementation(model) == kernel, (
            "a model's config._attn_implementation no longer names its attention kernel: a padding-free "
            "trainer cannot tell per-example (flash, flex) from whole-row (eager, sdpa) attention costs "
            "(_upstream.attention_implementation)"
        )
    assert _upstream.attention_implementation(torch.nn.Linear(2, 2)) is None
