"""TokenBudgetSFTTrainer on 2 processes (torchrun, CPU, gloo): the runs tests/test_integration_trl.py checks.

Usage: torchrun --nproc_per_node 2 trl_ddp.py DATA_DIR MINILM_DIR OUT_DIR [padded|packed]

One after the other in the same processes, rank 0 writing ``OUT_DIR/<run>.json``:

- ``plain``: trl.SFTTrainer on the batches the token budget plans (epoch 0), padded;
- ``budget``: TokenBudgetSFTTrainer, no out-of-memory;
- ``split``: split mode, out of memory in the forward pass on rank 1 only (and in evaluation);
- ``halve``: halve mode, out of memory in the backward pass on rank 0 only.

``packed`` (the last argument): the token budget's runs are padding-free
(``padding_free=True``, packs costed with ``packing="full"`` for the eager
tiny Llama), and ``plain`` trains those packs as padded batches.

Each run is one epoch of 64 prompt/completion pairs, gradient accumulation 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import datasets
import torch
import transformers
import trl_common as tc

MAX_TOKENS, OOM_LIMIT = 300.0, 160.0
RUNS: dict[str, dict[str, Any]] = {
    "plain": {"plain": True},
    "budget": {},
    "split": {"oom": {"max_tokens": OOM_LIMIT, "ranks": [1]}},
    "halve": {"oom": {"max_tokens": OOM_LIMIT, "where": "backward", "ranks": [0]}, "oom_mode": "halve"},
}


def main() -> None:
    data_dir, minilm, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    packed = "full" if sys.argv[4:] == ["packed"] else None
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    datasets.disable_progress_bar()
    tok = tc.tokenizer(minilm, [*tc.texts(data_dir, 64), *tc.texts(data_dir, 24, "validation")])
    data, eval_data = tc.pairs(data_dir, 64), tc.pairs(data_dir, 24, split="validation")
    arguments = {"gradient_accumulation_steps": 2, "disable_tqdm": True}
    for name, options in RUNS.items():
        result = tc.train(
            data,
            tok,
            out / name,
            max_tokens=MAX_TOKENS,
            eval_data=eval_data,
            arguments=arguments,
            packed=packed,
            **options,
        )
        data, eval_data = result.pop("dataset"), result.pop("eval_dataset")
        if torch.distributed.get_rank() == 0:
            (out / f"{name}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
