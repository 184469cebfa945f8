"""The combine arithmetic of the neighbour averages, written into a kept buffer or not."""

import pytest
import torch

from gossamer.combine import weighted_sum


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16], ids=str)
@pytest.mark.parametrize("weights", [None, {1: 0.25, 3: 0.5}], ids=["uniform", "weighted"])
def test_weighted_sum_into_out_is_bit_for_bit_the_new_tensor(dtype, weights):
    gen = torch.Generator().manual_seed(0)
    x, a, b = (torch.randn(1000, generator=gen).to(dtype) for _ in range(3))
    received = {3: b, 1: a}
    expected = weighted_sum(x, 0.25, received, weights)
    out = torch.full_like(x, float("nan"))
    got = weighted_sum(x, 0.25, received, weights, out)
    assert torch.equal(got, expected)
    # float32/64 land in out; 16-bit values are combined in float32, then rounded anew
    assert (got is out) == (dtype != torch.float16)
    if weights is None:  # sum first, then divide (BlueFog's order)
        wide = x.double() if dtype == torch.float64 else x.float()
        torch.testing.assert_close(got, ((wide + a + b) / 3).to(dtype), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_weighted_sum_without_sources_copies_x(dtype):
    x = torch.arange(4.0, dtype=dtype)
    out = torch.zeros(4, dtype=dtype)
    got = weighted_sum(x, 1.0, {}, None, out)
    assert (got is out) == (dtype == torch.float32)
    fresh = weighted_sum(x, 1.0, {}, None)
    for value in (got, fresh):
        assert value.dtype == dtype and torch.equal(value, x) and value.data_ptr() != x.data_ptr()
