"""Lightning on 2 real processes (``Trainer(devices=2, strategy="ddp")``, gloo), run by
tests/test_integration_lightning.py.

Usage: python lightning_ddp.py OUT_DIR

Lightning's own launcher starts the second process (it runs this script again
with ``LOCAL_RANK=1``). The scenarios run one after the other in the same two
processes; each writes what the test checks (the batches each rank trained per
epoch, losses, events, final parameters, or the error raised) to
``OUT_DIR/rank{r}.pt``.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lightning_common import Recorder, checkpoints, make_rows, make_sampler, quiet, trainer

from tokenbatch.integrations.lightning import TokenBudgetCallback
from tokenbatch.testing import inject_oom

LIMIT = 100  # rank 1's first batch above this many padded tokens "runs out of memory"


def fit(
    module: Recorder,
    *,
    callback: TokenBudgetCallback | None,
    extra: tuple[Any, ...] = (),
    ckpt_path: Path | None = None,
    **options: Any,
) -> dict[str, Any]:
    """Fit on 2 processes (``extra`` callbacks; from ``ckpt_path``); what this rank trained, or its error."""
    callbacks = [*([] if callback is None else [callback]), *extra]
    options.setdefault("use_distributed_sampler", False)
    run = trainer(devices=2, strategy="ddp", callbacks=callbacks, **options)
    try:
        run.fit(module, ckpt_path=ckpt_path)
    except Exception as error:
        # The root of the chain: Lightning may raise its own error while handling ours.
        while error.__cause__ is not None or error.__context__ is not None:
            error = error.__cause__ or error.__context__  # type: ignore[assignment]
        return {"error": f"{type(error).__name__}: {error}"}
    fallback = module.fallback
    return {
        "batches": module.batches,
        "losses": module.losses,
        "params": module.flat_params(),
        "rank": None if module.sampler is None else module.sampler.rank,
        "events": [] if fallback is None else [event.as_dict() for event in fallback.events],
        "max_tokens": None if fallback is None else fallback.max_tokens,
        "growth": [] if fallback is None else [str(event) for event in fallback.growth_events],
    }


def main(out: Path) -> None:
    quiet()
    warnings.filterwarnings("ignore", message=".*resuming from a checkpoint that ended before the epoch")
    rows = make_rows()
    results: dict[str, Any] = {}
    sampler = make_sampler(rows)
    results["auto"] = fit(Recorder(rows, sampler), callback=TokenBudgetCallback(sampler))
    # Checkpointed every 3 steps of the 4 an epoch has on 2 processes (mid-epoch 0 and 1), resumed from each.
    sampler = make_sampler(rows)
    saving = checkpoints(out / "checkpoints", every_n_train_steps=3)
    results["checkpointed"] = fit(
        Recorder(rows, sampler),
        callback=TokenBudgetCallback(sampler),
        extra=(saving,),
        enable_checkpointing=True,
    )
    for step in (3, 6):
        sampler = make_sampler(rows)
        path = out / "checkpoints" / f"epoch={(step - 1) // 4}-step={step}.ckpt"
        results[f"resumed_{step}"] = fit(
            Recorder(rows, sampler), callback=TokenBudgetCallback(sampler), ckpt_path=path
        )
    sampler = make_sampler(rows)
    results["reference"] = fit(Recorder(rows, sampler, manual=True), callback=TokenBudgetCallback(sampler))
    sampler = make_sampler(rows)
    module = Recorder(rows, sampler, manual=True, grow=False)  # shrinking only (oom_grow below grows)
    with inject_oom(module.net, max_tokens=LIMIT, ranks={1}, times=1) as injector:
        results["oom_split"] = fit(module, callback=TokenBudgetCallback(sampler))
    results["oom_split"]["injected"] = injector.count
    # Growth on: rank 1 runs out of memory over LIMIT throughout; both ranks climb back alike.
    sampler = make_sampler(rows)
    module = Recorder(rows, sampler, manual=True, grow=True)
    with inject_oom(module.net, max_tokens=LIMIT, ranks={1}) as injector:
        results["oom_grow"] = fit(module, callback=TokenBudgetCallback(sampler))
    results["oom_grow"]["injected"] = injector.count
    sampler = make_sampler(rows)
    results["halve"] = fit(
        Recorder(rows, sampler, manual=True, mode="halve"), callback=TokenBudgetCallback(sampler)
    )
    # A sampler made inside train_dataloader() with rank=self.trainer.global_rank: found, given its epochs.
    results["rank_in_hook"] = fit(Recorder(rows, None, rank_in_hook=True), callback=TokenBudgetCallback())
    # The sampler made inside train_dataloader() without rank=: refused, not trained twice.
    results["unsharded"] = fit(Recorder(rows, None), callback=TokenBudgetCallback())
    # Lightning's default sampler replacement: refused in setup with the fix ...
    sampler = make_sampler(rows)
    results["replacement"] = fit(
        Recorder(rows, sampler), callback=TokenBudgetCallback(sampler), use_distributed_sampler=True
    )
    # ... where without the callback Lightning fails with a bare TypeError.
    results["replacement_no_callback"] = fit(
        Recorder(rows, make_sampler(rows)), callback=None, use_distributed_sampler=True
    )
    rank = torch.distributed.get_rank()
    torch.save(results, out / f"rank{rank}.pt")
    torch.distributed.barrier()  # rank 0 leaves only once rank 1 has written its results


if __name__ == "__main__":
    main(Path(sys.argv[1]))
