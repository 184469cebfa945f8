"""A small regression problem for the Bagua facade tests, and one-process references.

Every rank r has its own data (``data(r)``) and, before wrapping, its own initial model
(``model(r)``); ``with_bagua`` makes them all rank 0's. The references simulate all ranks
in one process from the full data.
"""

import torch
from torch import nn

from gossamer.bagua.communicators import shift_one_peer

D_IN, HIDDEN, N = 5, 4, 16


def data(rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(N, D_IN, generator=g, dtype=torch.float64)
    y = torch.randn(N, 1, generator=g, dtype=torch.float64) + rank
    return x, y


def model(rank):
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1)).double()


def loss(m, x, y):
    return ((m(x) - y) ** 2).mean()


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()]).clone()


def sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)


def grads(m, x, y):
    m.zero_grad()
    loss(m, x, y).backward()
    return [p.grad.clone() for p in m.parameters()]


def gradient_allreduce_reference(n, steps):
    """Trajectory of the one model that steps with the average gradient."""
    m = model(0)
    opt = sgd(m)
    out = []
    for _ in range(steps):
        per_rank = [grads(m, *data(r)) for r in range(n)]
        for p, *gs in zip(m.parameters(), *per_rank, strict=True):
            p.grad = sum(gs) / n
        opt.step()
        out.append(flat(m))
    return out


def mix(xs, mode, comm_index, machines_of=None):
    """One round of Bagua's decentralized op over per-rank flat weights ``xs``."""
    n = len(xs)
    if machines_of is not None:  # hierarchical: machine means, then the op over machines
        ms = sorted(set(machines_of))
        means = [torch.stack([xs[r] for r in range(n) if machines_of[r] == m]).mean(0) for m in ms]
        mixed = mix(means, mode, comm_index)
        return [mixed[machines_of[r]] for r in range(n)]
    if mode == "all":
        return [torch.stack(xs).mean(0)] * n
    out = []
    for r in range(n):
        p = shift_one_peer(r, n, comm_index)
        out.append(xs[r] if p is None else (xs[r] + xs[p]) / 2)
    return out


def set_flat(m, v):
    offset = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(v[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def decentralized_reference(n, steps, mode, interval=1, machines_of=None):
    """Per-rank trajectories of x_{t+1} = W x_t - lr * step(grad f_i(x_t))."""
    models = [model(0) for _ in range(n)]
    opts = [sgd(m) for m in models]
    out = [[] for _ in range(n)]
    comms = 0
    for t in range(1, steps + 1):
        gs = [grads(models[r], *data(r)) for r in range(n)]
        if (t - 1) % interval == 0:
            mixed = mix([flat(m) for m in models], mode, comms, machines_of)
            comms += 1
            for m, v in zip(models, mixed, strict=True):
                set_flat(m, v)
        for r in range(n):
            for p, g in zip(models[r].parameters(), gs[r], strict=True):
                p.grad = g
            opts[r].step()
            out[r].append(flat(models[r]))
    return out
