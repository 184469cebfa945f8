"""gossamer: decentralized deep learning on PyTorch.

Every rank trains its own copy of the model and averages it only with its neighbours in a
communication graph (:mod:`gossamer.topology`).
"""

from __future__ import annotations

from gossamer.context import (
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    machine_rank,
    machine_size,
    rank,
    shutdown,
    size,
)
from gossamer.errors import (
    CommunicationTimeout,
    GossamerError,
    NotInitializedError,
    PeerArgumentError,
    PeerError,
    RankLostError,
    TopologyError,
    WindowError,
)
from gossamer.ops import (
    Handle,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    get_machine_topology,
    get_topology,
    hierarchical_neighbor_allreduce,
    local_allreduce,
    neighbor_allgather,
    neighbor_allreduce,
    pair_gossip,
    set_machine_topology,
    set_topology,
)
from gossamer.windows import Window, live_windows

__version__ = "0.1.0"

__all__ = [
    "CommunicationTimeout",
    "GossamerError",
    "Handle",
    "NotInitializedError",
    "PeerArgumentError",
    "PeerError",
    "RankLostError",
    "TopologyError",
    "Window",
    "WindowError",
    "__version__",
    "allgather",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "get_machine_topology",
    "get_topology",
    "hierarchical_neighbor_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "live_windows",
    "local_allreduce",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "neighbor_allgather",
    "neighbor_allreduce",
    "pair_gossip",
    "rank",
    "set_machine_topology",
    "set_topology",
    "shutdown",
    "size",
]
