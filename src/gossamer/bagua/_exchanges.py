"""Bagua's gathering and exchanging primitives (re-exported by ``communication``).

``allgather``, ``gather``, ``scatter``, ``reduce_scatter``, ``alltoall`` and ``alltoall_v``
with their in-place twins, in Bagua's signatures; see :mod:`gossamer.bagua.communication`.
"""

from __future__ import annotations

import torch

from gossamer import ops
from gossamer.bagua._collectives import (
    ReduceOp,
    check_rank,
    check_recv,
    numel_of,
    op_name,
    rejecting,
    write_into,
)
from gossamer.bagua._groups import BaguaCommunicator, resolve

__all__ = [
    "allgather",
    "allgather_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "gather",
    "gather_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
]


def _split_count(tensor: torch.Tensor, size: int, name: str) -> int:
    if tensor.numel() % size:
        raise ValueError(
            f"{name}: tensor must have a multiple of the group size ({size}) elements; "
            f"got {tensor.numel()}"
        )
    return tensor.numel() // size


def _placeholder(like: torch.Tensor, numel: int) -> torch.Tensor:
    """What a non-root rank passes to ``ops.scatter``: only its dtype and size count."""
    return torch.empty(numel, dtype=like.dtype, device=like.device)


def allgather(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: BaguaCommunicator | None = None
) -> None:
    """Every rank's ``send_tensor``, concatenated in rank order, into ``recv_tensor``."""
    c = resolve(comm)
    if c is not None:
        with rejecting("allgather", c.group):
            numel = numel_of(send_tensor, "send_tensor", "allgather")
            check_recv(recv_tensor, c.nranks() * numel, "allgather")
        write_into(recv_tensor, ops.allgather(send_tensor.reshape(-1), group=c.group), "allgather")


def allgather_inplace(tensor: torch.Tensor, comm: BaguaCommunicator | None = None) -> None:
    """In-place :func:`allgather`: chunk ``rank`` of the flat ``tensor`` is this rank's input."""
    c = resolve(comm)
    if c is not None:
        with rejecting("allgather", c.group):
            count = _split_count(tensor, c.nranks(), "allgather_inplace")
        mine = tensor.reshape(-1)[c.rank() * count : (c.rank() + 1) * count]
        write_into(tensor, ops.allgather(mine, group=c.group), "allgather_inplace")


def gather(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    dst: int,
    comm: BaguaCommunicator | None = None,
) -> None:
    """Rank ``dst`` gets every rank's ``send_tensor`` in rank order in ``recv_tensor``."""
    c = resolve(comm)
    if c is not None:
        with rejecting("gather", c.group):
            check_rank(dst, "dst", "gather", c.nranks())
            numel = numel_of(send_tensor, "send_tensor", "gather")
            if c.rank() == dst:
                check_recv(recv_tensor, c.nranks() * numel, "gather")
        result = ops.gather(send_tensor.reshape(-1), root=dst, group=c.group)
        if result is not None:
            write_into(recv_tensor, result, "gather")


def gather_inplace(
    tensor: torch.Tensor, count: int, dst: int, comm: BaguaCommunicator | None = None
) -> None:
    """In-place :func:`gather`.

    On ``dst``, ``tensor`` has nranks x ``count`` elements, its own input at chunk ``dst``;
    elsewhere ``tensor`` has ``count`` elements.
    """
    c = resolve(comm)
    if c is None:
        return
    flat = tensor.reshape(-1)
    mine = flat[dst * count : (dst + 1) * count] if c.rank() == dst else flat
    gather(mine, tensor, dst, c)


def scatter(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    src: int,
    comm: BaguaCommunicator | None = None,
) -> None:
    """Chunk ``i`` of rank ``src``'s ``send_tensor`` goes to rank ``i``'s ``recv_tensor``."""
    c = resolve(comm)
    if c is not None:
        with rejecting("scatter", c.group):
            check_rank(src, "src", "scatter", c.nranks())
            count = numel_of(recv_tensor, "recv_tensor", "scatter")
        mine = send_tensor if c.rank() == src else _placeholder(send_tensor, c.nranks() * count)
        write_into(recv_tensor, ops.scatter(mine.reshape(-1), root=src, group=c.group), "scatter")


def scatter_inplace(
    tensor: torch.Tensor, count: int, src: int, comm: BaguaCommunicator | None = None
) -> None:
    """In-place :func:`scatter`.

    On ``src``, ``tensor`` has nranks x ``count`` elements (its own chunk stays in place);
    elsewhere it receives ``count`` elements.
    """
    c = resolve(comm)
    if c is None:
        return
    mine = tensor if c.rank() == src else _placeholder(tensor, c.nranks() * count)
    result = ops.scatter(mine.reshape(-1), root=src, group=c.group)
    if c.rank() != src:
        write_into(tensor, result, "scatter_inplace")


