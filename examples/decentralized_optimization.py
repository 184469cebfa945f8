r"""Decentralized optimization: reach the optimum of a sum of local losses by gossip.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/decentralized_optimization.py
    gossamer run -np 4 examples/decentralized_optimization.py --problem logistic
    gossamer run -np 4 examples/decentralized_optimization.py --method push_diging

Rank ``i`` holds its own data ``(A_i, b_i)``, generated here, and a local loss ``f_i``:

- ``least_squares``: ``f_i(x) = ||A_i x - b_i||^2 / (2 m)``;
- ``logistic``: ``f_i(x) = (1/m) sum_k log(1 + exp(-b_ik a_ik^T x)) + (rho/2) ||x||^2``,
  with labels ``b_ik`` in {-1, +1}.

Every rank draws its data around its own ground truth, so the local optima differ and the
methods that are only approximately right show it. The goal is the minimizer ``x*`` of
``F(x) = (1/n) sum_i f_i(x)``, computed exactly first (closed form for least squares,
Newton's method for logistic regression, both on all-reduced sums). Then each method runs
``--max-iters`` iterations from ``x = 0``:

- ``centralized``: gradient descent on ``F`` with an all-reduced gradient (the baseline);
- ``diffusion``: adapt-then-combine, ``x <- W (x - lr grad f_i(x))``; with a constant step it
  stops at an O(lr) distance from ``x*``;
- ``exact_diffusion`` (Yuan et al., 2019): diffusion plus a correction that removes that
  bias;
- ``gradient_tracking`` (DIGing; Nedic et al., 2017): a second variable ``y_i`` tracks the
  average gradient, so the step follows ``grad F`` rather than ``grad f_i``;
- ``push_diging`` (Nedic et al., 2017): gradient tracking over one-sided windows with
  push-sum weights, which needs only column-stochastic weights, so it works on directed
  graphs whose weights are not doubly stochastic.

The update equations are written out below with gossamer's operations
(``neighbor_allreduce``, ``allreduce``, ``Window``), as BlueFog's ``pytorch_optimization.py``
does. Rank 0 shows a progress bar over the methods, then prints the relative distance to
the optimum, ``sqrt((1/n) sum_i ||x_i - x*||^2) / ||x*||``, every ``--print-every``
iterations, one column per method, and writes
``<out>/decentralized_optimization_<problem>.png``.
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import gossamer
from gossamer import topology as topo

METHODS = ("diffusion", "exact_diffusion", "gradient_tracking", "push_diging")
TOPOLOGIES = {"exponential": topo.exponential_two, "ring": topo.ring, "mesh": topo.mesh_grid_2d}


class Problem:
    """This rank's data and the gradient of its local loss ``f_i``."""

    def __init__(self, kind, samples, dim, rho, seed):
        self.kind, self.rho = kind, rho
        shared = torch.Generator().manual_seed(seed)
        truth = torch.randn(dim, generator=shared, dtype=torch.float64)
        mine = torch.Generator().manual_seed(seed + 1 + gossamer.rank())
        # Each rank's data follows its own perturbed truth: the local optima differ.
        local = truth + 0.5 * torch.randn(dim, generator=mine, dtype=torch.float64)
        self.A = torch.randn(samples, dim, generator=mine, dtype=torch.float64)
        noise = 0.1 * torch.randn(samples, generator=mine, dtype=torch.float64)
        self.b = self.A @ local + noise
        if kind == "logistic":
            self.b = torch.where(self.b >= 0, 1.0, -1.0).to(torch.float64)

    def grad(self, x):
        """Gradient of ``f_i`` at ``x``."""
        m = self.A.shape[0]
        if self.kind == "least_squares":
            return self.A.T @ (self.A @ x - self.b) / m
        # d/dx log(1 + exp(-b a^T x)) = -b a sigmoid(-b a^T x)
        return -self.A.T @ (self.b * torch.sigmoid(-self.b * (self.A @ x))) / m + self.rho * x

    def optimum(self):
        """The exact minimizer of ``F = (1/n) sum_i f_i`` (the same on every rank)."""
        m, dim = self.A.shape
        if self.kind == "least_squares":
            # Normal equations of F: (sum_i A_i^T A_i) x = sum_i A_i^T b_i.
            gram = gossamer.allreduce(self.A.T @ self.A / m)
            rhs = gossamer.allreduce(self.A.T @ self.b / m)
            return torch.linalg.solve(gram, rhs)
        x = torch.zeros(dim, dtype=torch.float64)
        for _ in range(30):  # Newton's method converges quadratically: 30 steps is plenty
            s = torch.sigmoid(self.b * (self.A @ x))
            hess = self.A.T @ (self.A * (s * (1 - s))[:, None]) / m + self.rho * torch.eye(dim)
            x = x - torch.linalg.solve(gossamer.allreduce(hess), gossamer.allreduce(self.grad(x)))
        return x


