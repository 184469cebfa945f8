"""BlueFog's basics: init and sizes, the default topology as a networkx graph, neighbour ranks.

BlueFog keeps one process-wide topology, an ``nx.DiGraph``, and a flag ``is_weighted``
that says whether default neighbour averaging uses the graph's edge weights or uniform
weights ``1/(indegree+1)``. This module translates that state onto gossamer's default
topology: the core default is set to the graph's weight matrix when ``is_weighted`` is
true and to :func:`~gossamer.topology.uniform_weights` of its edges otherwise, so every
core operation that falls back on the default (neighbour averaging, window updates, the
optimizers) mixes exactly as BlueFog would.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import networkx as nx
import torch
import torch.distributed as dist

import gossamer
from gossamer.bluefog import timeline as bf_timeline
from gossamer.bluefog._state import state
from gossamer.bluefog.topology_util import ExponentialGraph, IsTopologyEquivalent
from gossamer.errors import NotInitializedError
from gossamer.topology import Topology, uniform_weights

__all__ = [
    "get_skip_negotiate_stage",
    "in_neighbor_machine_ranks",
    "in_neighbor_ranks",
    "init",
    "is_homogeneous",
    "is_machine_topo_weighted",
    "is_topo_weighted",
    "load_machine_topology",
    "load_topology",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "mpi_threads_supported",
    "nccl_built",
    "out_neighbor_machine_ranks",
    "out_neighbor_ranks",
    "rank",
    "resume",
    "set_machine_topology",
    "set_skip_negotiate_stage",
    "set_topology",
    "shutdown",
    "size",
    "suspend",
    "unified_mpi_window_model_supported",
]

logger = logging.getLogger(__name__)

_NOT_INITIALIZED = "BlueFog has not been initialized; use bf.init()."


@dataclass(frozen=True)
class _View:
    """A graph as BlueFog sees it, and the core topology it was translated to."""

    graph: nx.DiGraph
    is_weighted: bool
    core: Topology


def _translated(graph: nx.DiGraph, is_weighted: bool) -> Topology:
    """The core topology BlueFog's default averaging over ``graph`` amounts to."""
    if is_weighted:
        return Topology.from_networkx(graph, weighted=True)
    return uniform_weights(Topology.from_networkx(graph, weighted=False))


def _view(kind: str) -> _View | None:
    """The facade's view, if the core default still is what the facade set."""
    if not gossamer.is_initialized():
        return None
    view = state().views.get(kind)
    if view is None:
        return None
    core = gossamer.get_topology() if kind == "world" else gossamer.get_machine_topology()
    return view if core == view.core else None


def _check_graph(topology: object, nodes: int, what: str, unit: str) -> nx.DiGraph:
    if not isinstance(topology, nx.DiGraph):
        raise TypeError(f"{what} must be a networkx.DiGraph; got {type(topology).__name__}")
    if topology.number_of_nodes() != nodes:
        raise TypeError(
            f"{what} must have {nodes} nodes (one per {unit}); got {topology.number_of_nodes()}"
        )
    return topology


def _bf(getter: Callable[[], int]) -> int:
    try:
        return getter()
    except NotInitializedError:
        raise ValueError(_NOT_INITIALIZED) from None


# ---------------------------------------------------------------------- lifecycle and sizes
def init(
    topology_fn: Callable[[int], nx.DiGraph | None] | None = None, is_weighted: bool = False
) -> None:
    """Start gossamer (once per process) and set the default topology (every call).

    The topology is ``topology_fn(size())`` or, when that is None or no function is given,
    ``ExponentialGraph(size())``. Calling ``init`` again is cheap and re-applies it, as in
    BlueFog; gossamer's own shutdown is already registered with ``atexit``. The first call
    starts the timeline if ``BLUEFOG_TIMELINE`` names a file prefix (rank ``k`` writes
    ``<prefix><k>.json``; see :mod:`gossamer.bluefog.timeline`).

    Args:
        topology_fn (Callable[[int], nx.DiGraph], optional): builds the graph from the size.
        is_weighted (bool): use the graph's edge weights for default averaging.
    """
    gossamer.init()
    facade = state()
    if not facade.timeline_checked:
        facade.timeline_checked = True
        bf_timeline.start_from_env()
    graph = topology_fn(size()) if topology_fn is not None else None
    set_topology(graph, is_weighted)


