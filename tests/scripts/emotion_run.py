"""examples/emotion/train.py as tests/test_example_emotion.py runs it: a tiny BERT, metrics to JSON.

Usage: ``emotion_run.py OUT.json [train.py's options]``, as one process or under
``accelerate launch``. Only the pretrained encoder is replaced, by a tiny random BERT
(hidden 32, 2 layers) with ``--model_name``'s tokenizer; everything else runs as users run
it. The main process writes what the test checks to OUT.json: the per-epoch metrics that
``train()`` returns, the world size, and the guard's OOM events and budgets at the end.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "emotion"


def load_example() -> ModuleType:
    """``examples/emotion/train.py`` as a module (it imports ``emotion`` from its own folder)."""
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("emotion_train", EXAMPLE / "train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_encoder(name: str, tokenizer: Any) -> Any:
    """A tiny random BERT sized for tests, in place of the pretrained encoder ``name``."""
    from transformers import BertConfig, BertModel

    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
        pad_token_id=tokenizer.pad_token_id,
    )
    return BertModel(config, add_pooling_layer=False)


def main(out: Path, argv: list[str]) -> None:
    """``example.main(argv)`` with the tiny encoder, its ``train()`` wrapped to record what it did."""
    example = load_example()
    made: list[Any] = []

    class RecordedFallback(example.OOMFallback):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            made.append(self)

    def train(args: Any, accelerator: Any) -> list[dict[str, Any]]:
        epochs: list[dict[str, Any]] = original(args, accelerator)
        fallback = made.pop()  # and no reference is left once this returns: finish() comes next
        if accelerator.is_main_process:
            results = {
                "world_size": accelerator.num_processes,
                "epochs": epochs,
                "oom_events": [event.as_dict() for event in fallback.events],
                "sampler_max_tokens": float(fallback.sampler.max_tokens),
                "max_tokens": float(fallback.max_tokens),
            }
            out.write_text(json.dumps(results, indent=2) + "\n")
        return epochs

    original = example.train
    example.OOMFallback, example.load_encoder, example.train = RecordedFallback, tiny_encoder, train
    example.main(argv)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