def centralized(problem, x, lr, iters, record):
    """Gradient descent on ``F``: every rank steps with the all-reduced (mean) gradient."""
    for _ in range(iters):
        record(x)
        x = x - lr * gossamer.allreduce(problem.grad(x))  # grad F = (1/n) sum_i grad f_i
    record(x)


def diffusion(problem, x, lr, iters, record, graph):
    """Adapt-then-combine: a local gradient step, then a weighted average with neighbours."""
    for _ in range(iters):
        record(x)
        psi = x - lr * problem.grad(x)  # adapt:   psi_i = x_i - lr grad f_i(x_i)
        x = gossamer.neighbor_allreduce(psi, topology=graph)  # combine: x_i = sum_j w_ji psi_j
    record(x)


def exact_diffusion(problem, x, lr, iters, record, graph):
    """Exact diffusion: adapt, correct, combine with ``(I + W) / 2``; no constant-step bias."""
    psi_prev = x
    for _ in range(iters):
        record(x)
        psi = x - lr * problem.grad(x)  # adapt:   psi^k = x^{k-1} - lr grad f_i(x^{k-1})
        phi = psi + x - psi_prev  # correct: phi^k = psi^k + x^{k-1} - psi^{k-1}
        # combine with W_bar = (I + W) / 2: x^k = (phi^k + sum_j w_ji phi_j^k) / 2
        x = (phi + gossamer.neighbor_allreduce(phi, topology=graph)) / 2
        psi_prev = psi
    record(x)


def gradient_tracking(problem, x, lr, iters, record, graph):
    """DIGing: ``y_i`` tracks the mean gradient; both averages travel at the same time.

    It mixes with ``W' = (I + W) / 2``, whose eigenvalues lie in [0, 1]: with ``W`` itself
    (eigenvalue -1/3 on the ring and the mesh) the default step diverges.
    """
    y = problem.grad(x)  # y^0 = grad f_i(x^0), so mean_i y_i = grad F at every step
    g_prev = y
    for _ in range(iters):
        record(x)
        # The two neighbour averages are independent: start both, then wait.
        wx = gossamer.neighbor_allreduce(x, topology=graph, async_op=True)
        wy = gossamer.neighbor_allreduce(y, topology=graph, async_op=True)
        x = (x + wx.wait()) / 2 - lr * y  # x^{k+1} = W' x^k - lr y^k
        g = problem.grad(x)
        y = (y + wy.wait()) / 2 + g - g_prev  # y^{k+1} = W' y^k + grad f_i(x^{k+1}) - grad f_i(x^k)
        g_prev = g
    record(x)


def push_diging(problem, x, lr, iters, record, graph):
    """Push-DIGing over a window: push shares of ``(u, y, p)``; the estimate is ``u / p``.

    ``u`` and ``y`` live side by side in the window's tensor; the window's push-sum weight
    ``p`` travels with them. Each rank keeps ``1 / (d + 1)`` of everything and pushes as much
    to each of its ``d`` out-neighbours (a column-stochastic ``C``, whatever the in-degrees):

        u^{k+1} = C (u^k - lr y^k),   p^{k+1} = C p^k,   z^{k+1} = u^{k+1} / p^{k+1}
        y^{k+1} = C y^k + grad f_i(z^{k+1}) - grad f_i(z^k)
    """
    dim = x.numel()
    g_prev = problem.grad(x)
    state = torch.cat([x, g_prev])  # [u, y]; p = 1, so z = u = x at the start
    u, y = state[:dim], state[dim:]  # views: updating them updates the window's tensor
    with gossamer.Window.create(state, zero_init=True, push_sum=True, topology=graph) as win:
        share = 1.0 / (len(win.out_neighbors) + 1)
        for _ in range(iters):
            record(u / win.p)
            u.sub_(lr * y)
            # Adds share * (u, y, p) into each out-neighbour's slot, then scales our own
            # (u, y, p) by share: the column sums of C are 1, so nothing is lost.
            win.accumulate(self_weight=share, dst_weights=dict.fromkeys(win.out_neighbors, share))
            gossamer.barrier()  # every push of this round has landed...
            win.update_then_collect()  # ...so this adds exactly this round's pushes
            gossamer.barrier()  # nobody pushes the next round into a slot not yet collected
            g = problem.grad(u / win.p)
            y.add_(g - g_prev)
            g_prev = g
        record(u / win.p)


