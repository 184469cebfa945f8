"""Which ranks are still in the job: a dead set agreed through the rendezvous store.

A rank learns of a death in one of three ways: an exchange with the dead rank fails (gloo's
connection error, confirmed by the heartbeats of :mod:`~gossamer.transport.liveness`), a
peer's call header carries a newer *epoch* than its own, or it reads the store
(:func:`live_ranks`). Survivors agree on the dead set through numbered store keys:

- ``gossamer/membership/<e>`` holds the whole dead set of epoch ``e`` (epoch 0: nobody dead)
  and its *settled round*. It is written once, with ``compare_set`` on an absent key, so
  the first rank to propose epoch ``e`` decides it and every later proposer reads the same
  value. The settled round is the proposer's communication round plus the world size: by
  then the news has reached every survivor of a connected graph (it travels at least one
  hop per round in the epoch of the call headers), so an algorithm whose state must be
  reset on every survivor in the same round (exact diffusion) resets then.
- A rank that finds ranks dead proposes ``epoch + 1`` with its dead set united with its
  own. If another rank won that epoch with a smaller set, it adopts that epoch and proposes
  the next one with the union. Dead sets therefore only grow with the epoch, every rank
  goes through the same sequence, and a rank at epoch ``e`` knows exactly the dead set of
  every other rank at ``e``.
- A rank writes an epoch's key before it sends any header that carries that epoch, so a
  receiver that sees epoch ``e`` in a header can always read its dead set.

A rank named dead by the agreed set (it was slow, not dead) cannot take part any more: it
raises :class:`~gossamer.errors.RankLostError` naming itself.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from gossamer import context
from gossamer.errors import RankLostError

__all__ = [
    "Membership",
    "MembershipChange",
    "get_membership",
    "live_ranks",
    "membership_epoch",
    "on_membership_change",
]

logger = logging.getLogger("gossamer")
_PREFIX = "gossamer/membership/"


@dataclass(frozen=True)
class MembershipChange:
    """What a membership callback receives.

    Attributes:
        epoch: the new epoch (number of agreed changes since the start).
        live: the live global ranks, ascending.
        dead: every dead global rank, ascending.
        lost: the ranks that died since the previous epoch this rank knew.
        settled_round: the communication round by which every survivor knows this epoch
            (-1 when the proposer gave none).
    """

    epoch: int
    live: tuple[int, ...]
    dead: tuple[int, ...]
    lost: tuple[int, ...]
    settled_round: int = -1


class Membership:
    """This rank's view of the live set (a runtime component, ``"transport.membership"``).

    Attributes:
        epoch: the latest epoch this rank adopted.
        dead: the dead ranks of that epoch (never shrinks).
        settled_round: that epoch's settled round (-1: none, or epoch 0).
    """

    def __init__(self, store: object | None, rank: int, size: int) -> None:
        # A clone: the store's client is not safe to share with the heartbeat's threads.
        self._store = store.clone() if store is not None else None  # type: ignore[attr-defined]
        self._rank, self._size = rank, size
        self.epoch = 0
        self.dead: frozenset[int] = frozenset()
        self.settled_round = -1
        self._lock = threading.RLock()
        self._callbacks: list[Callable[[MembershipChange], None]] = []

    @property
    def live(self) -> tuple[int, ...]:
        """The live global ranks, ascending."""
        return tuple(r for r in range(self._size) if r not in self.dead)

    def on_change(self, callback: Callable[[MembershipChange], None]) -> None:
        """Call ``callback(change)`` after every epoch this rank adopts."""
        self._callbacks.append(callback)

    def _read(self, epoch: int) -> bytes | None:
        key = f"{_PREFIX}{epoch}"
        if self._store is None or not self._store.check([key]):
            return None
        return self._store.get(key)

    def _adopt(self, epoch: int, record: bytes | str) -> None:
        decided = json.loads(record)
        dead = frozenset(decided["dead"])
        lost = tuple(sorted(dead - self.dead))
        self.epoch, self.dead = epoch, frozenset(dead | self.dead)
        self.settled_round = int(decided["settled_round"])
        logger.info("rank %d: membership epoch %d, dead %s", self._rank, epoch, sorted(dead))
        change = MembershipChange(
            epoch, self.live, tuple(sorted(self.dead)), lost, self.settled_round
        )
        for callback in list(self._callbacks):
            try:
                callback(change)
            except Exception:
                logger.exception("membership callback failed")
        if self._rank in self.dead:
            raise RankLostError(
                f"membership: the survivors declared rank {self._rank} dead at epoch {epoch} "
                "(it was too slow); it cannot take part any more",
                [self._rank],
            )

    def refresh(self) -> int:
        """Adopt every epoch written in the store after this rank's; return the epoch."""
        with self._lock:
            while True:
                found = self._read(self.epoch + 1)
                if found is None:
                    return self.epoch
                self._adopt(self.epoch + 1, found)

    def catch_up(self, epoch: int) -> None:
        """Adopt the epochs up to ``epoch``, which a peer's header carried.

        Raises:
            RankLostError: the store has no such epoch (the store is gone).
        """
        with self._lock:
            while self.epoch < epoch:
                found = self._read(self.epoch + 1)
                if found is None:
                    raise RankLostError(
                        f"membership: a peer is at epoch {epoch} but the store has no epoch "
                        f"{self.epoch + 1} (is the store's host gone?)",
                        [],
                    )
                self._adopt(self.epoch + 1, found)

    def report(self, lost: Iterable[int], round: int = -1) -> int:
        """Agree with the other survivors that ``lost`` are dead; return the new epoch.

        Proposes ``epoch + 1`` with the current dead set plus ``lost`` (settled round:
        ``round + size`` when ``round >= 0``, the communication round this rank is in); if
        another rank decided that epoch with less, adopts it and proposes the next. Returns
        at once when every rank of ``lost`` is already dead.
        """
        lost = frozenset(lost)
        settled = round + self._size if round >= 0 else -1
        with self._lock:
            self.refresh()
            while not lost <= self.dead:
                proposal = json.dumps({"dead": sorted(self.dead | lost), "settled_round": settled})
                if self._store is None:
                    self._adopt(self.epoch + 1, proposal)
                    continue
                key = f"{_PREFIX}{self.epoch + 1}"
                self._adopt(self.epoch + 1, self._store.compare_set(key, "", proposal))
            return self.epoch


