"""Saving among the survivors of an elastic job: the records travel through the store.

After a death the world's collectives cannot complete, so :func:`~gossamer.checkpoint.save`
with an elastic optimizer exchanges the per-rank records with
:func:`~gossamer.transport.survivors.gather_live` (through the rendezvous store, among the
live ranks; a rank that dies meanwhile is left out once its heartbeat stops), and the
lowest rank with a record writes the manifest (:func:`~gossamer.transport.survivors.lead`).
The saves of a runtime are numbered; the survivors save in the same order, so their
numbers match.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from gossamer import context
from gossamer.checkpoint._files import CheckpointError
from gossamer.transport import gather_live, lead

__all__ = ["survivors_begin", "survivors_save"]


def survivors_begin() -> str:
    """A barrier among the live ranks (no put of theirs is in flight); return the save's key."""
    counter = context.runtime().component("checkpoint.saves", itertools.count)
    key = f"checkpoint/{next(counter)}"
    gather_live(f"{key}/begin", 0)
    return key


def survivors_save(
    key: str, error: Exception | None, record: list[int], write_manifest: Callable[[dict], None]
) -> None:
    """Exchange the records among the live ranks, then have one write the manifest.

    Raises:
        CheckpointError: a live rank failed to write its file, or the manifest failed.
    """
    entries = gather_live(key, {"failed": error is not None, "record": record})
    if error is not None:
        raise error
    failed = sorted(r for r, entry in entries.items() if entry["failed"])
    if failed:
        raise CheckpointError(f"checkpoint save failed on rank(s) {failed}; see their errors")
    records = {r: entry["record"] for r, entry in entries.items()}
    failure = lead(key, records, lambda: write_manifest(records))
    if failure:
        raise CheckpointError(f"the manifest could not be written by {failure}")
