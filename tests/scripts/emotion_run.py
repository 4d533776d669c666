"""examples/emotion/train.py as tests/test_example_emotion.py runs it: a tiny BERT, rehearsed OOMs.

Usage: ``emotion_run.py OUT.json [--inject_above COST [--inject_where forward|backward] [--inject_rank R]]
[train.py's options]``, as one process or under ``accelerate launch``. Only the pretrained encoder is
replaced, by a tiny random BERT (hidden 32, 2 layers) with ``--model_name``'s vocabulary; everything else
runs as users run it. With ``--inject_above``, ``tokenbatch.testing.inject_oom`` makes the tiny encoder
raise a real ``torch.OutOfMemoryError`` (in its forward or backward pass, on every rank or on rank R) for
each training batch costing more, in the sampler's cost units: while the guard iterates the training data,
not during validation, which is unguarded. The main process writes OUT.json: the per-epoch metrics that
``train()`` returns (with the sampler's budget at each epoch's end), the world size, the learning-rate
multiplier of every optimizer step, and the guard's OOM events and budgets at the end.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import sys
from argparse import ArgumentParser, Namespace
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "emotion"


def load_example(name: str) -> ModuleType:
    """``examples/emotion/<name>`` as a module (it imports ``emotion`` from its own folder)."""
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location(f"emotion_{Path(name).stem}", EXAMPLE / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_encoder(name: str) -> Any:
    """A tiny random BERT sized for tests, in place of the pretrained encoder ``name`` (its vocabulary)."""
    from transformers import AutoConfig, BertConfig, BertModel

    pretrained = AutoConfig.from_pretrained(name)
    config = BertConfig(
        vocab_size=pretrained.vocab_size,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
        pad_token_id=pretrained.pad_token_id,
    )
    return BertModel(config, add_pooling_layer=False)


def rehearsal(argv: list[str]) -> tuple[Namespace, list[str]]:
    """This driver's options, and the example's (the rest)."""
    parser = ArgumentParser(allow_abbrev=False)
    parser.add_argument("--inject_above", type=float, help="training batches costing more run out of memory")
    parser.add_argument("--inject_where", choices=("forward", "backward"), default="forward")
    parser.add_argument("--inject_rank", type=int, help="on this rank only; unset: every rank")
    return parser.parse_known_args(argv)


def rehearse(example: ModuleType, options: Namespace) -> list[Any]:
    """Swap ``example``'s encoder for the tiny one and its guard for one that injects and records.

    Returns the list the guards made will be appended to.
    """
    from tokenbatch.testing import inject_oom

    encoders: list[Any] = []
    made: list[Any] = []

    def encoder(name: str) -> Any:
        encoders.append(tiny_encoder(name))
        return encoders[-1]

    class RehearsedFallback(example.OOMFallback):  # type: ignore[name-defined,misc]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.budgets: list[float] = []  # the sampler's budget at the end of each pass
            self.multipliers: list[float] = []  # what step() ran each optimizer step's rate at
            made.append(self)

        def iterate(self, dataloader: Iterable[Any]) -> Iterator[Any]:
            injected: Any = contextlib.nullcontext()
            if options.inject_above is not None:
                ranks = None if options.inject_rank is None else [options.inject_rank]
                injected = inject_oom(
                    encoders[-1],
                    options.inject_above,
                    where=options.inject_where,
                    ranks=ranks,
                    cost=self.sampler.cost,
                )
            with injected:
                yield from super().iterate(dataloader)
            self.budgets.append(float(self.sampler.max_tokens))

        def step(self, optimizer: Any) -> float:
            self.multipliers.append(super().step(optimizer))
            return self.multipliers[-1]

    example.OOMFallback, example.load_encoder = RehearsedFallback, encoder
    return made


def main(out: Path, argv: list[str]) -> None:
    """``example.main(argv)`` with the tiny encoder and the rehearsal; its ``train()`` records what it did."""
    options, argv = rehearsal(argv)
    example = load_example("train.py")
    made = rehearse(example, options)
    original = example.train

    def train(args: Any, accelerator: Any) -> list[dict[str, Any]]:
        epochs: list[dict[str, Any]] = original(args, accelerator)
        fallback = made.pop()  # and no reference is left once this returns: finish() comes next
        for record, budget in zip(epochs, fallback.budgets, strict=True):
            record["sampler_max_tokens"] = budget
        if accelerator.is_main_process:
            results = {
                "world_size": accelerator.num_processes,
                "epochs": epochs,
                "lr_multipliers": fallback.multipliers,
                "oom_events": [event.as_dict() for event in fallback.events],
                "sampler_max_tokens": float(fallback.sampler.max_tokens),
                "max_tokens": float(fallback.max_tokens),
            }
            out.write_text(json.dumps(results, indent=2) + "\n")
        return epochs

    example.train = train
    example.main(argv)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