def shutdown() -> None:
    """Stop gossamer: frees the windows, forgets the topologies (see :func:`gossamer.shutdown`).

    A timeline started from ``BLUEFOG_TIMELINE`` is written now, as BlueFog's is complete
    once it shuts down.
    """
    bf_timeline.stop_started_from_env()
    gossamer.shutdown()


def size() -> int:
    """Number of ranks. Raises ``ValueError`` before :func:`init`."""
    return _bf(gossamer.size)


def rank() -> int:
    """This process's rank. Raises ``ValueError`` before :func:`init`."""
    return _bf(gossamer.rank)


def local_size() -> int:
    """Number of ranks on this machine (``GOSSAMER_NODES_PER_MACHINE`` fakes machines)."""
    return _bf(gossamer.local_size)


def local_rank() -> int:
    """This rank's index on its machine."""
    return _bf(gossamer.local_rank)


def machine_size() -> int:
    """Number of machines."""
    return _bf(gossamer.machine_size)


def machine_rank() -> int:
    """Index of this rank's machine."""
    return _bf(gossamer.machine_rank)


def is_homogeneous() -> bool:
    """True when every machine has the same number of ranks, numbered contiguously."""
    try:
        return gossamer.is_homogeneous()
    except NotInitializedError:
        raise ValueError(_NOT_INITIALIZED) from None


# ---------------------------------------------------------------------- the rank topology
def load_topology() -> nx.DiGraph | None:
    """The current topology: the very graph given to :func:`set_topology`.

    If the default was changed through :func:`gossamer.set_topology` since, its graph
    (:meth:`~gossamer.topology.Topology.to_networkx`); None before :func:`init`.
    """
    view = _view("world")
    if view is not None:
        return view.graph
    return gossamer.get_topology().to_networkx() if gossamer.is_initialized() else None


def is_topo_weighted() -> bool:
    """Whether default averaging uses the topology's edge weights (else uniform weights)."""
    view = _view("world")
    # A topology set through gossamer's own API is always used with its weights.
    return view.is_weighted if view is not None else gossamer.is_initialized()


def set_topology(topology: nx.DiGraph | None = None, is_weighted: bool = False) -> bool:
    """Make ``topology`` the default graph of neighbour operations and new windows.

    Args:
        topology (nx.DiGraph, optional): one node per rank; ``W[i, j]`` is the weight of
            edge ``i -> j``. Default: ``ExponentialGraph(size())``.
        is_weighted (bool): default averaging uses the edge weights; otherwise every rank
            weighs itself and each in-neighbour ``1/(indegree+1)``.

    Returns:
        bool: True once set, also when ``topology`` is equivalent to the current graph (then
        ``is_weighted`` is left unchanged); False, with an error logged, while windows exist.

    Raises:
        TypeError: ``topology`` is not a DiGraph or has not ``size()`` nodes.
    """
    n = size()
    if topology is None:
        topology = ExponentialGraph(n)
    graph = _check_graph(topology, n, "topology", "rank")
    current = _view("world")
    if current is not None and IsTopologyEquivalent(graph, current.graph):
        logger.debug("set_topology: the topology is equivalent to the current one; kept")
        return True
    if gossamer.live_windows():
        logger.error(
            "Cannot set the topology while windows exist (%s): free them with win_free() "
            "first. Also make sure bf.init() was called and bf.shutdown() was not.",
            ", ".join(gossamer.live_windows()),
        )
        return False
    core = _translated(graph, bool(is_weighted))
    gossamer.set_topology(core)
    state().views["world"] = _View(graph, bool(is_weighted), core)
    return True