def reduce_scatter(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    comm: BaguaCommunicator | None = None,
) -> None:
    """Reduce ``send_tensor`` with ``op``; rank ``i`` gets chunk ``i`` in ``recv_tensor``."""
    c = resolve(comm)
    if c is not None:
        with rejecting("reduce_scatter", c.group):
            numel = numel_of(send_tensor, "send_tensor", "reduce_scatter")
            check_recv(recv_tensor, numel // c.nranks(), "reduce_scatter")
            name = op_name(op)
        result = ops.reduce_scatter(send_tensor.reshape(-1), op=name, group=c.group)
        write_into(recv_tensor, result, "reduce_scatter")


def reduce_scatter_inplace(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: BaguaCommunicator | None = None
) -> None:
    """In-place :func:`reduce_scatter`: the result lands in chunk ``rank`` of ``tensor``."""
    c = resolve(comm)
    if c is None:
        return
    with rejecting("reduce_scatter", c.group):
        numel_of(tensor, "tensor", "reduce_scatter_inplace")
        name = op_name(op)
    result = ops.reduce_scatter(tensor.reshape(-1), op=name, group=c.group)
    count = result.numel()
    write_into(
        tensor.reshape(-1)[c.rank() * count : (c.rank() + 1) * count], result, "reduce_scatter"
    )


def alltoall(
    send_tensor: torch.Tensor, recv_tensor: torch.Tensor, comm: BaguaCommunicator | None = None
) -> None:
    """Chunk ``j`` of ``send_tensor`` goes to rank ``j``.

    Chunk ``i`` of ``recv_tensor`` comes from rank ``i``; sizes are divisible by the
    number of ranks.
    """
    c = resolve(comm)
    if c is not None:
        with rejecting("alltoall", c.group):
            check_recv(recv_tensor, numel_of(send_tensor, "send_tensor", "alltoall"), "alltoall")
        write_into(recv_tensor, ops.alltoall(send_tensor.reshape(-1), group=c.group), "alltoall")


def alltoall_inplace(tensor: torch.Tensor, comm: BaguaCommunicator | None = None) -> None:
    """In-place :func:`alltoall`."""
    alltoall(tensor, tensor, comm)


def _displacements(displs: list[int], name: str, size: int) -> list[int]:
    """The first ``size`` displacements; ValueError unless there are ``size`` or ``size + 1``."""
    displs = list(displs)
    if len(displs) not in (size, size + 1):
        raise ValueError(
            f"alltoall_v: {name} must have {size} or {size + 1} entries (one per rank, and "
            f"optionally the end); got {len(displs)}: {displs}"
        )
    return displs[:size]


def _check_landing(displs: list[int], counts: list[int], numel: int) -> None:
    """ValueError unless every block ``[displs[i], displs[i] + counts[i])`` fits the tensor."""
    for i, (displ, count) in enumerate(zip(displs, counts, strict=False)):
        if not 0 <= displ <= displ + count <= numel:
            raise ValueError(
                f"alltoall_v: recv_displs[{i}] = {displ} with recv_counts[{i}] = {count} "
                f"falls outside recv_tensor's {numel} elements"
            )


def alltoall_v(
    send_tensor: torch.Tensor,
    send_counts: list[int],
    send_displs: list[int],
    recv_tensor: torch.Tensor,
    recv_counts: list[int],
    recv_displs: list[int],
    comm: BaguaCommunicator | None = None,
) -> None:
    """:func:`alltoall` with per-rank counts and displacements.

    Rank ``j`` gets ``send_tensor[send_displs[j]:][:send_counts[j]]``; what rank ``i`` sent
    lands at ``recv_tensor[recv_displs[i]:][:recv_counts[i]]``. A displacement list may
    have one entry more than the group has ranks (the end offset, as in Bagua's example);
    only the first ``nranks`` entries are read, as Bagua does.
    """
    c = resolve(comm)
    if c is None:
        return
    with rejecting("alltoall_v", c.group):
        numel_of(recv_tensor, "recv_tensor", "alltoall_v")
        if not recv_tensor.is_contiguous():
            raise ValueError("alltoall_v: recv_tensor must be contiguous")
        send_displs = _displacements(send_displs, "send_displs", c.nranks())
        recv_displs = _displacements(recv_displs, "recv_displs", c.nranks())
        _check_landing(recv_displs, recv_counts, recv_tensor.numel())
    got = ops.alltoall_v(
        send_tensor.reshape(-1),
        send_counts=list(send_counts),
        send_displs=list(send_displs),
        recv_counts=list(recv_counts),
        group=c.group,
    )
    flat = recv_tensor.reshape(-1)
    offset = 0
    with torch.no_grad():
        for displ, count in zip(recv_displs, recv_counts, strict=True):
            flat[displ : displ + count] = got[offset : offset + count]
            offset += count


def alltoall_v_inplace(
    tensor: torch.Tensor,
    counts: list[int],
    displs: list[int],
    comm: BaguaCommunicator | None = None,
) -> None:
    """In-place :func:`alltoall_v` with the same counts and displacements both ways."""
    alltoall_v(tensor, counts, displs, tensor, counts, displs, comm)
