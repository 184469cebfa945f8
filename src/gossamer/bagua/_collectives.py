"""Bagua's reduction operations and receive buffers, translated to :mod:`gossamer.ops`.

Every primitive of :mod:`gossamer.bagua.communication` runs one ``gossamer.ops`` operation
(same-call checks, fail-fast rejection, errors that name the peer); this module holds only
what is Bagua's own: the :class:`ReduceOp` values, writing results into Bagua's
``recv_tensor`` arguments, and :func:`rejecting`, which gives the facade's own argument
checks the same fail-fast rejection as the checks inside ``gossamer.ops``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import IntEnum

import torch
import torch.distributed as dist

from gossamer import transport

__all__ = ["ReduceOp", "check_recv", "numel_of", "op_name", "reduce_op", "rejecting", "write_into"]


class ReduceOp(IntEnum):
    """Bagua's reduction operations (the values of Aluminum's ``ReductionOperator``)."""

    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BOR = 7
    BAND = 8
    BXOR = 9
    AVG = 10


_NAMES = {
    ReduceOp.SUM: "sum",
    ReduceOp.PRODUCT: "product",
    ReduceOp.MIN: "min",
    ReduceOp.MAX: "max",
    ReduceOp.BOR: "bor",
    ReduceOp.BAND: "band",
    ReduceOp.BXOR: "bxor",
    ReduceOp.AVG: "average",
}


@contextlib.contextmanager
def rejecting(op: str, group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run checks of a call of the collective ``op``; a rank whose check fails takes part.

    The rank that raises ``TypeError``/``ValueError`` inside the block queues its part of
    ``op`` on ``group`` (a rejected call header, see :mod:`gossamer.transport.rejection`)
    before the error propagates, so the peers' ``op`` raises ``PeerArgumentError`` naming
    this rank and its reason instead of waiting for the deadline. Only checks that run
    before the ``gossamer.ops`` call belong inside: that call rejects its own arguments.
    """
    try:
        yield
    except (TypeError, ValueError) as err:

        def take_part(reason: str) -> None:
            transport.check_same_call(op, None, group, rejection=reason)

        transport.reject(op, err, group, take_part)
        raise


def numel_of(tensor: object, name: str, op: str) -> int:
    """``tensor.numel()``; TypeError naming the argument when it is not a tensor."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor; got {tensor!r}")
    return tensor.numel()


def check_rank(rank: object, name: str, op: str, nranks: int) -> None:
    """Raise ValueError naming ``name`` (Bagua's ``src`` / ``dst``) unless it is a rank."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < nranks:
        raise ValueError(
            f"{op}: {name} must be a rank of the communicator (0..{nranks - 1}); got {rank!r}"
        )


def check_recv(recv_tensor: object, numel: int, name: str) -> None:
    """Raise unless ``recv_tensor`` is a tensor of ``numel`` elements (before communicating)."""
    if not isinstance(recv_tensor, torch.Tensor):
        raise TypeError(f"{name}: recv_tensor must be a torch.Tensor; got {recv_tensor!r}")
    if recv_tensor.numel() != numel:
        raise ValueError(
            f"{name}: recv_tensor must have {numel} elements; got {recv_tensor.numel()}"
        )


def write_into(recv_tensor: torch.Tensor, value: torch.Tensor, name: str) -> None:
    """Copy ``value`` into ``recv_tensor`` (same number of elements) for operation ``name``."""
    check_recv(recv_tensor, value.numel(), name)
    with torch.no_grad():
        recv_tensor.copy_(value.reshape(recv_tensor.shape))


def reduce_op(op: object) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`; ValueError naming the valid operations otherwise."""
    try:
        return ReduceOp(op)
    except ValueError:
        names = ", ".join(o.name for o in ReduceOp)
        raise ValueError(f"op must be a ReduceOp ({names}); got {op!r}") from None


def op_name(op: object) -> str:
    """The name :mod:`gossamer.ops` gives Bagua's reduction ``op`` (``AVG``: ``"average"``)."""
    return _NAMES[reduce_op(op)]
