"""The plain accelerate loop on packs under OOMFallback, run by tests/test_oom_packs_loop.py.

Usage: python -m torch.distributed.run --nproc_per_node N pack_loop.py OUT_DIR
(``ACCELERATE_USE_CPU=1``; N is 1 or 2).

Examples are token ids whose first token is the example's own marker (token
``TEXT_VOCAB + index``), so the rows of the input embedding with a gradient at
an optimizer step are the examples that step trained: what was trained is read
from the gradients (the guard averages them over the ranks, so every rank sees
the step's examples on all ranks), not from tokenbatch's counters. The tiny
Llama has eager attention and untied embeddings (the LM head would otherwise
give every row a gradient); transformers builds the block-diagonal mask of a
pack from its ``position_ids``.

Each scenario runs in the same processes, one after the other, the loop as the
README has it (``OOMFallback(sampler, model, accelerator=...)``, ``iterate``,
``backward``, ``step``), on packs collated by ``DataCollatorWithFlattening``:

- ``packed``: no OOM; ``padded``: the same examples per step (the epoch's global
  plan as a fixed list of batches, shared out by accelerate as it shares the
  sampler's), collated by ``DataCollatorWithPadding``, plain loop;
- ``split-forward``, ``split-backward``, ``halve-forward``, ``halve-backward``:
  injected OOM (``inject_oom(cost=sampler)``, a pack costed as a pack), two epochs;
- ``whole`` and ``resumed``: halve mode with one OOM at step 1, trained through,
  or saved with ``accelerator.save_state`` after ``STOP`` steps and resumed in
  new objects with ``load_state``.

Rank r writes ``OUT_DIR/rank{r}.json``: per scenario the examples and loss of
every step, by epoch, the events and the final parameters' checksum.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from oom_common import quiet
from trl_common import tiny_llama

from tokenbatch import CostModel, OOMFallback, TokenBudgetBatchSampler
from tokenbatch.testing import inject_oom

TEXT_VOCAB = 48
NUM_EXAMPLES = 96
COST = CostModel.attention(256, packing="full")  # eager attention: scores over the whole row
BUDGET = 240.0
LIMIT = 150.0  # packs costing more "run out of memory"
STOP = 2  # steps trained before the checkpoint


def lm_rows(n: int = NUM_EXAMPLES, seed: int = 0) -> list[dict[str, Any]]:
    """Token ids of long-tailed lengths (4 to 40), the first one the example's marker; labels = ids."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(np.log(12), 0.5, n).astype(int), 4, 40)
    rows = []
    for i, length in enumerate(lengths.tolist()):
        ids = [TEXT_VOCAB + i, *rng.integers(1, TEXT_VOCAB, length - 1).tolist()]
        rows.append({"input_ids": ids, "labels": list(ids)})
    return rows


def tiny_model(seed: int = 0) -> torch.nn.Module:
    """trl_common's tiny Llama with its own LM head: only the inputs give an embedding row a gradient."""
    model = tiny_llama(TEXT_VOCAB + NUM_EXAMPLES, seed)
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def padded_collator() -> Any:
    """``DataCollatorWithPadding`` (right padding, a mask), the labels -100 on padding."""
    from tokenizers import Tokenizer, models
    from transformers import DataCollatorWithPadding, PreTrainedTokenizerFast

    backend = Tokenizer(models.WordLevel({"[PAD]": 0, "[UNK]": 1}, unk_token="[UNK]"))
    pad = DataCollatorWithPadding(PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]"))

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = dict(pad([{"input_ids": r["input_ids"]} for r in rows]))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch

    return collate


def trained_examples(model: torch.nn.Module) -> list[int]:
    """The examples whose marker row of the input embedding has a gradient."""
    grad = model.get_input_embeddings().weight.grad
    if grad is None:
        return []
    return (torch.nonzero(grad[TEXT_VOCAB:].abs().sum(dim=1)).flatten()).tolist()


def build(accelerator: Any, rows: list[dict[str, Any]], *, mode: str, padded: bool = False) -> dict[str, Any]:
    from torch.utils.data import DataLoader
    from transformers import DataCollatorWithFlattening

    lengths = [len(r["input_ids"]) for r in rows]
    sampler = TokenBudgetBatchSampler(lengths, BUDGET, cost=COST, seed=0)
    if padded:  # the same examples per step: the epoch's plan, a fixed list that accelerate shares out
        plan = list(
            TokenBudgetBatchSampler(
                lengths, BUDGET, cost=COST, seed=0, num_replicas=accelerator.num_processes
            )
        )
        loader = DataLoader(rows, batch_sampler=plan, collate_fn=padded_collator())
    else:
        loader = DataLoader(rows, batch_sampler=sampler, collate_fn=DataCollatorWithFlattening())
    model = tiny_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = OOMFallback(sampler, model, accelerator=accelerator, mode=mode)
    return {
        "sampler": sampler,
        "loader": loader,
        "model": model,
        "optimizer": optimizer,
        "fallback": fallback,
    }


