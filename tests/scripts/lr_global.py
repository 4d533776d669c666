"""The global step size of BatchScaledLR on 2 real processes (torchrun, gloo).

Usage: python -m torch.distributed.run --nproc_per_node 2 lr_global.py OUT_DIR

Run by tests/test_lr.py. The ranks hold batches of different sizes (rank 0:
3 texts, 7 real tokens; rank 1: 5 texts, 13 real tokens; rank 1 accumulates
a second micro-batch of 2 texts, 4 tokens), so a count that is not summed
over ranks and micro-batches would differ between them. Each rank writes
``OUT_DIR/rank{r}.json`` with what it counted and the learning rate its
optimizer saw inside the step.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tokenbatch._lr import BatchScaledLR, count_batch, global_count, global_token_count

MASKS = {
    0: [[[1, 1, 1], [1, 1, 0], [1, 1, 0]]],  # one batch: 3 texts, 7 tokens
    1: [[[1, 1, 1], [1, 1, 1], [1, 1, 0], [1, 1, 0], [1, 1, 1]], [[1, 1], [1, 1]]],  # 5 + 2 texts, 13 + 4
}


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    batches = [{"attention_mask": torch.tensor(mask)} for mask in MASKS[rank]]
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    report: dict[str, object] = {"rank": rank}
    for by in ("samples", "tokens"):
        scaling = BatchScaledLR(optimizer, reference=5, by=by, rule="linear")
        size = scaling.step_size(*batches)
        seen: list[float] = []
        handle = optimizer.register_step_pre_hook(
            lambda opt, *_, seen=seen: seen.append(opt.param_groups[0]["lr"])
        )
        with scaling.applied(size):
            optimizer.step()
        handle.remove()
        report[by] = {"size": size, "lr_in_step": seen[0], "lr_after": optimizer.param_groups[0]["lr"]}
    report["local_samples"] = sum(count_batch(b) for b in batches)
    report["global_samples"] = global_count(report["local_samples"])  # type: ignore[arg-type]
    report["global_tokens_first_batch"] = global_token_count(batches[0])
    (out / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()  # while both ranks are here: a gloo group left for teardown can abort


if __name__ == "__main__":
    main(Path(sys.argv[1]))
