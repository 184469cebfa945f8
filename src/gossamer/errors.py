"""Exception hierarchy of gossamer: one base class, one subclass per failure kind."""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "CommunicationTimeout",
    "GossamerError",
    "NotInitializedError",
    "PeerArgumentError",
    "PeerError",
    "RankLostError",
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


class PeerArgumentError(PeerError):
    """A peer rejected its arguments for the call this rank made with it.

    The peer raised its own ``ValueError``/``TypeError``; this rank learns of it within the
    call instead of waiting for the deadline. The message names the rank and its reason.

    Attributes:
        rank: the (lowest) global rank that rejected its arguments.
        ranks: every rank that did, ascending.
    """

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks: list[int] = sorted(ranks)
        self.rank: int | None = self.ranks[0] if self.ranks else None


class RankLostError(PeerError):
    """A rank died or left the job; the process group cannot be used any more.

    Every operation after the loss raises it at once. The message names the lost ranks.

    Attributes:
        rank: the (lowest) lost global rank.
        ranks: every lost rank known, ascending.
    """

    def __init__(self, message: str, ranks: Iterable[int] = ()) -> None:
        super().__init__(message)
        self.ranks: list[int] = sorted(ranks)
        self.rank: int | None = self.ranks[0] if self.ranks else None


class WindowError(GossamerError, RuntimeError):
    """A window was used after it was freed, or does not exist at a peer."""
