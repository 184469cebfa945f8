"""Average consensus: every rank ends up holding the mean of all ranks' vectors.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/average_consensus.py --topology exponential

Each rank ``i`` starts with a random vector ``x_i`` and repeats the gossip step

    x_i <- sum_j W[j, i] * x_j          (j = i and the in-neighbours of i)

with the topology's weights. For a doubly stochastic ``W`` on a connected graph the vectors
converge to the mean ``xbar = (1/n) sum_i x_i``, and the error shrinks per step by about the
mixing rate ``|lambda_2(W)|`` of the graph. Rank 0 prints the mean squared distance to the
mean, ``(1/n) sum_i ||x_i - xbar||^2 / d``, per iteration.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gossamer
from gossamer import topology as topo

TOPOLOGIES = {
    "exponential": topo.exponential_two,
    "ring": topo.ring,
    "mesh": topo.mesh_grid_2d,
    "star": topo.star,
    "full": topo.fully_connected,
}


def gossip_step(x: torch.Tensor, graph: topo.Topology, rank: int) -> torch.Tensor:
    """One synchronous neighbour averaging step over point-to-point messages."""
    self_weight, src_weights = graph.recv_weights(rank)
    received = {src: torch.empty_like(x) for src in src_weights}
    ops = [dist.P2POp(dist.isend, x, dst) for dst in graph.out_neighbors(rank)]
    ops += [dist.P2POp(dist.irecv, buf, src) for src, buf in received.items()]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    out = x * self_weight
    for src, weight in src_weights.items():
        out.add_(received[src], alpha=weight)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", choices=sorted(TOPOLOGIES), default="exponential")
    parser.add_argument("--data-size", type=int, default=100_000)
    parser.add_argument("--max-iters", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    graph = TOPOLOGIES[args.topology](size)
    generator = torch.Generator().manual_seed(args.seed + rank)
    x = torch.randn(args.data_size, dtype=torch.float64, generator=generator)
    mean = x.clone()
    dist.all_reduce(mean)
    mean /= size

    if rank == 0:
        print(
            f"average consensus: {size} ranks, {graph!r}, mixing rate "
            f"{topo.mixing_rate(graph):.4f}, {args.data_size} float64 per rank"
        )
    for it in range(args.max_iters + 1):
        error = ((x - mean) ** 2).mean().reshape(1)
        dist.all_reduce(error)
        if rank == 0:
            print(f"iter {it:3d}  consensus error {error.item() / size:.3e}")
        if it < args.max_iters:
            x = gossip_step(x, graph, rank)
    gossamer.shutdown()


if __name__ == "__main__":
    main()
