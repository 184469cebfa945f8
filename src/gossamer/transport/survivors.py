"""Agreement among the live ranks through the rendezvous store, where collectives cannot run.

After a death, a collective over the world cannot complete (gloo waits for every rank).
What the survivors still need to do together (finish a checkpoint, free a window) goes
through the store instead:

- :func:`gather_live`: every rank writes its value under ``gossamer/live/<key>/<rank>``,
  then waits for the value of every rank not known dead. A rank found dead while awaited
  (its heartbeat stopped, or the launcher's tombstone) is reported to the membership and no
  longer awaited; a value already in the store counts even if its writer died since, so
  every survivor ends with the same values.
- :func:`known_dead`: the agreed dead set, after reporting the ranks this rank's heartbeat
  reader has found lost, so that what one rank's operations skip, every survivor learns.
- :func:`lead`: the lowest living rank of a given set runs an action and posts its outcome;
  the others wait for it. If that rank dies first, the next lowest living one acts.

``key`` must name one occasion: the same on every rank, and never reused in a runtime.
A rank waits only on ranks that still beat, and at most the runtime's timeout.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable

from gossamer import context
from gossamer.errors import CommunicationTimeout
from gossamer.transport.liveness import get_liveness
from gossamer.transport.membership import get_membership

__all__ = ["gather_live", "known_dead", "lead"]

_PREFIX = "gossamer/live/"
_POLL_S = 0.05


class _Client:
    """A store client of its own: the store is not safe to share between threads."""

    def __init__(self, store: object) -> None:
        self.store = store.clone()  # type: ignore[attr-defined]


def _store() -> object:
    runtime = context.runtime()
    if runtime.store is None:
        raise CommunicationTimeout("agreement among the live ranks needs a rendezvous store")
    return runtime.component("transport.survivors", lambda: _Client(runtime.store)).store


def known_dead() -> frozenset[int]:
    """The dead ranks as agreed, once those found lost here are reported (one store read)."""
    membership, liveness = get_membership(), get_liveness()
    if liveness is not None and not liveness.lost <= membership.dead:
        membership.report(liveness.lost)
    membership.refresh()
    return membership.dead


def gather_live(key: str, value: object) -> dict[int, object]:
    """Every live rank's JSON-able ``value`` for ``key``, by rank (this rank's included).

    Raises:
        CommunicationTimeout: ranks that still beat gave no value within the timeout.
        RankLostError: the survivors declared this rank dead.
    """
    store, rank = _store(), context.rank()
    prefix = f"{_PREFIX}{key}/"
    store.set(f"{prefix}{rank}", json.dumps(value))  # type: ignore[attr-defined]
    membership, liveness = get_membership(), get_liveness()
    membership.refresh()
    awaited = set(membership.live)
    got: dict[int, object] = {}

    def read() -> None:
        for r in sorted(awaited - got.keys()):
            if store.check([f"{prefix}{r}"]):  # type: ignore[attr-defined]
                got[r] = json.loads(store.get(f"{prefix}{r}"))  # type: ignore[attr-defined]

    def done() -> bool:
        read()
        if awaited <= got.keys():
            return True
        dead = (liveness.check() if liveness is not None else set()) & (awaited - {rank})
        if dead:
            membership.report(dead)
        membership.refresh()
        read()  # a value written before its writer died still counts
        awaited.difference_update(membership.dead - got.keys())
        return awaited <= got.keys()

    _wait(done, lambda: f"{key}: ranks {sorted(awaited - got.keys())} gave no value")
    return dict(sorted(got.items()))


def lead(key: str, ranks: Iterable[int], action: Callable[[], None]) -> str:
    """Have the lowest living rank of ``ranks`` run ``action()``; return its failure ("" if none).

    Returns once the action has run (here or on that rank). A failure is returned, not
    raised, so that every rank sees the same outcome.
    """
    store, rank, membership = _store(), context.rank(), get_membership()
    ranks = sorted(ranks)
    done_key = f"{_PREFIX}{key}/lead"

    def done() -> bool:
        if store.check([done_key]):  # type: ignore[attr-defined]
            return True
        membership.refresh()
        living = [r for r in ranks if r not in membership.dead]
        if living and living[0] == rank:
            failure = ""
            try:
                action()
            except Exception as err:
                failure = f"{type(err).__name__}: {err}"
            outcome = json.dumps({"rank": rank, "failure": failure})
            store.compare_set(done_key, "", outcome)  # type: ignore[attr-defined]
            return True
        liveness = get_liveness()
        if liveness is not None and living and living[0] in liveness.check():
            membership.report({living[0]})
        return False

    _wait(done, lambda: f"{key}: the lowest living rank of {ranks} did not act")
    outcome = json.loads(store.get(done_key))  # type: ignore[attr-defined]
    return f"rank {outcome['rank']}: {outcome['failure']}" if outcome["failure"] else ""


def _wait(done: Callable[[], bool], what: Callable[[], str]) -> None:
    timeout = context.runtime().timeout
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise CommunicationTimeout(
                f"{what()} within {timeout:g} s (GOSSAMER_TIMEOUT), and they still beat"
            )
        time.sleep(_POLL_S)
