"""The fused accumulate + norm kernel (horovod_micro.accumulate) against torch, no ranks."""

import math

import pytest
import torch

from horovod_micro.accumulate import add_and_square


@pytest.mark.parametrize("n", [0, 1, 15, 16, 17, 33, 1000, 100_003])
def test_sum_and_squares_equal_torch_in_float64(n):
    gen = torch.Generator().manual_seed(n)
    e, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen) * 1e3
    out = torch.full((n,), 7.0)
    squared = add_and_square(e, g, out)
    assert torch.equal(out, e + g)  # float32 adds, bit for bit
    want = float((e + g).double().pow(2).sum())
    assert squared == pytest.approx(want, rel=1e-12, abs=1e-300)
    # No gradient (a parameter without one): a_t is the residual itself.
    out.fill_(7.0)
    assert add_and_square(e, None, out) == pytest.approx(float(e.double().pow(2).sum()),
                                                         rel=1e-12, abs=1e-300)
    assert torch.equal(out, e)


def test_nonfinite_entries_and_large_finite_ones():
    e = torch.zeros(40)
    e[17] = math.nan
    assert math.isnan(add_and_square(e, torch.ones(40), torch.empty(40)))
    e[17] = math.inf
    assert math.isinf(add_and_square(e, None, torch.empty(40)))
    # float32 squares beyond its range (3e38^2) do not overflow the float64 sum.
    big = torch.full((40,), 3e38)
    assert add_and_square(big, None, torch.empty(40)) == pytest.approx(40 * 9e76, rel=1e-6)


def test_tensors_the_kernel_cannot_serve_are_left_to_torch(monkeypatch):
    out = torch.full((8,), 7.0)
    assert add_and_square(torch.ones(8, dtype=torch.float64), None,
                          torch.empty(8, dtype=torch.float64)) is None
    assert add_and_square(torch.ones(8), torch.ones(8, dtype=torch.float16), out) is None
    assert add_and_square(torch.ones(16)[::2], None, out) is None  # not contiguous
    assert add_and_square(torch.ones(9), None, out) is None  # sizes differ
    monkeypatch.setenv("HOROVOD_MICRO_SELECT", "torch")  # the device-generic path
    assert add_and_square(torch.ones(8), None, out) is None
    assert torch.equal(out, torch.full((8,), 7.0))  # nothing written
