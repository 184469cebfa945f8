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
    PeerError,
    TopologyError,
)

__version__ = "0.1.0"

__all__ = [
    "CommunicationTimeout",
    "GossamerError",
    "NotInitializedError",
    "PeerError",
    "TopologyError",
    "__version__",
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
]
