"""Distributed mutexes of windows: one lock per (owner, peer) slot, granted first come first served.

``remote_locks`` takes, at each owner rank, the mutex of this rank's slot there (what a put
with ``require_mutex`` holds); ``local_locks`` takes this rank's own mutexes of the given
slots (what ``update(require_mutex=True)`` holds). Both take locks in ascending rank order,
one global order, so two lockers never deadlock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

from gossamer import context
from gossamer.windows.service import Kind, Service, WindowState

__all__ = ["local_locks", "remote_locks"]


@contextlib.contextmanager
def remote_locks(svc: Service | None, state: WindowState, ranks: Sequence[int]) -> Iterator[None]:
    """Hold, at every rank of ``ranks``, its mutex of this rank's slot of ``state``."""
    taken: list[int] = []
    try:
        for owner in sorted(ranks):
            if svc is None:
                raise RuntimeError(f"window {state.name!r}: no window service in a world of one")
            future, sends = svc.request(Kind.LOCK, owner, state.wid, slot=context.rank())
            svc.wait(f"mutex of rank {owner} on {state.name!r}", owner, future, sends)
            taken.append(owner)
        yield
    finally:
        for owner in reversed(taken):
            future, sends = svc.request(Kind.UNLOCK, owner, state.wid, slot=context.rank())
            svc.wait(f"unlock at rank {owner} on {state.name!r}", owner, future, sends)


@contextlib.contextmanager
def local_locks(svc: Service | None, state: WindowState, slots: Sequence[int]) -> Iterator[None]:
    """Hold this rank's own mutexes of ``slots`` of ``state`` (no-op in a world of one)."""
    taken: list[int] = []
    try:
        for slot in sorted(slots):
            if svc is not None:
                svc.acquire_local(state, slot)
            taken.append(slot)
        yield
    finally:
        for slot in reversed(taken):
            if svc is not None:
                svc.release(state, slot)