def plot(histories, title, path):
    """Write the distance to the optimum per iteration (log scale) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    # The exact methods overlap almost everywhere: dashes keep each one visible.
    styles = ["-", "--", "-.", ":", (0, (5, 2, 1, 2))]
    for (name, history), style in zip(histories.items(), itertools.cycle(styles)):
        ax.semilogy([max(h, 1e-17) for h in history], label=name, linestyle=style)
    ax.set_xlabel("iteration")
    ax.set_ylabel("relative distance to the optimum")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _checked(kind, test, rule: str):
    """An argparse ``type=``: ``kind(text)``, refused unless ``test(value)`` ("must be rule")."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value

    return parse


_POSITIVE = _checked(int, lambda n: n >= 1, ">= 1")
# A step size or a weight of inf or nan (or a negative one) only diverges.
_POSITIVE_REAL = _checked(float, lambda x: math.isfinite(x) and x > 0, "finite and > 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--problem", choices=("least_squares", "logistic"), default="least_squares")
    parser.add_argument(
        "--method", choices=("all", *METHODS), default="all", help="all: every method in turn"
    )
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="exponential")
    parser.add_argument("--samples", type=_POSITIVE, default=100, help="data points per rank")
    parser.add_argument("--dim", type=_POSITIVE, default=10)
    parser.add_argument(
        "--lr",
        type=_POSITIVE_REAL,
        default=None,
        help="step size; default: 0.2 (least squares), 2.0 (logistic)",
    )
    # > 0: without it the logistic loss of separable data has no minimizer to reach.
    parser.add_argument("--rho", type=_POSITIVE_REAL, default=0.01, help="L2 weight (logistic)")
    parser.add_argument("--max-iters", type=_checked(int, lambda n: n >= 0, ">= 0"), default=200)
    parser.add_argument("--print-every", type=_POSITIVE, default=10)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNG")
    args = parser.parse_args()
    # The logistic loss is flatter (its curvature is at most 1/4 of least squares'), so it
    # takes a larger step for a similar rate.
    lr = args.lr if args.lr is not None else (0.2 if args.problem == "least_squares" else 2.0)

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    graph = TOPOLOGIES[args.topology](size)
    if args.problem == "least_squares" and size * args.samples < args.dim and rank == 0:
        # Allowed (one may want to see it), but x* is then one of many minimizers, and the
        # normal equations are singular: the distances below measure little.
        print(
            f"warning: {size} ranks x {args.samples} samples = {size * args.samples} < "
            f"--dim {args.dim}: least squares is underdetermined",
            file=sys.stderr,
        )
    problem = Problem(args.problem, args.samples, args.dim, args.rho, args.seed)
    optimum = problem.optimum()
    if rank == 0:
        print(
            f"{args.problem}: {size} ranks x {args.samples} samples, dim {args.dim}, "
            f"lr {lr}, {graph.name}; ||x*|| = {optimum.norm():.4f}"
        )

    methods = {"centralized": centralized}
    chosen = METHODS if args.method == "all" else (args.method,)
    methods.update({name: globals()[name] for name in chosen})
    histories, seconds = {}, {}
    bar = tqdm(methods.items(), desc="methods", disable=rank != 0, leave=False)
    for name, method in bar:
        bar.set_postfix_str(name)
        local = []  # this rank's squared distance per iteration; averaged once at the end

        def record(x, local=local):
            local.append(float((x - optimum).square().sum()))

        extra = () if name == "centralized" else (graph,)
        x0 = torch.zeros(args.dim, dtype=torch.float64)
        start = time.perf_counter()
        method(problem, x0, lr, args.max_iters, record, *extra)
        seconds[name] = time.perf_counter() - start
        mean = gossamer.allreduce(torch.tensor(local, dtype=torch.float64))
        histories[name] = (mean.sqrt() / optimum.norm()).tolist()

    if rank == 0:
        names = list(histories)
        print("iter  " + "  ".join(f"{n:>17}" for n in names))
        for it in range(0, args.max_iters + 1):
            if it % args.print_every == 0 or it == args.max_iters:
                print(f"{it:4d}  " + "  ".join(f"{histories[n][it]:17.3e}" for n in names))
        for name in names:
            print(
                f"final distance to optimum  {name:<17} {histories[name][-1]:.3e}"
                f"  ({seconds[name]:.2f} s on rank 0)"
            )
        path = args.out / f"decentralized_optimization_{args.problem}.png"
        title = f"{args.problem} on {size} ranks, {graph.name}, lr {lr}"
        plot(histories, title, path)
        print(f"wrote {path}")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
