"""Rejected calls: a rank that refuses its arguments still takes its part, so peers learn why.

Every operation checks its arguments at the public boundary, before anything is queued. A
rank whose check fails raises its ``ValueError`` / ``TypeError`` at once, but first queues
*its part of the call* on the communication thread, where it runs in program order like any
other operation:

- collectives: the header allgather of
  :func:`~gossamer.transport.p2p.check_same_call` carries a ``"rejected"`` header, then one
  more allgather carries the reasons; every rank of the group raises
  :class:`~gossamer.errors.PeerArgumentError`;
- neighbour exchanges (:func:`~gossamer.transport.p2p.exchange`): the rejecting rank sends
  a ``"rejected"`` header and then its reason as the payload to the ranks its arguments
  name as destinations, and receives (and drops) what its sources send; the ranks that
  expected data from it raise ``PeerArgumentError`` after their other transfers complete.

Every message the peers post is matched, so the group stays usable and the next call works.
A rank takes part only with peers its arguments name for certain: the group (collectives,
and neighbour calls with ``check_topology=True``, whose graph check is an allgather), the
topology (static neighbour calls), or explicit peer lists whose every entry is valid. When
the bad argument is the group, the topology or a peer list, it raises without taking part
(a guess could leave a message of its own unmatched), and its peers time out as before. In
dynamic mode only the ranks that receive from the rejecting rank learn of it; ranks that
only send to it complete normally (their result does not depend on it).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.errors import GossamerError, PeerArgumentError
from gossamer.profiling import count_collective
from gossamer.transport import engine
from gossamer.transport.checks import group_rank
from gossamer.transport.failures import wait_works
from gossamer.transport.header import OPS, Header

__all__ = [
    "REJECTED",
    "gather_reasons",
    "peer_argument_error",
    "reason",
    "reject",
    "rejected_header",
]

logger = logging.getLogger("gossamer")

REJECTED = "rejected"
_MAX_REASON_BYTES = 2000


def reason(error: BaseException) -> str:
    """What this rank tells its peers: ``"rank 0 rejected its arguments: ValueError: ..."``."""
    text = f"rank {context.rank()} rejected its arguments: {type(error).__name__}: {error}"
    data = text.encode()[:_MAX_REASON_BYTES]
    return data.decode(errors="ignore")


def rejected_header(op: str, text: str, origin: int | None = None) -> Header:
    """The header a rank sends instead of its call of ``op``; its payload is ``text``.

    ``origin`` is the global rank that rejected its arguments (this one by default; a
    machine's leader passes on another's).
    """
    origin = context.rank() if origin is None else origin
    return Header(REJECTED, torch.uint8, (len(text.encode()),), aux=OPS.index(op), slot=origin)


def peer_argument_error(op: str, texts: Mapping[int, str]) -> PeerArgumentError:
    """The error of a rank whose peers (global ranks -> reasons) rejected their arguments."""
    first = min(texts)
    message = f"{op}: {texts[first]}"
    others = sorted(texts)[1:]
    if others:
        message += f" (ranks {others} rejected theirs too)"
    return PeerArgumentError(message, texts)


def gather_reasons(
    op: str, lengths: list[int], text: str | None, group: dist.ProcessGroup | None
) -> list[str]:
    """Allgather every rank's reason (``lengths`` in bytes, from the headers; 0: none)."""
    longest = max(lengths)
    mine = torch.zeros(longest, dtype=torch.uint8)
    if text:
        data = text.encode()
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    parts = [torch.empty_like(mine) for _ in lengths]
    wait_works(op, [(-1, dist.all_gather(parts, mine, group=group, async_op=True))])
    count_collective(op, "all_gather", mine.nbytes, len(lengths))
    return [
        bytes(p[:n].tolist()).decode(errors="replace") for p, n in zip(parts, lengths, strict=True)
    ]


def reject(
    op: str,
    error: BaseException,
    group: dist.ProcessGroup | None,
    take_part: Callable[[str], None] | None,
) -> None:
    """Queue this rank's part of the call it rejected (``take_part(reason)``); don't wait.

    The caller raises ``error`` next. ``take_part`` is None when the arguments name no
    peers; nothing is queued when ``group`` itself is unusable.
    """
    if take_part is None or not context.is_initialized():
        return
    try:
        group_rank(group)
    except (TypeError, ValueError):  # not a group, or one this rank is not in: no peers
        return
    text = reason(error)

    def part() -> None:
        try:
            take_part(text)
        except Exception:  # the caller already has its error; this one is only logged
            logger.warning("%s: telling the peers of a rejected call failed", op, exc_info=True)

    with contextlib.suppress(GossamerError):  # a rank was lost: no call left to take part in
        engine.submit(op, part)
