"""The sampler where users put it: accelerate's checkpoints and options, DataLoaders with workers.

save_state / load_state mid-epoch run for real on one process and on two
(accelerate launch, gloo on CPU), with 0 and 2 DataLoader workers, with and
without OOMFallback; the rest runs in this process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.data_loader import DataLoaderShard, skip_first_batches
from torch.utils.data import DataLoader

from tokenbatch import OOMFallback, TokenBudgetBatchSampler

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "accelerate_checkpoint.py"
LENGTHS = np.random.default_rng(0).integers(4, 60, size=300)
INDICES = list(range(len(LENGTHS)))


def loader(sampler: TokenBudgetBatchSampler, kind: str, workers: int = 0) -> Any:
    """A DataLoader over the sampler: torch's own, or accelerate's one-process DataLoaderShard."""
    make = DataLoaderShard if kind == "accelerate" else DataLoader
    return make(INDICES, batch_sampler=sampler, collate_fn=list, num_workers=workers)


# -- what a checkpoint counts: the loop's steps, never those read ahead -----------------------


@pytest.mark.parametrize("kind", ["torch", "accelerate"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_guards_state_counts_the_steps_trained_not_those_read_ahead(kind: str, workers: int) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    fallback = OOMFallback(sampler, torch.nn.Linear(2, 2))
    trained: list[int] = []
    for step, batch in enumerate(fallback.iterate(loader(sampler, kind, workers))):
        assert fallback.state_dict()["sampler"]["steps_done"] == step  # this one is not trained yet
        if step == 3:
            break
        trained += batch  # asking for the next batch is what marks this one trained (or backward)
    state = fallback.state_dict()  # once the loop is left
    assert state["sampler"]["steps_done"] == 3
    resumed = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    OOMFallback(resumed, torch.nn.Linear(2, 2)).load_state_dict(state)
    rest = [i for batch in loader(resumed, kind, workers) for i in batch]
    assert sorted(trained + rest) == INDICES  # every sample exactly once


@pytest.mark.parametrize("workers", [0, 2])
def test_the_samplers_own_count_is_refused_where_accelerate_reads_ahead(workers: int) -> None:
    """What accelerator.save_state calls on a registered sampler: refused, naming what to register instead."""
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    for step, _ in enumerate(loader(sampler, "accelerate", workers)):
        with pytest.raises(ValueError, match=r"steps_done should be given .* Register the OOMFallback"):
            sampler.state_dict()
        if step + 1 == 3:
            break
    with pytest.raises(ValueError, match="steps_done should be given"):
        sampler.state_dict()  # and once the loop is left
    assert sampler.state_dict(steps_done=3)["steps_done"] == 3  # the loop's own count is taken


def test_a_dataloader_with_workers_reads_ahead_of_the_samplers_own_count() -> None:
    """The documented limit of a plain DataLoader: the sampler counts what it yielded to the workers."""
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    for step, _ in enumerate(loader(sampler, "torch", workers=2)):
        if step + 1 == 3:
            break
    assert sampler.state_dict()["steps_done"] > 3  # prefetch_factor * num_workers batches ahead


def test_the_default_state_at_the_end_of_an_epoch_is_the_whole_epoch() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    prepared = loader(sampler, "accelerate", workers=2)
    for _ in prepared:
        pass
    assert sampler.state_dict()["steps_done"] == sampler.plan.num_steps  # the loop had every batch
    del prepared  # gone: nothing says how far its loop got, so the sampler's count is refused
    with pytest.raises(ValueError, match="steps_done should be given"):
        sampler.state_dict()


def test_skip_first_batches_without_a_loaded_state_needs_the_loops_count() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    for step, _ in enumerate(skip_first_batches(loader(sampler, "accelerate"), 4)):
        if step + 1 == 2:
            break
    with pytest.raises(ValueError, match="steps_done should be given"):
        sampler.state_dict()
    assert sampler.state_dict(steps_done=6)["steps_done"] == 6  # 4 trained before the restart, 2 since


def test_skip_first_batches_after_the_sampler_resumed_is_refused() -> None:
    source = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    sampler.load_state_dict(source.state_dict(steps_done=4))
    skipping = skip_first_batches(loader(sampler, "accelerate"), 4)
    with pytest.raises(ValueError, match=r"skip_first_batches should not be used after the sampler's state"):
        next(iter(skipping))
    with pytest.raises(ValueError, match=r"should not skip batches under OOMFallback"):
        next(iter(OOMFallback(sampler, torch.nn.Linear(2, 2)).iterate(skipping)))
    assert [i for batch in loader(sampler, "accelerate") for i in batch]  # the DataLoader itself resumes


@pytest.mark.parametrize("workers", [0, 2])
def test_use_stateful_dataloader_still_resumes_every_sample_once(workers: int, tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader asks the sampler for its own position, and skips what it read ahead."""

    def run(resume: bool) -> list[int]:
        config = DataLoaderConfiguration(use_stateful_dataloader=True)
        accelerator = Accelerator(cpu=True, dataloader_config=config)
        sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
        prepared = accelerator.prepare(loader(sampler, "torch", workers))
        accelerator.register_for_checkpointing(sampler)
        if resume:
            accelerator.load_state(str(tmp_path))
        trained: list[int] = []
        for step, batch in enumerate(prepared):
            trained += batch
            if not resume and step + 1 == 3:
                accelerator.save_state(str(tmp_path))
                break
        return trained

    assert sorted(run(False) + run(True)) == INDICES


