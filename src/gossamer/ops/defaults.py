"""Default topologies: one per process group, plus one over machines for hierarchical ops.

Ops take ``topology=`` to use any graph for one call; without it they use the default of
their group, which is ``exponential_two(group size)`` until :func:`set_topology` changes it.
"""

from __future__ import annotations

import torch.distributed as dist

from gossamer import context
from gossamer.errors import TopologyError
from gossamer.topology import Topology, exponential_two

__all__ = [
    "get_machine_topology",
    "get_topology",
    "group_rank",
    "group_size",
    "set_machine_topology",
    "set_topology",
]

_topologies: dict[object, Topology] = {}
_machine_topology: list[Topology] = []
_live_windows: set[str] = set()


def _key(group: dist.ProcessGroup | None) -> object:
    return "world" if group is None or group is dist.group.WORLD else group


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (the world when None)."""
    context.rank()  # raises NotInitializedError before init
    if group is None:
        return dist.get_rank()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None; got {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {context.rank()} is not a member of group {group!r}")
    return rank


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    group_rank(group)
    return dist.get_world_size(group)


def check_topology(topology: object, group: dist.ProcessGroup | None, name: str) -> Topology:
    """Return ``topology`` if it is a Topology of the group's size, else raise."""
    if not isinstance(topology, Topology):
        raise TypeError(f"{name} must be a gossamer.topology.Topology; got {topology!r}")
    size = group_size(group)
    if topology.size != size:
        raise TopologyError(f"{name} has {topology.size} ranks but the group has {size}")
    return topology


def _refuse_while_windows_exist() -> None:
    if _live_windows:
        raise TopologyError(
            f"cannot change the topology while windows exist ({sorted(_live_windows)}); "
            "free them first"
        )


def set_topology(topology: Topology, *, group: dist.ProcessGroup | None = None) -> None:
    """Make ``topology`` the default of ``group`` for neighbour operations.

    Raises:
        TypeError: ``topology`` is not a Topology.
        TopologyError: its size differs from the group's, or windows exist.
    """
    check_topology(topology, group, "topology")
    if _topologies.get(_key(group)) != topology:
        _refuse_while_windows_exist()
    _topologies[_key(group)] = topology


def get_topology(group: dist.ProcessGroup | None = None) -> Topology:
    """The default topology of ``group``: the last one set, else ``exponential_two(size)``."""
    size = group_size(group)
    found = _topologies.get(_key(group))
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
    _machine_topology[:] = [] if topology is None else [topology]


def get_machine_topology() -> Topology | None:
    """The machine topology, or None when none was set."""
    context.rank()
    return _machine_topology[0] if _machine_topology else None


def _reset() -> None:
    _topologies.clear()
    _machine_topology.clear()
    _live_windows.clear()


context.on_shutdown(_reset)