def in_neighbor_ranks() -> list[int]:
    """Ranks that send to this rank in the topology (self excluded), ascending."""
    if not gossamer.is_initialized():
        return []
    return list(gossamer.get_topology().in_neighbors(rank()))


def out_neighbor_ranks() -> list[int]:
    """Ranks this rank sends to in the topology (self excluded), ascending."""
    if not gossamer.is_initialized():
        return []
    return list(gossamer.get_topology().out_neighbors(rank()))


# ---------------------------------------------------------------------- the machine topology
def load_machine_topology() -> nx.DiGraph | None:
    """The machine topology given to :func:`set_machine_topology`, or None."""
    view = _view("machine")
    if view is not None:
        return view.graph
    core = gossamer.get_machine_topology() if gossamer.is_initialized() else None
    return None if core is None else core.to_networkx()


def is_machine_topo_weighted() -> bool:
    """Whether hierarchical averaging uses the machine topology's edge weights."""
    view = _view("machine")
    if view is not None:
        return view.is_weighted
    return gossamer.is_initialized() and gossamer.get_machine_topology() is not None


def set_machine_topology(topology: nx.DiGraph, is_weighted: bool = False) -> bool:
    """Set the graph over machines that ``hierarchical_neighbor_allreduce`` uses by default.

    Returns:
        bool: True once set or when equivalent to the current one; False, with an error
        logged, while windows exist.

    Raises:
        ValueError: ``topology`` is None.
        TypeError: not a DiGraph, or not ``machine_size()`` nodes.
    """
    if topology is None:
        raise ValueError("set_machine_topology: a machine topology must be given; got None")
    graph = _check_graph(topology, machine_size(), "machine topology", "machine")
    current = _view("machine")
    if current is not None and IsTopologyEquivalent(graph, current.graph):
        return True
    if gossamer.live_windows():
        logger.error(
            "Cannot set the machine topology while windows exist (%s); free them first.",
            ", ".join(gossamer.live_windows()),
        )
        return False
    core = _translated(graph, bool(is_weighted))
    gossamer.set_machine_topology(core)
    state().views["machine"] = _View(graph, bool(is_weighted), core)
    return True


def in_neighbor_machine_ranks() -> list[int]:
    """Machines that send to this rank's machine (self excluded), ascending; [] if unset."""
    core = gossamer.get_machine_topology() if gossamer.is_initialized() else None
    return [] if core is None else list(core.in_neighbors(machine_rank()))


def out_neighbor_machine_ranks() -> list[int]:
    """Machines this rank's machine sends to (self excluded), ascending; [] if unset."""
    core = gossamer.get_machine_topology() if gossamer.is_initialized() else None
    return [] if core is None else list(core.out_neighbors(machine_rank()))


# ---------------------------------------------------------------------- capabilities and knobs
def mpi_threads_supported() -> bool:
    """True: gossamer's operations may be called from any thread."""
    return True


def unified_mpi_window_model_supported() -> bool:
    """True: a window's tensor is always the registered object itself (no separate copy)."""
    return True


def nccl_built() -> bool:
    """Whether CUDA tensors can travel over NCCL here (CUDA present and NCCL available)."""
    return torch.cuda.is_available() and dist.is_nccl_available()


def set_skip_negotiate_stage(value: bool) -> None:
    """Store the flag; gossamer has no negotiation stage, so it changes nothing."""
    state().skip_negotiate_stage = bool(value)


def get_skip_negotiate_stage() -> bool:
    """The flag stored by :func:`set_skip_negotiate_stage`."""
    return state().skip_negotiate_stage


def suspend() -> None:
    """Does nothing: gossamer has no background loop to pause (BlueFog's was for ibfrun)."""


def resume() -> None:
    """Does nothing; see :func:`suspend`."""