@pytest.mark.slow
@pytest.mark.parametrize("processes", [1, 2])
def test_accelerate_save_state_and_load_state_mid_epoch_train_every_sample_once(
    accelerate_launch: Any, processes: int, tmp_path: Path
) -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(ACCELERATE_USE_CPU="1", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    launcher = accelerate_launch() if processes == 2 else [sys.executable]
    command = [*launcher, str(SCRIPT), str(tmp_path)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(processes)]
    everything = list(range(len(_script_lengths())))
    for name in (
        "workers=0,guard=False",
        "workers=0,guard=True",
        "workers=2,guard=False",
        "workers=2,guard=True",
    ):
        runs = [report["resume"][name] for report in ranks]
        epoch0 = sorted(i for run in runs for i in run["before"] + run["rest"])
        assert epoch0 == everything, name  # exactly once over both runs and every rank
        assert sorted(i for run in runs for i in run["epoch1"]) == everything, name
        if "guard=True" in name:
            assert all(run["start"] == 4 for run in runs), name  # the 4 steps trained, not those read ahead
            assert runs[0]["replans"] == 1  # the guard's re-plan was saved
    for report in ranks:
        _check_options(report["options"], processes)
    if processes == 1:  # the DataLoader's state and the sampler's agree: every sample once
        assert ranks[0]["options"]["stateful"] is None
        assert sorted(ranks[0]["options"]["stateful_ids"]) == everything


def _script_lengths() -> list[int]:
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from accelerate_checkpoint import LENGTHS as lengths
    finally:
        sys.path.pop(0)
    return list(lengths)


def _check_options(options: dict[str, Any], processes: int) -> None:
    for workers in (0, 2):
        for guard in (False, True):
            refused = options[f"sampler,workers={workers},guard={guard}"]
            assert refused is not None and refused.startswith("ValueError: steps_done should be given"), (
                refused
            )
            assert "Register the OOMFallback for checkpointing instead" in refused
    # accelerate's own refusal at prepare: the sampler has no fixed batch size to split
    assert options["split"].startswith("ValueError: ") and "split_batches" in options["split"]
    assert "batch_size" in options["split"]
    assert options["dispatch"].startswith("ValueError: dispatch_batches should be False")
    assert options["skip"].startswith("ValueError: skip_first_batches should not be used after the sampler")
    if processes == 2:  # a wrapped sampler is resumed by skipping: on top of its own state, refused
        assert options["stateful"].startswith("ValueError: the sampler should not be checkpointed itself")
    forgot = options["set_epoch"]["forgot"]
    if processes == 1:  # accelerate's DataLoader calls set_epoch with its own count of passes
        assert forgot == [] and not options["set_epoch"]["same"]
    else:  # it does not on two processes: the same plan again, and one warning
        assert len(forgot) == 1 and options["set_epoch"]["same"]
        assert forgot[0].startswith("TokenBudgetBatchSampler: epoch 0 is iterated again in full")
        assert "Call sampler.set_epoch(epoch) before each epoch" in forgot[0]
    assert options["set_epoch"]["called"] == 0  # no warning once set_epoch is called
    # The README's loop without sampler.set_epoch(epoch): the guard keeps the sampler's epoch (accelerate's
    # own count would be sent back to it on a resume), so on one process too every epoch is epoch 0 again,
    # and the documented warning fires, once.
    guarded = options["set_epoch_guard"]
    assert guarded["same"] and guarded["epoch"] == 0
    assert len(guarded["forgot"]) == 1, guarded["forgot"]
    assert guarded["forgot"][0].startswith("TokenBudgetBatchSampler: epoch 0 is iterated again in full")


# -- accelerate's batch-shape options (issue 15 item 3) ------------------------------------


def test_split_batches_is_refused_by_the_guard_with_the_fix() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(split_batches=True))
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    message = r"split_batches should be False for TokenBudgetBatchSampler, but got split_batches=True"
    with pytest.raises(ValueError, match=message):
        OOMFallback(sampler, torch.nn.Linear(2, 2), accelerator=accelerator)
    with pytest.raises(ValueError, match=r"split_batches==True.*batch_size"):  # accelerate's own refusal
        accelerator.prepare(loader(sampler, "torch"))  # the sampler has no fixed batch size to split


