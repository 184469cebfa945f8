"""Default topologies: one per process group, plus one over machines for hierarchical ops.

Ops take ``topology=`` to use any graph for one call; without it they use the default of
their group, which is ``exponential_two(group size)`` until :func:`set_topology` changes it.
The defaults live on the runtime (:func:`gossamer.context.runtime`), so ``shutdown`` clears
them.
"""

from __future__ import annotations

import torch.distributed as dist

from gossamer import context
from gossamer.errors import TopologyError
from gossamer.topology import Topology, exponential_two
from gossamer.transport import check_topology, group_size

__all__ = [
    "get_machine_topology",
    "get_topology",
    "set_machine_topology",
    "set_topology",
]


def _key(group: dist.ProcessGroup | None) -> object:
    return "world" if group is None or group is dist.group.WORLD else group


def _refuse_while_windows_exist() -> None:
    windows = context.runtime().find("windows")
    names = [] if windows is None else windows.names()
    if names:
        raise TopologyError(
            f"cannot change the topology while windows exist ({names}); free them first"
        )


def set_topology(topology: Topology, *, group: dist.ProcessGroup | None = None) -> None:
    """Make ``topology`` the default of ``group`` for neighbour operations.

    Raises:
        TypeError: ``topology`` is not a Topology.
        TopologyError: its size differs from the group's, or windows exist.
    """
    check_topology(topology, group, "topology")
    topologies = context.runtime().topologies
    if topologies.get(_key(group)) != topology:
        _refuse_while_windows_exist()
    topologies[_key(group)] = topology


def get_topology(group: dist.ProcessGroup | None = None) -> Topology:
    """The default topology of ``group``: the last one set, else ``exponential_two(size)``."""
    size = group_size(group)
    found = context.runtime().topologies.get(_key(group))
    return found if found is not None else exponential_two(size)


def set_machine_topology(topology: Topology | None) -> None:
    """Set the topology over machines used by hierarchical operations (None clears it).

    Raises:
        TypeError: ``topology`` is not a Topology.
        TopologyError: its size is not ``machine_size()``.
    """
    if topology is not None:
        if not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer.topology.Topology; got {topology!r}")
        if topology.size != context.machine_size():
            raise TopologyError(
                f"machine topology has {topology.size} nodes but there are "
                f"{context.machine_size()} machines"
            )
    # Windows capture the rank topology only, so the machine topology may change under them.
    context.runtime().machine_topology = topology


def get_machine_topology() -> Topology | None:
    """The machine topology, or None when none was set."""
    return context.runtime().machine_topology
