"""tokenbatch.lr: the learning rate a step runs with, schedulers left alone, the global count, errors.

The learning rate inside ``optimizer.step()`` is read by a step pre-hook of a
real optimizer, so what is checked is what the optimizer used. The global
count runs on 2 real processes (torchrun, gloo: ``tests/scripts/lr_global.py``).
"""

from __future__ import annotations

import doctest
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, LRScheduler, StepLR
from transformers import BatchEncoding

import tokenbatch
from tokenbatch import _lr as lr_module
from tokenbatch._lr import BatchScaledLR, count_batch, global_count, global_token_count

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "tests" / "scripts" / "lr_global.py"


def make_optimizer(lrs: tuple[float, ...] = (0.1, 0.03), kind: type = torch.optim.SGD) -> Any:
    """An optimizer with one parameter group per learning rate."""
    groups = [{"params": [torch.nn.Parameter(torch.ones(3))], "lr": lr} for lr in lrs]
    return kind(groups, lr=lrs[0])


def lrs_in_step(optimizer: Any) -> list[list[float]]:
    """A list that every later ``optimizer.step()`` appends its groups' learning rates to."""
    seen: list[list[float]] = []
    optimizer.register_step_pre_hook(lambda opt, *_: seen.append([float(g["lr"]) for g in opt.param_groups]))
    return seen


def mask(samples: int, length: int = 4, real: int | None = None) -> dict[str, torch.Tensor]:
    """A collated batch's attention mask: ``samples`` rows, the first ``real`` tokens of each real."""
    result = torch.zeros(samples, length, dtype=torch.long)
    result[:, : length if real is None else real] = 1
    return {"attention_mask": result}


def test_the_docstring_examples_run() -> None:
    assert doctest.testmod(lr_module).failed == 0


