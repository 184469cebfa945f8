"""Small problems every rank can regenerate, their centralized solutions, and a training loop."""

import numpy as np
import torch

import gossamer

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


def least_squares_loss(model, A, b):
    return ((model(A).squeeze(1) - b) ** 2).mean() / 2


def train_least_squares(make_optimizer, steps, lr, decay, after_step=None, go_on=None):
    """Fit linear_model to this rank's share with SGD at step size lr / (1 + k / decay).

    ``make_optimizer(sgd, model)`` wraps the SGD optimizer; ``after_step(k, opt, model)``, if
    given, runs after step k; ``go_on()``, if given, keeps training past ``steps`` while it
    is true. Returns ``(model, opt)``, not synchronized.
    """
    A, b = least_squares_data(gossamer.rank())
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=lr)
    opt = make_optimizer(sgd, model)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda k: 1 / (1 + k / decay))
    k = 0
    while k < steps or (go_on is not None and go_on()):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
        schedule.step()
        if after_step is not None:
            after_step(k, opt, model)
        k += 1
    return model, opt
