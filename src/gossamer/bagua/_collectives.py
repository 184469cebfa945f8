"""Bagua's reduction operations and receive buffers, translated to :mod:`gossamer.ops`.

Every primitive of :mod:`gossamer.bagua.communication` runs one ``gossamer.ops`` operation
(same-call checks, fail-fast rejection, errors that name the peer); this module holds only
what is Bagua's own: the :class:`ReduceOp` values and writing results into Bagua's
``recv_tensor`` arguments.
"""

from __future__ import annotations

from enum import IntEnum

import torch

__all__ = ["ReduceOp", "check_recv", "op_name", "reduce_op", "write_into"]


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
