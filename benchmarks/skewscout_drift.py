"""Where the drift between ranks sits on the ring and on exp-2: ATC at fixed periods.

ATC (SGD, momentum 0.9) of 8 MLPs in one process, each on its own part of the digits, with
the benchmark's model, data order and initial weights (``benchmarks.heterogeneity``'s
``_split``, ``_model``, ``_partition`` and ``Batches``; period 1 gives its ``atc`` rows to
the digit), averaging with the graph's weights every ``tau`` steps::

    python -m benchmarks.skewscout_drift                  # seed 0, IID, periods 1 4 8 16
    python -m benchmarks.skewscout_drift --seed 1 --partition 2-classes

For each graph and period, over the rounds after step ``--after``, it prints the squared
distance between two ranks' models (mean over all pairs, in squared gradient steps: over
the mean ``lr^2 |g|^2`` of the period's steps) just before a round and just after it, and
the part the period's local steps add, ``|(x_i - a_i) - (x_j - a_j)|^2`` with ``a`` the
models after the previous round; then how far the ranks' own models fall behind their
average model in test accuracy (points, mean over the steps from ``--gap-from``) and the
final accuracy of the ranks' own models. This is the measurement behind "SkewScout on
exp-2" in docs/heterogeneity.md.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
from torch import nn

from benchmarks import argtypes
from benchmarks.heterogeneity import PARTITIONS, Batches, _accuracy, _model, _partition, _split
from gossamer import topology as topo


def _flat(models: list[nn.Module]) -> torch.Tensor:
    return torch.stack([nn.utils.parameters_to_vector(m.parameters()).detach() for m in models])


def _pairs(x: torch.Tensor) -> float:
    """Mean over ordered pairs i != j of |x_i - x_j|^2."""
    n = len(x)
    return float(np.mean([(x - x.roll(s, 0)).double().pow(2).sum(1).mean() for s in range(1, n)]))


def run(graph: str, period: int, args: argparse.Namespace) -> dict:
    """One graph and period: the distances, the accuracy gap and the final accuracy."""
    n, lr = args.ranks, args.lr
    train, test = _split(args.seed)
    part = _partition(args.partition, train[1], n, args.seed)
    weights = (topo.ring(n) if graph == "ring" else topo.exponential_two(n)).weights
    W = torch.tensor(np.array(weights), dtype=torch.float32)
    models = [_model(args.seed) for _ in range(n)]
    average = _model(args.seed)
    opts = [torch.optim.SGD(m.parameters(), lr=lr, momentum=0.9) for m in models]
    batches = [Batches(part.part(r), args.batch, seed=1000 * args.seed + r) for r in range(n)]
    loss_fn = nn.CrossEntropyLoss()
    anchor, steps, rounds, gaps = None, [], [], []
    for k in range(1, args.steps + 1):
        for model, opt, b in zip(models, opts, batches, strict=True):
            index = b.next()
            opt.zero_grad()
            loss_fn(model(train[0][index]), train[1][index]).backward()
            steps.append(lr**2 * sum(float(p.grad.pow(2).sum()) for p in model.parameters()))
            opt.step()
        if k % period == 0:
            x = _flat(models)
            before = _pairs(x)
            local = _pairs(x - anchor) if anchor is not None else float("nan")
            x = W.T @ x
            with torch.no_grad():
                for model, row in zip(models, x, strict=True):
                    nn.utils.vector_to_parameters(row, model.parameters())
            unit = float(np.mean(steps))
            if k > args.after:
                rounds.append((before / unit, _pairs(x) / unit, local / unit))
            anchor, steps = x.clone(), []
        if k >= args.gap_from:
            with torch.no_grad():
                nn.utils.vector_to_parameters(_flat(models).mean(0), average.parameters())
            own = float(np.mean([_accuracy(m, *test) for m in models]))
            gaps.append(_accuracy(average, *test) - own)
    before, after, local = np.nanmean(np.array(rounds), axis=0)
    final = float(np.mean([_accuracy(m, *test) for m in models]))
    return {"before": before, "after": after, "local": local, "gap": np.mean(gaps), "final": final}


_COUNT = argtypes.checked(int, lambda n: n >= 0, ">= 0")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--periods", type=argtypes.POSITIVE, nargs="+", default=[1, 4, 8, 16])
    parser.add_argument("--graphs", nargs="+", default=["ring", "exp2"], choices=["ring", "exp2"])
    parser.add_argument("--partition", default="iid", choices=PARTITIONS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ranks",
        type=argtypes.checked(int, lambda n: n >= 2, ">= 2 (the drift is between two ranks)"),
        default=8,
    )
    parser.add_argument("--steps", type=argtypes.POSITIVE, default=250)
    parser.add_argument("--batch", type=argtypes.POSITIVE, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument(
        "--after", type=_COUNT, default=100, help="rounds counted after this step (< --steps)"
    )
    parser.add_argument(
        "--gap-from", type=_COUNT, default=150, help="accuracy gap from this step (<= --steps)"
    )
    args = parser.parse_args(argv)
    if args.after >= args.steps:
        parser.error(f"argument --after: must be < --steps {args.steps}; got {args.after}")
    if args.gap_from > args.steps:
        parser.error(f"argument --gap-from: must be <= --steps {args.steps}; got {args.gap_from}")
    for period in args.periods:
        if args.steps // period == args.after // period:  # no multiple of it in (after, steps]
            parser.error(
                f"argument --periods: {period} has no round between --after {args.after} and "
                f"--steps {args.steps}; got {' '.join(map(str, args.periods))}"
            )
    torch.set_num_threads(1)
    print(
        "| graph | period | before a round | after a round | local steps | "
        "own model behind the average (points) | final accuracy |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for graph in args.graphs:
        for period in args.periods:
            r = run(graph, period, args)
            print(
                f"| {graph} | {period} | {r['before']:.0f} | {r['after']:.0f} | {r['local']:.0f} | "
                f"{100 * r['gap']:.2f} | {100 * r['final']:.1f} % |"
            )


if __name__ == "__main__":
    main()
