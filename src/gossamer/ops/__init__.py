"""Communication: collectives, neighbour and hierarchical operations, default topologies.

Every operation has one call shape, ``op(tensor, *, ..., group=None, async_op=False)``:
out of place, blocking unless ``async_op=True``, which returns a :class:`Handle`.
"""

from __future__ import annotations

from gossamer.ops.blockwise import alltoall_v, reduce_scatter
from gossamer.ops.collectives import (
    allgather,
    allreduce,
    allreduce_,
    alltoall,
    barrier,
    broadcast,
    broadcast_,
)
from gossamer.ops.defaults import (
    get_machine_topology,
    get_topology,
    set_machine_topology,
    set_topology,
)
from gossamer.ops.hierarchical import (
    hierarchical_neighbor_allreduce,
    local_allreduce,
    local_allreduce_,
    local_group,
)
from gossamer.ops.neighbor import neighbor_allgather, neighbor_allreduce, pair_gossip
from gossamer.ops.point_to_point import recv, send
from gossamer.ops.rooted import gather, reduce, scatter
from gossamer.transport import Handle

__all__ = [
    "Handle",
    "allgather",
    "alltoall",
    "alltoall_v",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "gather",
    "get_machine_topology",
    "get_topology",
    "hierarchical_neighbor_allreduce",
    "local_allreduce",
    "local_allreduce_",
    "local_group",
    "neighbor_allgather",
    "neighbor_allreduce",
    "pair_gossip",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "set_machine_topology",
    "set_topology",
]
