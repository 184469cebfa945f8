"""Average consensus: every rank ends up holding the mean of all ranks' vectors.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/average_consensus.py --topology exponential
    gossamer run -np 4 examples/average_consensus.py --dynamic
    gossamer run -np 4 examples/average_consensus.py --asynchronous --max-iters 30 --plot

Each rank ``i`` starts with a random vector ``x_i`` and repeats the gossip step
(``gossamer.neighbor_allreduce``)

    x_i <- sum_j W[j, i] * x_j          (j = i and the in-neighbours of i)

with the topology's weights. For a doubly stochastic ``W`` on a connected graph the vectors
converge to the mean ``xbar = (1/n) sum_i x_i``, and the error shrinks per step by about the
mixing rate ``|lambda_2(W)|`` of the graph. With ``--dynamic`` each rank talks to one
peer per step (the one-peer exponential schedule). Rank 0 prints the mean squared distance to the
mean, ``(1/n) sum_i ||x_i - xbar||^2 / d``, per iteration.

With ``--asynchronous`` the ranks run push-sum over a one-sided window instead (Kempe et
al., 2003): each step a rank keeps a share ``1/(d+1)`` of ``(x_i, p_i)``, accumulates a
share into each of its ``d`` out-neighbours' windows and adds whatever has arrived in its own
(``Window.update_then_collect``); its estimate is ``x_i / p_i``. No rank waits for another
during the loop, so a rank's step ``k`` happens whenever that rank gets there: the line for
iteration ``k`` is the mean over ranks of each rank's error after its own ``k``-th step
(printed after the loop), and a final line gives the error after a barrier and a last
collect, when nothing is in flight. A step does ``--work-ms`` of simulated local work (a
sleep of random length), as a training step would: without it a step takes microseconds and
a rank that the OS schedules first runs through all its steps before the others start, so
it mixes with nobody (its estimate stays put while nothing arrives).

``--plot`` writes the error per iteration to ``<out>/average_consensus.png``.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

import gossamer
from gossamer import topology as topo

TOPOLOGIES = {
    "exponential": topo.exponential_two,
    "ring": topo.ring,
    "mesh": topo.mesh_grid_2d,
    "star": topo.star,
    "full": topo.fully_connected,
}


def synchronous(x, mean, graph, schedule, max_iters, report):
    """Gossip with ``neighbor_allreduce``; every step is collective. Returns the errors."""
    errors = []
    for it in range(max_iters + 1):
        error = gossamer.allreduce(((x - mean) ** 2).mean().reshape(1)).item()
        errors.append(error)
        report(it, error)
        if it == max_iters:
            break
        if schedule is None:
            x = gossamer.neighbor_allreduce(x, topology=graph)
        else:
            step = next(schedule)
            x = gossamer.neighbor_allreduce(
                x,
                self_weight=step.self_weight,
                src_weights=step.src_weights,
                dst_weights=step.dst_weights,
            )
    return errors


def asynchronous(x, mean, graph, schedule, max_iters, work_ms, seed, report):
    """Push-sum over a window; no rank waits for another inside the loop. Returns errors."""
    history = []
    # Each step's stand-in for local work takes a random time, different on every rank.
    jitter = random.Random(seed * 1000 + gossamer.rank())
    # zero_init: the slots hold what neighbours pushed and not yet collected, so they start
    # empty; push_sum: the scalar weight p (1 here) travels with every accumulate.
    with gossamer.Window.create(x, zero_init=True, push_sum=True, topology=graph) as win:
        # Start together (start-up skew between processes is large next to one step);
        # from here on, no rank waits for another until the loop is over.
        gossamer.barrier()
        for it in range(max_iters + 1):
            history.append(((x / win.p - mean) ** 2).mean().item())
            if it == max_iters:
                break
            time.sleep(work_ms / 1000 * jitter.uniform(0.5, 1.5))
            peers = win.out_neighbors if schedule is None else next(schedule).send_ranks
            share = 1.0 / (len(peers) + 1)
            # Shares sum to 1, so the totals of x and p over all ranks (slots included)
            # never change: that is why x / p converges to the true mean.
            win.accumulate(self_weight=share, dst_weights=dict.fromkeys(peers, share))
            win.update_then_collect()
        # accumulate returns once its data has landed, so after the barrier every push
        # is in some rank's slot; the last collect brings all the mass home.
        gossamer.barrier()
        win.update_then_collect()
        final = gossamer.allreduce(((x / win.p - mean) ** 2).mean().reshape(1)).item()
    # Rank k's history is its own view; average it over ranks, index by index.
    errors = gossamer.allreduce(torch.tensor(history, dtype=torch.float64)).tolist()
    for it, error in enumerate(errors):
        report(it, error)
    return errors, final


def plot(errors, title, path):
    """Write the error per iteration (log scale) to ``path``."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    # A run can reach exactly 0 (one peer on 2^k ranks); keep it visible on a log axis.
    ax.semilogy([max(e, 1e-32) for e in errors], marker=".")
    ax.set_xlabel("iteration")
    ax.set_ylabel("consensus error (MSE to the mean)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="exponential")
    parser.add_argument("--data-size", type=_POSITIVE, default=100_000)
    parser.add_argument("--max-iters", type=_checked(int, lambda n: n >= 0, ">= 0"), default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dynamic", action="store_true", help="one peer per step (one_peer_exponential)"
    )
    parser.add_argument(
        "--asynchronous",
        action="store_true",
        help="push-sum over one-sided windows; ranks do not synchronise per step",
    )
    parser.add_argument(
        "--work-ms",
        type=_checked(float, lambda ms: ms >= 0, ">= 0"),
        default=None,  # None: not given, so that a --work-ms without --asynchronous shows
        help="with --asynchronous: mean duration of the simulated local work per step "
        "(random, 0.5x to 1.5x, per rank; default 10); 0 lets the ranks race",
    )
    parser.add_argument("--plot", action="store_true", help="write a PNG of the error")
    parser.add_argument("--out", type=Path, default=Path("results"), help="folder for the PNG")
    args = parser.parse_args()
    if args.work_ms is not None and not args.asynchronous:
        # The synchronous rounds simulate no local work: the value would be ignored.
        parser.error(f"--work-ms {args.work_ms:g} needs --asynchronous")
    if args.work_ms is None:
        args.work_ms = 10.0

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    graph = TOPOLOGIES[args.topology](size)
    generator = torch.Generator().manual_seed(args.seed + rank)
    x = torch.randn(args.data_size, dtype=torch.float64, generator=generator)
    mean = gossamer.allreduce(x)
    schedule = topo.one_peer_exponential(graph, rank) if args.dynamic else None

    def report(it, error):
        if rank == 0:
            print(f"iter {it:3d}  consensus error {error:.3e}")

    mode = "asynchronous push-sum" if args.asynchronous else "synchronous"
    if rank == 0:
        print(
            f"average consensus: {size} ranks, {graph!r}, mixing rate "
            f"{topo.mixing_rate(graph):.4f}, {args.data_size} float64 per rank"
            + (f", {mode}" if args.asynchronous else "")
            + (", one peer per step" if args.dynamic else "")
        )
    if args.asynchronous:
        errors, final = asynchronous(
            x, mean, graph, schedule, args.max_iters, args.work_ms, args.seed, report
        )
        if rank == 0:
            print(f"final (after a barrier and a last collect)  consensus error {final:.3e}")
    else:
        errors = synchronous(x, mean, graph, schedule, args.max_iters, report)
    if args.plot and rank == 0:
        path = args.out / "average_consensus.png"
        how = mode + (", one peer" if args.dynamic else "")
        plot(errors, f"{graph.name} on {size} ranks ({how})", path)
        print(f"wrote {path}")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