def train_epoch(
    accelerator: Any, run: dict[str, Any], *, guard: bool = True, stop: int | None = None
) -> dict[str, Any]:
    """One epoch of the loop (or ``stop`` steps): each step's examples (from gradients) and loss."""
    model, optimizer, fallback = run["model"], run["optimizer"], run["fallback"]
    inner = accelerator.unwrap_model(model)
    steps: list[list[int]] = []
    losses: list[float] = []
    for batch in fallback.iterate(run["loader"]) if guard else run["loader"]:
        if guard:
            loss = fallback.backward(batch, lambda b: model(**b).loss)
            if loss is None:  # halve mode dropped the step: its examples come again, re-planned
                continue
        else:
            loss = model(**batch).loss
            accelerator.backward(loss)
            loss = loss.detach()
        steps.append(trained_examples(inner))
        losses.append(float(loss))
        if guard:
            fallback.step(optimizer)
        else:
            optimizer.step()
        optimizer.zero_grad()
        if stop is not None and len(steps) == stop:
            break
    return {"steps": steps, "losses": losses}


def checksum(model: torch.nn.Module) -> list[float]:
    return [float(p.detach().double().sum()) for p in model.parameters()]


def scenario(
    accelerator: Any, rows: list[dict[str, Any]], mode: str, where: str | None, epochs: int
) -> dict[str, Any]:
    run = build(accelerator, rows, mode=mode)
    epochs_done = []
    injector = None
    if where is not None:
        ranks = [1] if where == "forward" and accelerator.num_processes > 1 else None  # one rank, or all
        injector = inject_oom(run["model"], LIMIT, where=where, ranks=ranks, cost=run["sampler"])
    try:
        for epoch in range(epochs):
            run["sampler"].set_epoch(epoch)
            epochs_done.append(train_epoch(accelerator, run))
    finally:
        if injector is not None:
            injector.remove()
    fallback = run["fallback"]
    return {
        "epochs": epochs_done,
        "events": [str(e) for e in fallback.events],
        "growth": [str(e) for e in fallback.growth_events],
        "injected": 0 if injector is None else injector.count,
        "checksum": checksum(run["model"]),
    }


def resume(rows: list[dict[str, Any]], root: Path) -> dict[str, Any]:
    """Halve mode, one OOM at step 1: trained through, then saved after STOP steps and resumed.

    Each run has its own accelerator, with its own fallback registered for checkpointing.
    """
    from accelerate import Accelerator

    report: dict[str, Any] = {}
    for name in ("whole", "first", "resumed"):
        accelerator = Accelerator(cpu=True)
        run = build(accelerator, rows, mode="halve")
        accelerator.register_for_checkpointing(run["fallback"])
        if name == "resumed":
            accelerator.load_state(str(root / "checkpoint"))
            report[name] = train_epoch(accelerator, run)
        else:
            with inject_oom(run["model"], max_tokens=1, times=1, after=1, cost=run["sampler"]):
                report[name] = train_epoch(accelerator, run, stop=None if name == "whole" else STOP)
        if name == "first":
            report["saved_replans"] = len(run["fallback"].state_dict()["sampler"]["replans"])
            accelerator.save_state(str(root / "checkpoint"))
            accelerator.wait_for_everyone()  # the main process wrote it; every rank reads it next
        report[f"{name}_events"] = [str(e) for e in run["fallback"].events]
        report[f"{name}_checksum"] = checksum(run["model"])
    return report


def main() -> None:
    from accelerate import Accelerator

    quiet()
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    rows = lm_rows()
    report: dict[str, Any] = {"world": accelerator.num_processes}
    report["packed"] = scenario(accelerator, rows, "split", None, epochs=1)
    padded = build(accelerator, rows, mode="split", padded=True)
    report["padded"] = {
        "epochs": [train_epoch(accelerator, padded, guard=False)],
        "checksum": checksum(padded["model"]),
    }
    for mode in ("split", "halve"):
        for where in ("forward", "backward"):
            report[f"{mode}-{where}"] = scenario(accelerator, rows, mode, where, epochs=2)
    report["resume"] = resume(rows, out)
    (out / f"rank{accelerator.process_index}.json").write_text(json.dumps(report))
    accelerator.wait_for_everyone()


if __name__ == "__main__":
    main()
