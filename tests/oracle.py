"""Inputs every rank can regenerate, and references computed in one process from full W."""

import numpy as np
import torch

import gossamer


def data(rank, shape=(3, 5), dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    return torch.randint(-50, 50, shape, generator=g, dtype=torch.int64).to(dtype)


def machine_input():
    """This rank's (3, 2) float64 input, chosen so that a machine's average is its machine rank
    (BlueFog's test input)."""
    L = gossamer.local_size()
    return torch.full(
        (3, 2), gossamer.machine_rank() + gossamer.local_rank() - (L - 1) / 2, dtype=torch.float64
    )


def mix(W, inputs):
    """y_i = sum_j W[j, i] x_j for every i, in float64."""
    W = np.asarray(W, dtype=np.float64)
    xs = torch.stack([x.double() for x in inputs])
    return [
        sum(W[j, i] * xs[j] for j in range(len(inputs)) if W[j, i] != 0) for i in range(len(inputs))
    ]


def uniform(W):
    """BlueFog's unweighted default: 1/(indegree+1) on self and every in-neighbour."""
    A = (np.asarray(W) != 0) | np.eye(len(W), dtype=bool)
    return A / A.sum(axis=0, keepdims=True)


def tolerance(dtype):
    return {
        torch.float16: dict(rtol=2e-3, atol=2e-3),
        torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
        torch.float32: dict(rtol=1e-5, atol=1e-6),
    }.get(dtype, dict(rtol=1e-12, atol=1e-12))


def assert_close(got, want, dtype=torch.float64, msg=None, **tol):
    """got has dtype and matches want within dtype's tolerance, or tol; compared in float64."""
    assert got.dtype == dtype, f"{msg or ''}dtype {got.dtype}"
    torch.testing.assert_close(
        got.double(),
        want.double(),
        **(tol or tolerance(dtype)),
        msg=None if msg is None else lambda m: msg + m,
    )


def assert_all_close(results, expected, dtype):
    for rank, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert_close(got, want, dtype, msg=f"rank {rank}: ")