def test_dispatch_batches_is_refused_when_iterated_with_the_fix() -> None:
    accelerator = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=True))
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    message = r"dispatch_batches should be False for TokenBudgetBatchSampler, but got dispatch_batches=True"
    with pytest.raises(ValueError, match=message):
        next(iter(accelerator.prepare(loader(sampler, "torch"))))


# -- set_epoch forgotten (issue 15 item 4) ---------------------------------------------------


def passes(sampler: TokenBudgetBatchSampler, count: int, *, set_epoch: bool = False) -> list[list[int]]:
    """The samples of ``count`` passes of a DataLoader over ``sampler``, one list per pass."""
    result = []
    for epoch in range(count):
        if set_epoch:
            sampler.set_epoch(epoch)
        result.append([i for batch in loader(sampler, "torch") for i in batch])
    return result


def test_a_second_full_pass_without_set_epoch_warns_once() -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1)
    with pytest.warns(UserWarning, match=r"epoch 0 is iterated again in full, with the same plan") as caught:
        epochs = passes(sampler, 3)
    assert epochs[0] == epochs[1] == epochs[2]
    assert len([w for w in caught if "set_epoch" in str(w.message)]) == 1


@pytest.mark.parametrize("case", ["set_epoch", "no shuffle", "resume", "replan"])
def test_no_warning_where_repeating_is_right(case: str) -> None:
    sampler = TokenBudgetBatchSampler(LENGTHS, 256, seed=1, shuffle=case != "no shuffle")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if case == "set_epoch":
            passes(sampler, 3, set_epoch=True)
        elif case == "no shuffle":
            passes(sampler, 3)  # every epoch has the same plan anyway
        else:
            passes(sampler, 1)
            if case == "resume":
                sampler.load_state_dict(sampler.state_dict(steps_done=3))
            else:
                sampler.replan(128, steps_done=3)
            passes(sampler, 1)  # the rest of the epoch, once


# -- lengths that are all equal (issue 15 item 5) --------------------------------------------


def test_equal_lengths_warn_and_say_to_pad_dynamically() -> None:
    with pytest.warns(UserWarning, match=r"all 1000 samples have the same length \(128\)") as caught:
        TokenBudgetBatchSampler([128] * 1000, 2048)
    message = str(caught[0].message)
    assert "max_tokens=2048 is a fixed batch of 16" in message
    assert "--pad_to_max_length False" in message and "DataCollatorWithPadding" in message
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        TokenBudgetBatchSampler([128] * 999 + [127], 2048)
        TokenBudgetBatchSampler([128], 2048)  # one sample: nothing to tell


# -- accelerate training alone on each process of a launch (issue 30) ---------------------------


@pytest.mark.slow
def test_accelerate_alone_on_each_process_is_refused_on_every_rank(torchrun: Any, tmp_path: Path) -> None:
    """torchrun on CPU without ACCELERATE_USE_CPU=1: a process group of 2, accelerate sees 1 process."""
    torchrun(REPO / "tests" / "scripts" / "accelerate_alone.py", tmp_path, env={"ACCELERATE_USE_CPU": "0"})
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert (report["world"], report["num_processes"]) == (2, 1)
        for case in ("guard", "guard, no accelerator", "loop", "stream"):
            error = report[case]
            assert error is not None, (rank, case)
            assert error.startswith(
                "RuntimeError: num_processes should be torch.distributed's world size 2, but accelerate "
                "got num_processes=1"
            ), (rank, case, error)
            assert "set ACCELERATE_USE_CPU=1" in error
        assert report["drawn"] == 0  # refused before the first batch
