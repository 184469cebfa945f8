"""Waiting on torch.distributed work, with errors that name the operation and the peer.

gloo's errors are translated: a connection closed or reset becomes
:class:`~gossamer.errors.RankLostError` naming the dead rank when the heartbeats
(:mod:`~gossamer.transport.liveness`) show one died (gloo's text names an address, often a
survivor's), a timeout :class:`~gossamer.errors.CommunicationTimeout`, anything else
:class:`~gossamer.errors.PeerError`. A wait that stalls because a rank died without this
rank seeing an error is failed by the engine's watchdog (:mod:`~gossamer.transport.engine`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch.distributed as dist

from gossamer import context, env
from gossamer.errors import CommunicationTimeout, PeerError, RankLostError
from gossamer.transport.liveness import BEAT_S, Liveness, get_liveness

__all__ = ["find_lost", "is_backend_error", "lost_error", "translate", "wait_works"]

_POLL_S = 0.25  # how often a failed wait reads the heartbeats
_CONNECTION = ("closed", "reset", "Broken pipe", "Connection", "pair closure")


def lost_error(op: str, ranks: Iterable[int]) -> RankLostError:
    """The error of an operation that cannot complete because ``ranks`` are lost."""
    ranks = sorted(ranks)
    one = len(ranks) == 1
    who, its = (f"rank {ranks[0]} was", "its") if one else (f"ranks {ranks} were", "their")
    return RankLostError(
        f"{op}: {who} lost ({its} process died or left the job, or {its} heartbeat stood still "
        f"for GOSSAMER_DEAD_AFTER={env.settings().dead_after:g} s); rank {context.rank()} "
        "cannot use the process group any more",
        ranks,
    )


def is_backend_error(err: BaseException) -> bool:
    """True for an error of gloo or NCCL (a transfer or connection failed, a timeout)."""
    text = str(err)
    return isinstance(err, RuntimeError) and any(
        k in text for k in ("gloo", "NCCL", "Timed out", *_CONNECTION)
    )


def _find_lost(live: Liveness, patient: bool, peer: int | None = None) -> set[int]:
    """Lost ranks; when ``patient``, read the heartbeats long enough to see a death.

    With ``peer``, wait for that rank to show lost, not for any: after a first death the
    lost set is never empty, and a later death must still be waited for.
    """
    deadline = time.monotonic() + (live.dead_after + 2 * BEAT_S if patient else 0.0)
    while True:
        lost = live.check()
        if (lost if peer is None else peer in lost) or time.monotonic() >= deadline:
            return lost
        time.sleep(_POLL_S)


def find_lost(patient: bool = True, peer: int | None = None) -> set[int]:
    """The ranks the heartbeats show lost (none without peers), read now.

    ``patient``: when none is known lost yet (with ``peer``: when ``peer`` is not), read
    the heartbeats for as long as a death takes to show (``GOSSAMER_DEAD_AFTER`` and two
    beats).
    """
    live = get_liveness()
    if live is None:
        return set()
    return _find_lost(live, patient, peer)


def translate(op: str, peer: int, err: BaseException, live: Liveness | None) -> Exception:
    """The gossamer error for backend error ``err`` of ``op`` (``peer``: -1 for all ranks)."""
    text = str(err)
    timed_out = "Timed out" in text or "timeout" in text.lower()
    broken = any(k in text for k in _CONNECTION)
    if live is not None and (timed_out or broken):
        left = live.check_left(peer if peer >= 0 else None) if broken else set()
        if left:
            return lost_error(op, left)
        lost = _find_lost(live, broken and not timed_out, peer if peer >= 0 else None)
        if lost:
            return lost_error(op, lost)
    who = "a peer" if peer < 0 else f"rank {peer}"
    if timed_out:
        waited = "all ranks" if peer < 0 else who
        return CommunicationTimeout(
            f"{op}: rank {context.rank()} timed out after {context.timeout():g} s "
            f"waiting for {waited}{_whereabouts(live, op, peer)}"
        )
    if broken:
        return PeerError(
            f"{op}: {who} closed its connection to rank {context.rank()}; "
            "did that rank crash or exit?"
        )
    return PeerError(f"{op}: communication with {who} failed: {text}")


def _whereabouts(live: Liveness | None, op: str, peer: int) -> str:
    """Where the other ranks (or ``peer``) were waiting at their last heartbeat, for a timeout.

    A rank stuck outside gossamer (a hang in the program, a slow data loader) waits in no
    operation, while the ranks waiting for it wait in ``op``: those are named first.
    """
    found = {} if live is None else live.activities()
    if peer >= 0:
        found = {r: doing for r, doing in found.items() if r == peer}
    by_activity: dict[str, list[int]] = {}
    for r, doing in sorted(found.items()):
        by_activity.setdefault(doing, []).append(r)
    said = "; ".join(
        f"{f'rank {rs[0]}' if len(rs) == 1 else f'ranks {rs}'} "
        f"{f'waiting in {doing}' if doing else 'in no gossamer operation'}"
        for doing, rs in sorted(by_activity.items(), key=lambda a: (a[0] == op, a[0] != "", a[1]))
    )
    if not said:
        return ""
    return f" (at {'its' if peer >= 0 else 'their'} last heartbeat: {said})"


def wait_works(op: str, works: Iterable[tuple[int, dist.Work]]) -> None:
    """Wait for each ``(peer, work)``; turn backend errors into errors that name the peer.

    ``peer`` is a global rank, or -1 for a collective over all ranks.

    Raises:
        RankLostError: a rank died or left (now or earlier); the group is unusable.
        CommunicationTimeout: the backend's deadline passed.
        PeerError: a peer closed its connection or the transfer failed.
    """
    live = get_liveness()
    if live is not None and live.lost:
        raise lost_error(op, live.lost)
    for peer, work in works:
        try:
            work.wait()
        except RuntimeError as err:
            raise translate(op, peer, err, live) from err
