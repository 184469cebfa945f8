"""Logistic regression on scikit-learn's bundled breast-cancer data, split across ranks."""

import numpy as np
import pytest
import torch
from sklearn.datasets import load_breast_cancer

import gossamer
from gossamer import optim
from gossamer.testing import run_distributed

STEPS, LR = 200, 0.5


def _data():
    X, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(y))
    X, y = X[order], y[order].astype(np.float64)
    train, test = slice(100, None), slice(0, 100)
    mean, std = X[train].mean(0), X[train].std(0)
    X = (X - mean) / std
    return (
        torch.tensor(X[train]),
        torch.tensor(y[train]),
        torch.tensor(X[test]),
        torch.tensor(y[test]),
    )


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(30, 1).double()


def _accuracy(model, X, y):
    with torch.no_grad():
        return float(((model(X).squeeze(1) > 0).double() == y).double().mean())


def _fit(model, opt, X, y):
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(STEPS):
        opt.zero_grad()
        loss_fn(model(X).squeeze(1), y).backward()
        opt.step()


def _decentralized(kind):
    X, y, X_test, y_test = _data()
    r, n = gossamer.rank(), gossamer.size()
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    cls = {"atc": optim.AdaptThenCombine, "awc": optim.AdaptWithCombine}[kind]
    opt = cls(sgd, model)
    _fit(model, opt, X[r::n], y[r::n])
    opt.synchronize()
    return _accuracy(model, X_test, y_test)


@pytest.mark.parametrize("kind", ["atc", "awc"])
def test_accuracy_within_one_point_of_centralized_training(kind):
    X, y, X_test, y_test = _data()
    model = _model()
    _fit(model, torch.optim.SGD(model.parameters(), lr=LR), X, y)
    centralized = _accuracy(model, X_test, y_test)
    assert centralized > 0.9
    for accuracy in run_distributed(_decentralized, 4, args=(kind,)):
        assert abs(accuracy - centralized) <= 0.01, (accuracy, centralized)
