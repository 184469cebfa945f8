"""BlueFog's topology helpers (``bluefog.common.topology_util``) under their own names.

Every graph is an ``nx.DiGraph`` on nodes ``0 .. n-1`` where edge ``i -> j`` carries the
weight ``W[i, j]`` that ``j`` applies to what it receives from ``i``, self-loops included,
exactly as BlueFog builds them with ``nx.from_numpy_array``. The matrices and schedules
come from :mod:`gossamer.topology`; this module only converts between the two forms.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import networkx as nx
import numpy as np
import torch

import gossamer
from gossamer import topology as topo
from gossamer.bluefog._compat import plain_ranks
from gossamer.topology import Topology
from gossamer.transport import check_rank_list

__all__ = [
    "ExponentialGraph",
    "ExponentialTwoGraph",
    "FullyConnectedGraph",
    "GetDynamicOnePeerSendRecvRanks",
    "GetExp2DynamicSendRecvMachineRanks",
    "GetInnerOuterExpo2DynamicSendRecvRanks",
    "GetInnerOuterRingDynamicSendRecvRanks",
    "GetRecvWeights",
    "GetSendWeights",
    "InferDestinationFromSourceRanks",
    "InferSourceFromDestinationRanks",
    "IsRegularGraph",
    "IsTopologyEquivalent",
    "MeshGrid2DGraph",
    "RingGraph",
    "StarGraph",
    "SymmetricExponentialGraph",
]

_RING_STYLES = {0: "bidirectional", 1: "left", 2: "right"}


def _graph_of(topology: object, weighted: bool = True) -> Topology:
    if not isinstance(topology, nx.DiGraph):
        raise TypeError(f"topology must be a networkx.DiGraph; got {type(topology).__name__}")
    return Topology.from_networkx(topology, weighted=weighted)


# ---------------------------------------------------------------------- graphs
def ExponentialGraph(size: int, base: int = 2) -> nx.DiGraph:
    """:func:`gossamer.topology.exponential` as a DiGraph (BlueFog's default topology)."""
    return topo.exponential(size, base).to_networkx()


def ExponentialTwoGraph(size: int) -> nx.DiGraph:
    """:func:`gossamer.topology.exponential_two` as a DiGraph."""
    return topo.exponential_two(size).to_networkx()


def SymmetricExponentialGraph(size: int, base: int = 4) -> nx.DiGraph:
    """:func:`gossamer.topology.symmetric_exponential` as a DiGraph."""
    return topo.symmetric_exponential(size, base).to_networkx()


def MeshGrid2DGraph(size: int, shape: tuple[int, int] | None = None) -> nx.DiGraph:
    """:func:`gossamer.topology.mesh_grid_2d` as a DiGraph (Metropolis-Hastings weights)."""
    return topo.mesh_grid_2d(size, shape).to_networkx()


def StarGraph(size: int, center_rank: int = 0) -> nx.DiGraph:
    """:func:`gossamer.topology.star` as a DiGraph."""
    return topo.star(size, center_rank).to_networkx()


def RingGraph(size: int, connect_style: int = 0) -> nx.DiGraph:
    """:func:`gossamer.topology.ring` as a DiGraph; ``connect_style`` 0, 1, 2 = both, left, right.

    Raises:
        ValueError: ``connect_style`` is not 0, 1 or 2.
    """
    if isinstance(connect_style, bool) or connect_style not in _RING_STYLES:
        raise ValueError(
            f"connect_style must be 0 (bidirectional), 1 (send left) or 2 (send right); "
            f"got {connect_style!r}"
        )
    return topo.ring(size, _RING_STYLES[connect_style]).to_networkx()


def FullyConnectedGraph(size: int) -> nx.DiGraph:
    """:func:`gossamer.topology.fully_connected` as a DiGraph."""
    return topo.fully_connected(size).to_networkx()


# ---------------------------------------------------------------------- queries
def IsTopologyEquivalent(topo1: nx.DiGraph | None, topo2: nx.DiGraph | None) -> bool:
    """Same node and edge counts and equal weights (:func:`gossamer.topology.is_equivalent`).

    False when either is None. Works with networkx 3 (BlueFog's needs ``to_numpy_matrix``).
    """
    if topo1 is None or topo2 is None:
        return False
    if (
        topo1.number_of_nodes() != topo2.number_of_nodes()
        or topo1.number_of_edges() != topo2.number_of_edges()
    ):
        return False
    return topo.is_equivalent(_graph_of(topo1), _graph_of(topo2))


def IsRegularGraph(topo1: nx.DiGraph) -> bool:
    """Whether every node has the same in- plus out-degree (:func:`~gossamer.topology.is_regular`).

    Self-loops do not count (in BlueFog a node with a self-loop counts two more).
    """
    return topo.is_regular(_graph_of(topo1, weighted=False))


def GetRecvWeights(topo1: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """``(self_weight, {src: weight})`` of ``rank``.

    As :meth:`gossamer.topology.Topology.recv_weights`.
    """
    return _graph_of(topo1).recv_weights(rank)


def GetSendWeights(topo1: nx.DiGraph, rank: int) -> tuple[float, dict[int, float]]:
    """``(self_weight, {dst: weight})`` of ``rank``.

    As :meth:`gossamer.topology.Topology.send_weights`.
    """
    return _graph_of(topo1).send_weights(rank)


# ---------------------------------------------------------------------- dynamic schedules
def _pairs(steps: Iterator[topo.Step]) -> Iterator[tuple[list[int], list[int]]]:
    for step in steps:
        yield list(step.send_ranks), list(step.recv_ranks)


def GetDynamicOnePeerSendRecvRanks(
    topo1: nx.DiGraph, self_rank: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``([send_rank], [recv_ranks...])`` per step (see ``one_peer_exponential``).

    Self-loops are not needed (BlueFog miscounts the degree without them).
    """
    return _pairs(topo.one_peer_exponential(_graph_of(topo1, weighted=False), self_rank))


def GetExp2DynamicSendRecvMachineRanks(
    world_size: int, local_size: int, self_rank: int, local_rank: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``([send_machine], [recv_machine])`` per step (``machine_exponential_two``).

    Raises:
        ValueError: ``local_rank`` is not ``self_rank % local_size``, or the layout is bad.
    """
    steps = topo.machine_exponential_two(world_size, local_size, self_rank)
    if local_rank != self_rank % local_size:
        raise ValueError(
            f"local_rank must be self_rank % local_size = {self_rank % local_size}; "
            f"got {local_rank}"
        )
    return _pairs(steps)


def GetInnerOuterRingDynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``([send_rank], [recv_rank])`` per step (``inner_outer_ring``)."""
    return _pairs(topo.inner_outer_ring(world_size, local_size, self_rank))


def GetInnerOuterExpo2DynamicSendRecvRanks(
    world_size: int, local_size: int, self_rank: int
) -> Iterator[tuple[list[int], list[int]]]:
    """Yield ``([send_rank], [recv_rank])`` per step (``inner_outer_exponential_two``)."""
    return _pairs(topo.inner_outer_exponential_two(world_size, local_size, self_rank))


# ---------------------------------------------------------------------- collective inference
def _gather_adjacency(ranks: Sequence[int], name: str) -> np.ndarray:
    """Allgather every rank's list as one row of a 0/1 matrix: ``M[r, k]`` = r listed k."""
    n, me = gossamer.size(), gossamer.rank()
    listed = check_rank_list(plain_ranks(ranks), name, n, me)
    row = torch.zeros((1, n), dtype=torch.uint8)
    row[0, listed] = 1
    return gossamer.allgather(row).numpy().astype(bool)


def _infer(
    adjacency: np.ndarray, mine: np.ndarray, construct_adjacency_matrix: bool
) -> list[int] | tuple[list[int], np.ndarray]:
    ranks = [int(r) for r in np.flatnonzero(mine)]
    if not construct_adjacency_matrix:
        return ranks
    return ranks, np.array(topo.uniform_weights(adjacency).weights)


def InferSourceFromDestinationRanks(
    dst_ranks: Sequence[int], construct_adjacency_matrix: bool = False
) -> list[int] | tuple[list[int], np.ndarray]:
    """The ranks that list this rank as a destination, ascending. Collective.

    With ``construct_adjacency_matrix`` also the matrix ``W`` of the whole graph with
    uniform receive weights (:func:`~gossamer.topology.uniform_weights`): every column
    ``j`` holds ``1/(indegree_j + 1)`` on ``j`` and its sources, so it sums to 1 (BlueFog
    normalises rows instead, which is right only for regular graphs).

    Raises:
        TypeError, ValueError: ``dst_ranks`` holds non-ints, out-of-range or repeated
            ranks, or this rank.
    """
    adjacency = _gather_adjacency(dst_ranks, "dst_ranks")  # adjacency[i, j]: i sends to j
    return _infer(adjacency, adjacency[:, gossamer.rank()], construct_adjacency_matrix)


def InferDestinationFromSourceRanks(
    src_ranks: Sequence[int], construct_adjacency_matrix: bool = False
) -> list[int] | tuple[list[int], np.ndarray]:
    """The ranks that list this rank as a source, ascending. Collective.

    The mirror image of :func:`InferSourceFromDestinationRanks`; ``W`` is built the same
    way, column-normalised over each rank's sources.
    """
    adjacency = _gather_adjacency(src_ranks, "src_ranks").T  # row j listed i: i sends to j
    return _infer(adjacency, adjacency[gossamer.rank()], construct_adjacency_matrix)
