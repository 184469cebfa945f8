"""Inputs every rank can regenerate, and references computed in one process from full W."""

import numpy as np
import torch


def data(rank, shape=(3, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=torch.int64).to(dtype)


def mix(W, inputs):
    """y_i = sum_j W[j, i] x_j for every i, in float64."""
    W = np.asarray(W, dtype=np.float64)
    xs = torch.stack([x.double() for x in inputs])
    return [
        sum(W[j, i] * xs[j] for j in range(len(inputs)) if W[j, i] != 0) for i in range(len(inputs))
    ]


def tolerance(dtype):
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
    }.get(dtype, dict(rtol=1e-12, atol=1e-12))


def assert_all_close(results, expected, dtype):
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.dtype == dtype, f"rank {rank}: dtype {got.dtype}"
        torch.testing.assert_close(
            got.double(), want.double(), **tolerance(dtype), msg=lambda m, r=rank: f"rank {r}: {m}"
        )