def test_the_guard_scales_each_optimizer_step_by_what_trained_in_it() -> None:
    """OOMFallback(lr_scaling=...): what its step() runs at, and the rate left to the scheduler."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: list[float] = []
    step = optimizer.step
    optimizer.step = lambda *a, **k: (seen.append(optimizer.param_groups[0]["lr"]), step(*a, **k))[1]
    sampler = tokenbatch.TokenBudgetBatchSampler([4, 5, 6] * 4, 64)
    fallback = tokenbatch.OOMFallback(
        sampler, model, lr_scaling="linear", lr_scaling_by="samples", lr_reference=2
    )
    loss = lambda x: model(x).square().mean()  # noqa: E731
    fallback.backward(torch.ones(4, 4), loss)
    assert fallback.step(optimizer) == 2.0 and seen == [0.2]  # 4 samples against 2
    fallback.backward(torch.ones(3, 4), loss)
    fallback.backward(torch.ones(5, 4), loss)  # accumulated: one step of 8 samples
    assert fallback.step(optimizer) == 4.0 and seen == [0.2, pytest.approx(0.4)]
    assert optimizer.param_groups[0]["lr"] == 0.1  # put back for the scheduler
    assert fallback.step(optimizer) == 1.0  # nothing trained since: the scheduler's rate stands
    plain = tokenbatch.OOMFallback(sampler, model)
    plain.backward(torch.ones(4, 4), loss)
    assert plain.step(optimizer) == 1.0 and seen[-1] == 0.1


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"lr_scaling": "linear"}, "lr_reference should be the step size"),
        ({"lr_reference": 64}, "lr_reference is used only with lr_scaling='linear' or 'sqrt'"),
        ({"lr_scaling": "cube", "lr_reference": 64}, "lr_scaling should be one of 'none', 'linear'"),
        ({"lr_scaling": "sqrt", "lr_scaling_by": "words", "lr_reference": 64}, "lr_scaling_by should be"),
    ],
)
def test_the_guards_lr_options_are_checked(options: dict[str, object], match: str) -> None:
    sampler = tokenbatch.TokenBudgetBatchSampler([4, 5, 6], 64)
    with pytest.raises(ValueError, match=match):
        tokenbatch.OOMFallback(sampler, torch.nn.Linear(4, 1), **options)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "rule, expected", [("linear", lambda r: r), ("sqrt", math.sqrt), ("none", lambda r: 1.0)]
)
@pytest.mark.parametrize("size", [16, 32, 100, 250])
def test_the_step_runs_at_base_times_rule_of_the_ratio_then_the_rate_is_restored(
    rule: str, expected: Callable[[float], float], size: int
) -> None:
    optimizer = make_optimizer()
    seen = lrs_in_step(optimizer)
    scaling = BatchScaledLR(optimizer, reference=32, rule=rule)
    with scaling.applied(size) as scale:
        optimizer.step()
    assert scale == pytest.approx(expected(size / 32))
    assert seen == [pytest.approx([0.1 * scale, 0.03 * scale])]
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.03]  # exactly, not approximately


def test_the_step_size_counts_samples_or_real_tokens() -> None:
    batch = mask(10, length=8, real=5)
    assert BatchScaledLR(make_optimizer(), reference=1).step_size(batch) == 10
    assert BatchScaledLR(make_optimizer(), reference=1, by="tokens").step_size(batch) == 50
    # Accumulated micro-batches add up.
    assert BatchScaledLR(make_optimizer(), reference=1).step_size(batch, mask(3)) == 13


def test_max_scale_caps_the_multiplier() -> None:
    optimizer = make_optimizer()
    seen = lrs_in_step(optimizer)
    scaling = BatchScaledLR(optimizer, reference=10, rule="linear", max_scale=3)
    with scaling.applied(100) as scale:
        optimizer.step()
    assert scale == 3.0 and seen == [pytest.approx([0.3, 0.09])]
    assert scaling.scale(20) == 2.0  # below the cap: the rule itself


def test_restored_when_the_step_raises() -> None:
    optimizer = make_optimizer()
    scaling = BatchScaledLR(optimizer, reference=1, rule="linear")
    with pytest.raises(RuntimeError, match="boom"), scaling.applied(4):
        raise RuntimeError("boom")
    assert [g["lr"] for g in optimizer.param_groups] == [0.1, 0.03]
    with scaling.applied(2) as scale:  # and usable again
        assert scale == 2.0


def test_a_tensor_learning_rate_is_scaled_in_place_and_restored() -> None:
    optimizer = make_optimizer(kind=torch.optim.Adam)
    for group in optimizer.param_groups:
        group["lr"] = torch.tensor(group["lr"])
    tensors = [g["lr"] for g in optimizer.param_groups]
    seen = lrs_in_step(optimizer)
    with BatchScaledLR(optimizer, reference=2, rule="linear").applied(8):
        optimizer.step()
    assert seen == [pytest.approx([0.4, 0.12])]
    assert all(g["lr"] is t for g, t in zip(optimizer.param_groups, tensors, strict=True))
    assert [float(t) for t in tensors] == pytest.approx([0.1, 0.03])


SCHEDULERS: dict[str, Callable[[Any], LRScheduler]] = {
    "LambdaLR": lambda opt: LambdaLR(opt, lambda step: 1 / (1 + step)),
    "StepLR": lambda opt: StepLR(opt, step_size=3, gamma=0.5),
    "CosineAnnealingLR": lambda opt: CosineAnnealingLR(opt, T_max=7),
}


def scheduled_run(make: Callable[[Any], LRScheduler], sizes: list[int] | None) -> tuple[list[Any], ...]:
    """Learning rates inside and between 10 steps, with scaling at ``sizes`` (None: no scaling)."""
    optimizer = make_optimizer()
    scheduler = make(optimizer)
    seen = lrs_in_step(optimizer)
    scaling = BatchScaledLR(optimizer, reference=32, rule="sqrt")
    between, scales = [], []
    for step in range(10):
        if sizes is None:
            optimizer.step()
        else:
            with scaling.applied(sizes[step]) as scale:
                optimizer.step()
            scales.append(scale)
        scheduler.step()
        between.append([g["lr"] for g in optimizer.param_groups])
    return seen, between, scales, scheduler.get_last_lr()


@pytest.mark.parametrize("name", SCHEDULERS)
def test_a_scheduler_keeps_its_schedule(name: str) -> None:
    make = SCHEDULERS[name]
    plain_in_step, plain_between, _, plain_last = scheduled_run(make, None)
    # At ratio 1 everything is as without scaling.
    assert scheduled_run(make, [32] * 10)[:2] == (plain_in_step, plain_between)
    # At any ratios, the scheduler's own rates are unchanged, and each step runs at its rate times the scale.
    sizes = [32, 128, 8, 64, 200, 32, 50, 16, 96, 40]
    in_step, between, scales, last = scheduled_run(make, sizes)
    assert between == plain_between and last == plain_last
    for seen, plain, scale in zip(in_step, plain_in_step, scales, strict=True):
        assert seen == pytest.approx([lr * scale for lr in plain])
    assert scales == pytest.approx([math.sqrt(s / 32) for s in sizes])


def test_count_batch_reads_the_attention_mask() -> None:
    batch = BatchEncoding(
        {"input_ids": torch.ones(2, 3), "attention_mask": torch.tensor([[1, 1, 1], [1, 0, 0]])}
    )
    assert (count_batch(batch), count_batch(batch, by="tokens")) == (2, 4)
    assert count_batch(batch["attention_mask"].bool(), by="tokens") == 4  # the mask itself, any dtype


def test_counts_on_one_process_are_the_local_ones() -> None:
    assert global_count(7) == 7
    assert global_token_count(mask(3, length=5, real=2)) == 6


@pytest.mark.parametrize(
    "options, error, message",
    [
        (dict(reference=0), ValueError, "reference should be a positive finite number, but got reference=0"),
        (dict(reference="32"), TypeError, "reference should be a positive number, but got reference='32'"),
        (dict(reference=True), TypeError, "reference should be a positive number, but got reference=True"),
        (
            dict(reference=math.inf),
            ValueError,
            "reference should be a positive finite number, but got reference=inf",
        ),
        (
            dict(reference=32, rule="cube"),
            ValueError,
            "rule should be one of 'linear', 'sqrt', 'none', but got rule='cube'",
        ),
        (
            dict(reference=32, by="words"),
            ValueError,
            "by should be one of 'samples', 'tokens', but got by='words'",
        ),
        (
            dict(reference=32, max_scale=-1),
            ValueError,
            "max_scale should be a positive finite number, but got max_scale=-1",
        ),
    ],
)
def test_bad_options_are_named(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with pytest.raises(error, match=f"^{message}$".replace("(", r"\(").replace(")", r"\)")):
        BatchScaledLR(make_optimizer(), **options)


def test_bad_uses_are_named() -> None:
    with pytest.raises(
        TypeError, match=r"^optimizer should be an optimizer with param_groups .* but got optimizer=Linear"
    ):
        BatchScaledLR(torch.nn.Linear(2, 2), reference=32)
    scaling = BatchScaledLR(make_optimizer(), reference=32)
    with pytest.raises(ValueError, match=r"^size should be a positive finite number, but got size=0$"):
        scaling.scale(0)
    with pytest.raises(TypeError, match=r"^size should be a positive number, but got size=None$"):
        scaling.applied(None).__enter__()  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match=r"should not be nested"), scaling.applied(32), scaling.applied(32):
        pass
    assert [g["lr"] for g in scaling.optimizer.param_groups] == [0.1, 0.03]
    with pytest.raises(TypeError, match=r"^step_size\(\) should be given the step's batches, but got none$"):
        scaling.step_size()
    with pytest.raises(TypeError, match=r"^count should be an integer >= 0, but got count=2.5$"):
        global_count(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^count should be an integer >= 0, but got count=-1$"):
        global_count(-1)


def test_bad_batches_are_named() -> None:
    expected = r"^batch should be a mapping with an 'attention_mask' tensor, or that tensor, but got a dict"
    with pytest.raises(TypeError, match=expected + r" with keys \['input_ids'\]$"):
        count_batch({"input_ids": torch.ones(2, 3)})
    with pytest.raises(TypeError, match=r"but got batch=\[\[1, 1\]\]$"):
        count_batch([[1, 1]])
    with pytest.raises(
        ValueError,
        match=r"^attention_mask should be a 2-D \(batch, sequence\) tensor, but got shape \(2, 1, 3, 3\)$",
    ):
        count_batch({"attention_mask": torch.ones(2, 1, 3, 3)})
    with pytest.raises(ValueError, match=r"^by should be one of 'samples', 'tokens', but got by='rows'$"):
        count_batch(mask(2), by="rows")


@pytest.mark.slow
def test_the_global_count_sums_both_ranks_and_their_micro_batches(tmp_path: Path, torchrun: Any) -> None:
    torchrun(SCRIPT, tmp_path, timeout=180)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["local_samples"] for r in ranks] == [3, 7]  # the ranks differ: only a sum agrees
    for report in ranks:
        assert report["global_samples"] == 10 and report["global_tokens_first_batch"] == 7 + 13
        # Rank 0: 3 texts and 7 tokens; rank 1: 5 + 2 texts and 13 + 4 tokens. Reference 5, linear.
        assert report["samples"] == {"size": 10, "lr_in_step": pytest.approx(0.01 * 10 / 5), "lr_after": 0.01}
        assert report["tokens"] == {"size": 24, "lr_in_step": pytest.approx(0.01 * 24 / 5), "lr_after": 0.01}


def test_under_accelerate_accumulation_the_step_counts_every_batch_of_its_group() -> None:
    """accelerate's loop calls fallback.step() after every batch; the syncing one steps, scaled by all."""
    from accelerate import Accelerator

    torch.manual_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    sampler = tokenbatch.TokenBudgetBatchSampler([4, 5, 6] * 4, 64)
    fallback = tokenbatch.OOMFallback(
        sampler, model, accelerator=accelerator, lr_scaling="linear", lr_scaling_by="samples", lr_reference=2
    )
    scales = []
    for rows in (1, 2, 3, 3):
        with accelerator.accumulate(model):
            fallback.backward(torch.ones(rows, 4), lambda x: model(x).square().mean())
            scales.append(fallback.step(optimizer))
            optimizer.zero_grad()
    assert scales == [1.0, 1.5, 1.0, 3.0]  # (1 + 2) / 2 and (3 + 3) / 2 samples against 2
