"""The overlapped reducer's pure parts on one process: the units, and one attempt's bookkeeping.

The collectives themselves, and what happens when a rank fails, are tested
on real processes in tests/test_oom_overlap.py.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenbatch.oom._ddp import OverlapReducer, plan_units

DTYPES = (torch.float32, torch.float16)


@settings(max_examples=200, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 600), st.sampled_from(DTYPES)), min_size=1, max_size=30),
    bucket=st.integers(4, 2000),
    inplace=st.integers(4, 2000),
)
def test_units_cover_every_parameter_once_in_a_fixed_order(
    sizes: list[tuple[int, torch.dtype]], bucket: int, inplace: int
) -> None:
    params = [torch.zeros(n, dtype=dtype) for n, dtype in sizes]
    units = plan_units(params, bucket_bytes=bucket, inplace_bytes=inplace)
    assert units == plan_units(params, bucket_bytes=bucket, inplace_bytes=inplace)  # a pure function
    indices = [i for unit in units for i in unit.indices]
    assert sorted(indices) == list(range(len(params)))
    nbytes = [p.numel() * p.element_size() for p in params]
    alone = [u for u in units if not u.packed]
    large = [i for i, b in enumerate(nbytes) if b >= inplace]
    assert [u.indices[0] for u in alone] == large[::-1]
    assert units[: len(alone)] == alone  # large gradients first, the packed buckets after them
    for unit in units:
        assert {params[i].dtype for i in unit.indices} == {unit.dtype}
        assert unit.numel == sum(params[i].numel() for i in unit.indices)
        if unit.packed and len(unit.indices) > 1:
            assert sum(nbytes[i] for i in unit.indices) <= bucket
        if unit.packed:
            assert list(unit.indices) == sorted(unit.indices, reverse=True)  # backward's order


def model() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def test_an_attempt_adds_the_groups_earlier_gradients_and_leaves_them_intact() -> None:
    reference = model()
    reference(torch.ones(4, 8)).sum().backward()
    net = model()
    params = list(net.parameters())
    earlier = [torch.full_like(p, 2.0) if i % 2 == 0 else None for i, p in enumerate(params)]
    kept = [None if e is None else e.clone() for e in earlier]
    reducer = OverlapReducer(params, bucket_bytes=64, inplace_bytes=64)
    attempt = reducer.begin(earlier)
    with attempt.armed():
        net(torch.ones(4, 8)).sum().backward()
    assert attempt.issued_early > 0  # units went out before the last gradient came
    attempt.finish().average_into_grads([True] * len(params))
    for param, plain, before in zip(params, reference.parameters(), earlier, strict=True):
        expected = plain.grad if before is None else plain.grad + before  # type: ignore[operator]
        assert torch.equal(param.grad, expected)  # type: ignore[arg-type]  # one process: the sum itself
    assert all(e is None or torch.equal(e, k) for e, k in zip(earlier, kept, strict=True))
    issued = attempt.issued
    net(torch.ones(4, 8)).sum().backward()  # the hooks are gone: nothing happens to the attempt
    assert attempt.issued == issued


def test_a_gradient_accumulated_twice_after_its_unit_went_out_names_the_fix() -> None:
    net = model()
    attempt = OverlapReducer(list(net.parameters()), bucket_bytes=64, inplace_bytes=64).begin(None)
    with attempt.armed():
        net(torch.ones(2, 8)).sum().backward()
        with pytest.raises(RuntimeError, match=r"overlap=False"):
            net(torch.ones(2, 8)).sum().backward()


def test_a_failed_attempt_issues_every_unit_left() -> None:
    net = model()
    attempt = OverlapReducer(list(net.parameters()), bucket_bytes=64, inplace_bytes=64).begin(None)
    hidden = net[1](net[0](torch.ones(2, 8)))
    hidden.register_hook(lambda grad: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory.")))
    with attempt.armed(), pytest.raises(torch.OutOfMemoryError):
        net[2](hidden).sum().backward()
    assert 0 < attempt.issued < len(attempt.reducer.units)  # the last layer's went out, then backward failed
    attempt.abandon()
    assert attempt.issued == len(attempt.reducer.units)
