"""Small problems every rank can regenerate, with their centralized solutions."""

import numpy as np
import torch

D, M = 5, 50


def least_squares_data(rank):
    """Rank's share of one linear-regression data set: b = A x_true + noise."""
    g = np.random.default_rng(rank)
    A = g.normal(size=(M, D))
    b = A @ np.linspace(-1, 1, D) + 0.5 * g.normal(size=M)
    return torch.tensor(A), torch.tensor(b)


def least_squares_optimum(world_size):
    parts = [least_squares_data(r) for r in range(world_size)]
    A = torch.cat([a for a, _ in parts]).numpy()
    b = torch.cat([b for _, b in parts]).numpy()
    return torch.tensor(np.linalg.lstsq(A, b, rcond=None)[0])


def linear_model():
    torch.manual_seed(0)  # the same start on every rank
    model = torch.nn.Linear(D, 1, bias=False).double()
    torch.nn.init.zeros_(model.weight)
    return model
