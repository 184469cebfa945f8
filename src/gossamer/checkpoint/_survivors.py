"""Saving among the survivors of an elastic job: the records travel through the store.

After a death the world's collectives cannot complete (gloo's allgather waits for every
rank), so :func:`~gossamer.checkpoint.save` with an elastic optimizer exchanges the
per-rank records through the rendezvous store, among the ranks that are alive:

1. every rank writes its file, then its record (or its failure) under
   ``gossamer/checkpoint/<n>/<rank>``, where ``n`` counts the saves of this runtime (the
   survivors save in the same order, so their ``n`` match);
2. it waits for the record of every rank not known dead. A rank found dead while awaited
   (its heartbeat stopped, or the launcher's tombstone) is reported to the membership and
   no longer awaited; a record already in the store counts even if its writer has died
   since, so every survivor ends with the same set of records;
3. the lowest rank with a record writes the manifest of the recorded files, then the key
   ``.../<n>/manifest``; the others wait for that key. If that rank dies first, the next
   lowest living one writes it.

Nothing here is collective over the world, and a rank waits only on ranks that beat.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable

from gossamer import context
from gossamer.checkpoint._files import CheckpointError
from gossamer.transport import get_liveness, get_membership

__all__ = ["survivors_exchange", "survivors_publish"]

_PREFIX = "gossamer/checkpoint/"
_POLL_S = 0.05


class _Saves:
    """The store client (a clone: the store is not safe to share) and the save counter."""

    def __init__(self, store: object) -> None:
        self.store = store.clone()  # type: ignore[attr-defined]
        self.counter = itertools.count()
        self.current = -1


def _saves() -> _Saves:
    runtime = context.runtime()
    if runtime.store is None:
        raise CheckpointError("saving without the world's collectives needs a rendezvous store")
    return runtime.component("checkpoint.saves", lambda: _Saves(runtime.store))


def survivors_exchange(
    rank: int, error: Exception | None, record: list[int], what: str
) -> dict[int, list[int]]:
    """Every live rank's record, by rank; every rank raises if a live rank failed.

    Raises:
        CheckpointError: a live rank failed, or records did not arrive within the
            runtime's timeout from ranks that still beat.
    """
    saves = _saves()
    saves.current = next(saves.counter)
    prefix = f"{_PREFIX}{saves.current}/"
    saves.store.set(f"{prefix}{rank}", json.dumps({"failed": error is not None, "record": record}))
    got = _collect(saves.store, prefix, rank)
    if error is not None:
        raise error
    failed = sorted(r for r, entry in got.items() if entry["failed"])
    if failed:
        raise CheckpointError(f"checkpoint {what} failed on rank(s) {failed}; see their errors")
    return {r: entry["record"] for r, entry in sorted(got.items())}


def _collect(store: object, prefix: str, rank: int) -> dict[int, dict]:
    membership, liveness = get_membership(), get_liveness()
    membership.refresh()
    awaited = set(membership.live)
    got: dict[int, dict] = {}

    def read() -> None:
        for r in sorted(awaited - got.keys()):
            key = f"{prefix}{r}"
            if store.check([key]):  # type: ignore[attr-defined]
                got[r] = json.loads(store.get(key))  # type: ignore[attr-defined]

    def lost() -> set[int]:
        dead = (liveness.check() if liveness is not None else set()) & (awaited - {rank})
        if dead:
            membership.report(dead)
        membership.refresh()
        return set(membership.dead)

    def done() -> bool:
        read()
        if awaited <= got.keys():
            return True
        dead = lost()
        read()  # a record written before its writer died still counts
        awaited.difference_update(dead - got.keys())
        return awaited <= got.keys()

    _wait(done, lambda: f"the records of ranks {sorted(awaited - got.keys())}")
    return got


def survivors_publish(rank: int, ranks: list[int], write: Callable[[], None]) -> None:
    """Have the lowest living rank of ``ranks`` run ``write()``; return when it has.

    ``ranks`` are the ranks whose records :func:`survivors_exchange` returned.

    Raises:
        CheckpointError: ``write()`` failed (here or on the writing rank).
    """
    saves = _saves()
    key = f"{_PREFIX}{saves.current}/manifest"
    store, membership = saves.store, get_membership()

    def done() -> bool:
        if store.check([key]):  # type: ignore[attr-defined]
            return True
        membership.refresh()
        living = [r for r in ranks if r not in membership.dead]
        if living and living[0] == rank:
            failure = ""
            try:
                write()
            except Exception as err:
                failure = f"{type(err).__name__}: {err}"
            store.compare_set(key, "", json.dumps({"rank": rank, "failure": failure}))  # type: ignore[attr-defined]
            return True
        liveness = get_liveness()
        if liveness is not None and living:
            lost = liveness.check() & {living[0]}
            if lost:
                membership.report(lost)
        return False

    _wait(done, lambda: "the manifest")
    outcome = json.loads(store.get(key))  # type: ignore[attr-defined]
    if outcome["failure"]:
        raise CheckpointError(
            f"rank {outcome['rank']} could not write the manifest: {outcome['failure']}"
        )


def _wait(done: Callable[[], bool], what: Callable[[], str]) -> None:
    deadline = time.monotonic() + context.runtime().timeout
    while not done():
        if time.monotonic() > deadline:
            raise CheckpointError(
                f"checkpoint: {what()} did not arrive within {context.runtime().timeout:g} s "
                "(GOSSAMER_TIMEOUT), and those ranks still beat"
            )
        time.sleep(_POLL_S)
