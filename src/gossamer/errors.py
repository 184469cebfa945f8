"""Exception hierarchy of gossamer: one base class, one subclass per failure kind."""

from __future__ import annotations

__all__ = [
    "CommunicationTimeout",
    "GossamerError",
    "NotInitializedError",
    "PeerError",
    "TopologyError",
    "WindowError",
]


class GossamerError(Exception):
    """Base class of every error gossamer raises on its own account."""


class NotInitializedError(GossamerError, RuntimeError):
    """An operation needs :func:`gossamer.init` to have been called first."""


class TopologyError(GossamerError, ValueError):
    """A topology is malformed or does not fit the group it is used with."""


class CommunicationTimeout(GossamerError, TimeoutError):
    """A blocking wait passed its deadline; the message names the operation and the peers."""


class PeerError(GossamerError, RuntimeError):
    """A peer died, or called a different operation or tensor layout than this rank."""


class WindowError(GossamerError, RuntimeError):
    """A window was used after it was freed, or does not exist at a peer."""
