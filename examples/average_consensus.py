"""Average consensus: every rank ends up holding the mean of all ranks' vectors.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/average_consensus.py --topology exponential

Each rank ``i`` starts with a random vector ``x_i`` and repeats the gossip step
(``gossamer.neighbor_allreduce``)

    x_i <- sum_j W[j, i] * x_j          (j = i and the in-neighbours of i)

with the topology's weights. For a doubly stochastic ``W`` on a connected graph the vectors
converge to the mean ``xbar = (1/n) sum_i x_i``, and the error shrinks per step by about the
mixing rate ``|lambda_2(W)|`` of the graph. With ``--dynamic`` each rank talks to one
peer per step (the one-peer exponential schedule). Rank 0 prints the mean squared distance to the
mean, ``(1/n) sum_i ||x_i - xbar||^2 / d``, per iteration.
"""

from __future__ import annotations

import argparse

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="exponential")
    parser.add_argument("--data-size", type=int, default=100_000)
    parser.add_argument("--max-iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--dynamic", action="store_true", help="one peer per step (one_peer_exponential)"
    )
    args = parser.parse_args()

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    graph = TOPOLOGIES[args.topology](size)
    generator = torch.Generator().manual_seed(args.seed + rank)
    x = torch.randn(args.data_size, dtype=torch.float64, generator=generator)
    mean = gossamer.allreduce(x)
    schedule = topo.one_peer_exponential(graph, rank) if args.dynamic else None

    if rank == 0:
        print(
            f"average consensus: {size} ranks, {graph!r}, mixing rate "
            f"{topo.mixing_rate(graph):.4f}, {args.data_size} float64 per rank"
        )
    for it in range(args.max_iters + 1):
        error = gossamer.allreduce(((x - mean) ** 2).mean().reshape(1))
        if rank == 0:
            print(f"iter {it:3d}  consensus error {error.item():.3e}")
        if it == args.max_iters:
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
    gossamer.shutdown()


if __name__ == "__main__":
    main()
