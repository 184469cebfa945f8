"""Point-to-point: ``send`` to one rank, ``recv`` from one rank.

Both go through the transport's exchange: a call header travels before the payload, so a
receiver whose tensor differs from the sender's (dtype, shape) raises
:class:`~gossamer.errors.PeerError` naming the sender instead of reading garbage, and a
sender that rejects its arguments sends its reason instead, so the receiver raises
:class:`~gossamer.errors.PeerArgumentError` at once.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.transport import (
    DTYPES,
    Handle,
    check_flag,
    check_rank,
    check_tensor,
    group_rank,
    group_size,
    staged,
)

__all__ = ["recv", "send"]

_OP = "point_to_point"  # one name on the wire for both sides, so their headers match


def _check(tensor: object, peer: object, name: str, op: str, group) -> int:
    check_tensor(tensor, DTYPES, op)
    check_rank(peer, name, group_size(group))
    if peer == group_rank(group):
        raise ValueError(f"{op}: {name} must be another rank; got this rank ({peer})")
    return peer  # type: ignore[return-value]


def _reject(error: Exception, tensor: object, dsts: list[int], srcs: list[int], group) -> None:
    device = tensor.device if isinstance(tensor, torch.Tensor) else None

    def take_part(reason: str) -> None:
        transport.exchange_rejected(_OP, reason, dsts, srcs, group, device)

    transport.reject(_OP, error, group, take_part if dsts or srcs else None)


def _valid_peer(peer: object, group) -> list[int]:
    """``[peer]`` when ``peer`` is a usable rank, so a rejecting rank can still take part.

    Not this rank itself: there is no connection to tell it through.
    """
    try:
        rank = check_rank(peer, "peer", group_size(group))
    except (TypeError, ValueError):
        return []
    return [] if rank == group_rank(group) else [rank]


@staged
def send(
    tensor: torch.Tensor,
    *,
    dst: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> Handle | None:
    """Send ``tensor`` to rank ``dst``, which must call :func:`recv` with this rank as ``src``.

    Any dtype; the receiver's tensor must have the same dtype and shape. Returns when the
    transfer completed (or a Handle).

    With ``async_op=True`` too, operations run one at a time in call order (on the
    communication thread), and a send completes only once ``dst`` receives it. So two
    ranks that each send to the other and then receive wait for each other until the
    deadline, as blocking MPI sends do; to swap tensors call :func:`gossamer.pair_gossip`
    (or let the lower rank send first).

    Raises:
        TypeError, ValueError: a bad tensor or ``dst`` (``dst`` then raises
            PeerArgumentError when it is a valid rank).

    Example:
        >>> if gossamer.rank() == 0:
        ...     gossamer.send(torch.tensor([1.0, 2.0]), dst=1)
    """
    try:
        dst = _check(tensor, dst, "dst", "send", group)
        check_flag(async_op, "async_op", "send")
    except (TypeError, ValueError) as err:
        _reject(err, tensor, _valid_peer(dst, group), [], group)
        raise

    def body() -> None:
        x = tensor.contiguous()
        transport.exchange(_OP, x, {dst: x}, [], group)

    return transport.run("send", body, async_op)


@staged
def recv(
    tensor: torch.Tensor,
    *,
    src: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Receive what rank ``src`` sends with :func:`send`; out of place.

    ``tensor`` gives the expected dtype and shape (its values are not read).

    Returns:
        A new tensor holding ``src``'s data (or a Handle whose ``wait()`` returns it).

    Raises:
        TypeError, ValueError: a bad tensor or ``src``.
        PeerError: ``src`` sent another dtype or shape (the data is drained first).
        PeerArgumentError: ``src`` rejected its arguments.

    Example:
        >>> if gossamer.rank() == 1:
        ...     gossamer.recv(torch.empty(2), src=0)
        tensor([1., 2.])
    """
    try:
        src = _check(tensor, src, "src", "recv", group)
        check_flag(async_op, "async_op", "recv")
    except (TypeError, ValueError) as err:
        _reject(err, tensor, [], _valid_peer(src, group), group)
        raise

    def body() -> torch.Tensor:
        x = tensor.contiguous()
        got = transport.exchange(_OP, x, {}, [src], group)[src]
        return got.clone()  # the exchange's buffers are reused by the next one

    return transport.run("recv", body, async_op)
