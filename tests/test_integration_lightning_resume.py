"""Lightning checkpoints mid-epoch resume with exactly the samples not yet trained (one process here).

``trainer.fit(model, ckpt_path=...)`` from checkpoints saved by ``ModelCheckpoint``
after a training step (mid-epoch and at an epoch's last batch) and at an epoch's
end; the 2-process case is in tests/test_integration_lightning.py. Which samples
were trained is what ``training_step`` received (tests/scripts/lightning_common.py).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenbatch.integrations.lightning import TokenBudgetCallback
from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "scripts"))
try:
    import lightning_common as lc
finally:
    sys.path.pop(0)

EPOCHS = 2
NOT_RESUMABLE = "You're resuming from a checkpoint that ended before the epoch ended"
pytestmark = [
    pytest.mark.filterwarnings("ignore:.*does not have many workers"),
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
    pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`"),
    # Manual optimisation: the checkpoint holds the state after the step, which is what resuming needs.
    pytest.mark.filterwarnings("ignore:Using ModelCheckpoint with manual optimization"),
]


@pytest.fixture(scope="module", autouse=True)
def _quiet_one_thread() -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    lc.quiet()
    yield
    torch.set_num_threads(threads)


def assert_each_sample_once(batches: dict[int, list[list[int]]]) -> None:
    assert sorted(batches) == list(range(EPOCHS))
    for epoch in range(EPOCHS):
        seen = sorted(i for batch in batches[epoch] for i in batch)
        assert seen == list(range(lc.NUM_SAMPLES)), f"epoch {epoch}: not every sample exactly once"


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[lc.Recorder, Path]:
    """A 2-epoch run of 7 steps an epoch, checkpointed every 3 steps, at step 7 and at each epoch's end."""
    out = tmp_path_factory.mktemp("lightning_resume")
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = lc.Recorder(rows, sampler)
    callbacks = [
        TokenBudgetCallback(sampler),
        lc.checkpoints(out / "steps", every_n_train_steps=3),
        lc.checkpoints(out / "last_batch", every_n_train_steps=7),
        lc.checkpoints(out / "epoch_end", every_n_epochs=1, save_on_train_epoch_end=True),
    ]
    lc.trainer(default_root_dir=out, callbacks=callbacks, enable_checkpointing=True).fit(module)
    assert [len(module.batches[e]) for e in range(EPOCHS)] == [7, 7]
    return module, out


@pytest.mark.parametrize(
    "checkpoint",
    [
        "steps/epoch=0-step=3",
        "steps/epoch=0-step=6",
        "steps/epoch=1-step=9",
        "last_batch/epoch=0-step=7",
        "epoch_end/epoch=0-step=7",
    ],
)
def test_fit_from_a_checkpoint_resumes_at_the_next_sample(
    original: tuple[lc.Recorder, Path], tmp_path: Path, checkpoint: str
) -> None:
    module, out = original
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    resumed = lc.Recorder(rows, sampler)
    run = lc.trainer(default_root_dir=tmp_path, callbacks=[TokenBudgetCallback(sampler)])
    filters = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(resumed, ckpt_path=out / f"{checkpoint}.ckpt")
    # Lightning's "dataloader is not resumable" would be wrong: the sampler resumed where training stopped.
    assert not [w for w in caught if NOT_RESUMABLE in str(w.message)]
    assert list(warnings.filters) == filters  # muted for the resume only

    step = int(checkpoint.split("step=")[1])
    before = lc.trained_before(module.batches, step)
    assert_each_sample_once(lc.joined(before, resumed.batches))
    assert lc.joined(before, resumed.batches) == module.batches  # the same batches, in the same order
    assert run.global_step == 2 * 7
    assert torch.equal(resumed.flat_params(), module.flat_params())  # as if never interrupted


