"""Bytes on the wire: what this process sent, per operation, since start (or the last reset).

The communication layers call :func:`count_sent` where they hand bytes to the backend; the
counters are always on (one locked addition per message), so benchmarks read them without
switching the timeline on, and while the timeline records, the same bytes appear on it
(``args.bytes`` of the operation's ``"running"`` span, or a ``"sent"`` span of the window
service).

What is counted, per rank (``M`` bytes of this rank's buffer, ``n`` ranks in the group):

=================================  ==================================================
message                            bytes counted on the sending rank
=================================  ==================================================
point-to-point (neighbour          exactly what is sent: each call header
exchanges, CHOCO, window puts,     (:data:`~gossamer.transport.HEADER_LEN` int64 values,
accumulates, gets, replies)        176 bytes) and each payload, once per destination
``all_gather`` (call-header        ``(n - 1) M``: this rank's block reaches every other
checks, ``allgather``)             rank (what a ring allgather sends)
``all_reduce``                     ``2 (n - 1) M // n`` (a ring allreduce)
``all_to_all``                     ``(n - 1) M // n``: the blocks for the other ranks
``broadcast``                      ``M`` on the root and on each rank that relays it
                                   in a chain, i.e. all but the last: ``M`` if this rank
                                   is not ``(root - 1) mod n``, else 0
barriers, window acknowledgements  headers only (176 bytes per acknowledgement)
=================================  ==================================================

Collectives are counted with the bandwidth-optimal ring and chain costs of the cost model
the benchmarks compare with (docs, DESIGN section 6), not with what the backend's own
algorithm relays internally, which it does not report; point-to-point counts are exact.
Compressed payloads count their compressed size: the counts are what compression saves.

Example:
    >>> from gossamer import profiling
    >>> profiling.reset_bytes_sent()
    >>> x = torch.zeros(1000)  # doctest: +SKIP
    >>> gossamer.neighbor_allreduce(x)  # doctest: +SKIP
    >>> profiling.bytes_sent()  # 2 out-neighbours on 3 ranks: 2 x (176 + 4000)  # doctest: +SKIP
    8352
"""

from __future__ import annotations

import numbers
import os
import threading

from gossamer.profiling import spans

__all__ = [
    "bytes_sent",
    "bytes_sent_by_op",
    "collective_bytes",
    "count_collective",
    "count_sent",
    "reset_bytes_sent",
]

_lock = threading.Lock()
_sent: dict[str, int] = {}


def count_sent(op: str, nbytes: int) -> None:
    """Record that ``op`` sent ``nbytes`` bytes; for the communication layers.

    Args:
        op (str): the operation (``"neighbor_allreduce"``, ``"window.put"``, ...).
        nbytes (int): bytes handed to the backend (see the module's table).

    Raises:
        ValueError: ``nbytes`` is not a non-negative integer.
    """
    if check_count(nbytes, "nbytes") == 0:
        return
    with _lock:
        _sent[op] = _sent.get(op, 0) + nbytes
    spans.sent(op, nbytes)


def collective_bytes(collective: str, nbytes: int, size: int, rank: int = 0, root: int = 0) -> int:
    """Bytes one rank sends in ``collective`` over ``size`` ranks, by the module's table.

    Args:
        collective (str): ``"all_gather"``, ``"all_reduce"``, ``"all_to_all"``,
            ``"broadcast"``, ``"reduce"``, ``"reduce_scatter"``, ``"gather"`` or
            ``"scatter"`` (the last four: ``(n - 1) M // n``, the ring's, except that
            ``gather`` counts ``M`` on every rank but the root and ``scatter`` ``(n-1) M // n``
            on the root only).
        nbytes (int): ``M``, the size of this rank's buffer (all blocks, for all-to-all).
        size (int): ranks in the group.
        rank (int): this rank in the group (broadcast, gather, scatter).
        root (int): the root's rank in the group (broadcast, gather, scatter).

    Raises:
        ValueError: an unknown ``collective``, ``nbytes`` or ``size`` not a non-negative or
            positive integer, ``rank`` or ``root`` not in ``range(size)``.

    Example:
        >>> collective_bytes("all_reduce", 1000, 4)
        1500
    """
    check_count(nbytes, "nbytes")
    if check_count(size, "size") == 0:
        raise ValueError("size must be at least 1; got 0")
    for name, value in (("rank", rank), ("root", root)):
        if check_count(value, name) >= size:
            raise ValueError(f"{name} must be in range(size={size}); got {value!r}")
    if collective == "all_gather":
        return (size - 1) * nbytes
    if collective == "all_reduce":
        return 2 * (size - 1) * nbytes // size
    if collective in ("all_to_all", "reduce", "reduce_scatter"):
        return (size - 1) * nbytes // size
    if collective == "broadcast":
        return 0 if size < 2 or rank == (root - 1) % size else nbytes
    if collective == "gather":
        return 0 if rank == root else nbytes
    if collective == "scatter":
        return (size - 1) * nbytes // size if rank == root else 0
    raise ValueError(f"collective must be a known collective; got {collective!r}")


def check_count(value: object, name: str) -> int:
    """Return ``value`` if it is a non-negative integer (not a bool), else raise naming ``name``.

    Raises:
        ValueError: it is not.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
    return int(value)


def count_collective(
    op: str, collective: str, nbytes: int, size: int, rank: int = 0, root: int = 0
) -> None:
    """:func:`count_sent` of :func:`collective_bytes`; for the communication layers."""
    count_sent(op, collective_bytes(collective, nbytes, size, rank, root))


def bytes_sent(op: str | None = None) -> int:
    """Bytes this process sent since it started or since :func:`reset_bytes_sent`.

    Args:
        op (str, optional): only this operation's (a key of :func:`bytes_sent_by_op`).

    Raises:
        TypeError: ``op`` is not a str.

    Example:
        >>> bytes_sent("neighbor_allreduce")  # doctest: +SKIP
        8352
    """
    if op is not None and not isinstance(op, str):
        raise TypeError(f"op must be a str or None; got {op!r}")
    with _lock:
        return sum(_sent.values()) if op is None else _sent.get(op, 0)


def bytes_sent_by_op() -> dict[str, int]:
    """``{operation: bytes sent}`` since start or the last :func:`reset_bytes_sent`.

    Operations made of operations count under the inner ones: a compressed allreduce's
    bytes are those of its ``"alltoall"`` and ``"allgather"``.
    """
    with _lock:
        return dict(_sent)


def reset_bytes_sent() -> None:
    """Set every counter of this process back to zero."""
    with _lock:
        _sent.clear()


def _forget() -> None:
    # A forked child is another process: it starts from zero (no lock: see spans._forget).
    _sent.clear()


os.register_at_fork(after_in_child=_forget)