def get_membership() -> Membership:
    """This process's :class:`Membership` (started on first use)."""
    runtime = context.runtime()
    return runtime.component(
        "transport.membership",
        lambda: Membership(runtime.store, runtime.layout.rank, runtime.layout.size),
    )


def live_ranks() -> list[int]:
    """The global ranks still in the job, as agreed by the survivors (ascending).

    Reads the store for epochs decided since this rank last looked, so a death that another
    survivor reported shows here even if this rank has not exchanged with anyone since.
    Deaths nobody has reported yet (a rank that died while no one talked to it) are not
    shown: detection happens when an operation touches the dead rank.

    Example:
        >>> gossamer.live_ranks()   # after rank 2 of 4 was killed and a neighbour noticed
        [0, 1, 3]
    """
    membership = get_membership()
    membership.refresh()
    return list(membership.live)


def membership_epoch() -> int:
    """The number of membership changes this rank has adopted (0: nobody lost)."""
    return get_membership().refresh()


def on_membership_change(callback: Callable[[MembershipChange], None]) -> None:
    """Call ``callback(change)`` each time this rank adopts a new live set.

    ``change`` is a :class:`MembershipChange` (epoch, live, dead, lost). The callback runs
    on the thread that learned of the change, often gossamer's communication thread: keep it
    short, and do not call gossamer operations from it.

    Raises:
        TypeError: ``callback`` is not callable.
    """
    if not callable(callback):
        raise TypeError(f"callback must be callable; got {callback!r}")
    get_membership().on_change(callback)