def test_lightnings_resume_warning_stands_where_no_sampler_position_was_saved(
    original: tuple[lc.Recorder, Path], tmp_path: Path
) -> None:
    """A mid-epoch checkpoint saved without the callback's sampler state: Lightning's warning is right."""
    _, out = original
    checkpoint = torch.load(out / "steps" / "epoch=0-step=3.ckpt", weights_only=False)
    del checkpoint["tokenbatch"]  # as if saved without TokenBudgetCallback
    torch.save(checkpoint, tmp_path / "bare.ckpt")
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    run = lc.trainer(default_root_dir=tmp_path, callbacks=[TokenBudgetCallback(sampler)])
    with pytest.warns(UserWarning, match=re.escape(NOT_RESUMABLE)):
        run.fit(lc.Recorder(rows, sampler), ckpt_path=tmp_path / "bare.ckpt")


def test_a_sampler_made_in_train_dataloader_cannot_resume_mid_epoch(
    original: tuple[lc.Recorder, Path], tmp_path: Path
) -> None:
    """Lightning sizes the epoch before train_dataloader() makes it: refused with the fix, not repeated."""
    _, out = original
    run = lc.trainer(default_root_dir=tmp_path, callbacks=[TokenBudgetCallback()])
    with pytest.raises(
        ValueError, match=r"should be given the training sampler .* TokenBudgetCallback\(sampler\)"
    ):
        run.fit(lc.Recorder(lc.make_rows(), None), ckpt_path=out / "steps" / "epoch=0-step=3.ckpt")


@pytest.mark.parametrize("grow", [False, True])
def test_a_resumed_run_starts_from_the_budget_an_oom_lowered(tmp_path: Path, grow: bool) -> None:
    """The fallback's state (budget, events, growth bracket) is in the checkpoint: no OOM to find it again."""
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = lc.Recorder(rows, sampler, manual=True, grow=grow)
    callbacks = [TokenBudgetCallback(sampler), lc.checkpoints(tmp_path / "ckpt", every_n_train_steps=3)]
    with inject_oom(module.net, max_tokens=100) as injector:  # every batch over 100 padded tokens fails
        lc.trainer(default_root_dir=tmp_path, callbacks=callbacks, enable_checkpointing=True).fit(module)
    fallback = module.fallback
    assert fallback is not None and injector.count >= 1
    assert fallback.max_tokens < lc.BUDGET and fallback.events[0].step < 3  # lowered before the checkpoint
    before_checkpoint = sum(1 for e in fallback.events if (e.epoch, e.step) < (0, 3))

    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    resumed = lc.Recorder(rows, sampler, manual=True, grow=grow)
    run = lc.trainer(default_root_dir=tmp_path / "resumed", callbacks=[TokenBudgetCallback(sampler)])
    with inject_oom(resumed.net, max_tokens=100) as again:
        run.fit(resumed, ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
    assert resumed.fallback is not None
    # Only the OOMs the original had after the checkpoint (none without growth): the budget, events and
    # growth bracket came along, and the resumed run goes on as the uninterrupted one did.
    assert again.count == injector.count - before_checkpoint
    assert resumed.fallback.events == fallback.events
    assert resumed.fallback.max_tokens == fallback.max_tokens
    assert resumed.fallback.growth_events == fallback.growth_events  # their history too
    before = lc.trained_before(module.batches, 3)
    assert_each_sample_once(lc.joined(before, resumed.batches))
    assert torch.allclose(resumed.flat_params(), module.flat_params(), atol=1e-6, rtol=0)


def test_a_fallback_state_left_unclaimed_is_warned_about(tmp_path: Path) -> None:
    rows = lc.make_rows()
    sampler = lc.make_sampler(rows)
    module = lc.Recorder(rows, sampler, manual=True)
    callbacks = [TokenBudgetCallback(sampler), lc.checkpoints(tmp_path / "ckpt", every_n_train_steps=3)]
    with inject_oom(module.net, max_tokens=100, times=1):
        lc.trainer(default_root_dir=tmp_path, callbacks=callbacks, enable_checkpointing=True).fit(module)
    sampler = lc.make_sampler(rows)
    run = lc.trainer(default_root_dir=tmp_path / "resumed", callbacks=[TokenBudgetCallback(sampler)])
    with pytest.warns(UserWarning, match=r"held an OOMFallback's state .* was not resumed"):
        run.fit(lc.Recorder(rows, sampler), ckpt_path=tmp_path / "ckpt" / "epoch=0-step=3.ckpt")
