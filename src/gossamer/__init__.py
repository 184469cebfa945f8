"""gossamer: decentralized deep learning on PyTorch.

Every rank trains its own copy of the model and averages it only with its neighbours in a
communication graph (:mod:`gossamer.topology`).
"""

# The names below are imported on first use (PEP 562), not here: Python runs this file
# before any submodule, and the launcher (`gossamer run`, `gossamer.launcher`) must start
# without torch, the runtime or any distributed state.

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time __getattr__ provides it
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
        alltoall,
        alltoall_v,
        barrier,
        broadcast,
        broadcast_,
        gather,
        get_machine_topology,
        get_topology,
        hierarchical_neighbor_allreduce,
        local_allreduce,
        local_allreduce_,
        neighbor_allgather,
        neighbor_allreduce,
        pair_gossip,
        recv,
        reduce,
        reduce_scatter,
        scatter,
        send,
        set_machine_topology,
        set_topology,
    )
    from gossamer.transport import live_ranks, on_membership_change
    from gossamer.windows import Window, live_windows

__version__ = "0.1.0"

# Public name -> the module that defines it.
_SOURCES: dict[str, str] = {
    **dict.fromkeys(
        [
            "init",
            "is_homogeneous",
            "is_initialized",
            "local_rank",
            "local_size",
            "machine_rank",
            "machine_size",
            "rank",
            "shutdown",
            "size",
        ],
        "gossamer.context",
    ),
    **dict.fromkeys(
        [
            "CommunicationTimeout",
            "GossamerError",
            "NotInitializedError",
            "PeerArgumentError",
            "PeerError",
            "RankLostError",
            "TopologyError",
            "WindowError",
        ],
        "gossamer.errors",
    ),
    **dict.fromkeys(
        [
            "Handle",
            "allgather",
            "alltoall",
            "alltoall_v",
            "gather",
            "recv",
            "reduce",
            "reduce_scatter",
            "scatter",
            "send",
            "allreduce",
            "allreduce_",
            "barrier",
            "broadcast",
            "broadcast_",
            "get_machine_topology",
            "get_topology",
            "hierarchical_neighbor_allreduce",
            "local_allreduce",
            "local_allreduce_",
            "neighbor_allgather",
            "neighbor_allreduce",
            "pair_gossip",
            "set_machine_topology",
            "set_topology",
        ],
        "gossamer.ops",
    ),
    **dict.fromkeys(["live_ranks", "on_membership_change"], "gossamer.transport"),
    **dict.fromkeys(["Window", "live_windows"], "gossamer.windows"),
}

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
    "alltoall",
    "alltoall_v",
    "barrier",
    "broadcast",
    "broadcast_",
    "gather",
    "get_machine_topology",
    "get_topology",
    "hierarchical_neighbor_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "live_ranks",
    "live_windows",
    "local_allreduce",
    "local_allreduce_",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "neighbor_allgather",
    "neighbor_allreduce",
    "on_membership_change",
    "pair_gossip",
    "rank",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "send",
    "set_machine_topology",
    "set_topology",
    "shutdown",
    "size",
]


def __getattr__(name: str) -> Any:
    """A public name or a submodule (``gossamer.optim``), imported on first access."""
    source = _SOURCES.get(name)
    if source is not None:
        if source == "gossamer.context":
            # The transport hooks into init and shutdown (every rank's heartbeat starts at
            # init, a rank that leaves says so): it must be there before the first init.
            importlib.import_module("gossamer.transport")
        value = getattr(importlib.import_module(source), name)
        globals()[name] = value  # later lookups skip this function
        return value
    # Submodules stay reachable as attributes (`gossamer.topology.ring`), as they were when
    # this file imported the runtime and so, indirectly, most of the package.
    if not name.startswith("__") and importlib.util.find_spec(f"{__name__}.{name}") is not None:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    submodules = {info.name for info in pkgutil.iter_modules(__path__)}
    return sorted(set(globals()) | set(__all__) | submodules)
