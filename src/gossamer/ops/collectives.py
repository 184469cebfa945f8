"""Collectives over all ranks of a group: allreduce, broadcast, allgather, barrier.

Each checks first (one small allgather of a call header) that every rank called the same
operation on the same dtype and shape, so a mismatch raises on every rank instead of
producing garbage or a hang; a rank that rejects its arguments still takes part in that
allgather, so the others raise :class:`~gossamer.errors.PeerArgumentError` at once.
Broadcast and allgather move raw bytes, so they take any dtype; allreduce sums in a dtype
the backend has kernels for (see :func:`reduce_into`) and returns the caller's.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.ops._common import (
    SUM_DTYPES,
    check_reduce_op,
    exchange_blocks,
    reduce_code,
    reduce_in_place,
    reject,
)
from gossamer.profiling import count_collective
from gossamer.transport import (
    AVERAGING_DTYPES,
    DTYPES,
    Handle,
    as_bytes,
    check_flag,
    check_rank,
    check_tensor,
    from_bytes,
    group_rank,
    group_size,
    nbytes_of,
    staged,
)

__all__ = [
    "allgather",
    "alltoall",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "exchange_blocks",
    "reduce_into",
]

_ANY_DTYPE = DTYPES
# What a barrier's call header describes: it carries no data.
_NOTHING = torch.empty(0, dtype=torch.uint8)


def reduce_into(out: torch.Tensor, average: bool, group: dist.ProcessGroup | None) -> None:
    """Sum (or average) ``out`` over ``group`` in place; runs on the communication thread.

    Half types are summed in float32, int16 in int32, bool in int32 (a logical or).
    """
    reduce_in_place(out, "average" if average else "sum", group)


def _buffer(tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where the collective writes: the tensor itself (in place, if contiguous) or a copy."""
    return tensor if inplace and tensor.is_contiguous() else tensor.contiguous().clone()


def _result(tensor: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace and out is not tensor:
        tensor.copy_(out)
        return tensor
    return out


def _allreduce(tensor, average, op, group, async_op, inplace) -> torch.Tensor | Handle:
    try:
        check_flag(average, "average", "allreduce")
        if op is None:
            check_tensor(tensor, AVERAGING_DTYPES if average else SUM_DTYPES, "allreduce")
            op = "average" if average else "sum"
        check_tensor(tensor, SUM_DTYPES, "allreduce")
        op = check_reduce_op(op, tensor, "allreduce")
        group_rank(group)
        check_flag(async_op, "async_op", "allreduce")
    except (TypeError, ValueError) as err:
        reject("allreduce", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("allreduce", tensor, group, aux=reduce_code(op))
        out = _buffer(tensor, inplace)
        reduce_in_place(out, op, group)
        return _result(tensor, out, inplace)

    return transport.run("allreduce", body, async_op)


@staged
def allreduce(
    tensor: torch.Tensor,
    *,
    average: bool = True,
    op: str | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Sum or average ``tensor`` over all ranks: :math:`y = \sum_r x_r` (/ n if ``average``).

    Out of place: the input is not modified. Averaging needs a floating or complex dtype
    (float16 and bfloat16 are accumulated in float32); sums also take integer dtypes (int16
    summed in int32, wrapping like int16 arithmetic) and bool (a logical or). ``op`` picks
    another elementwise reduction: :math:`\prod_r x_r`, :math:`\min_r x_r`,
    :math:`\max_r x_r`, or a bitwise and/or/xor of integer or bool tensors. ``"min"`` and
    ``"max"`` are the backend's comparisons; gloo's do not propagate NaN (a NaN held by one
    rank reaches the result or not, depending on the rank). To find a non-finite value on
    any rank, sum ``(~x.isfinite()).sum()`` instead.

    Args:
        tensor (torch.Tensor): this rank's contribution; same dtype and shape on every rank.
        average (bool): divide the sum by the group size.
        op (str, optional): one of ``"sum"``, ``"average"``, ``"product"``, ``"min"``,
            ``"max"``, ``"band"``, ``"bor"``, ``"bxor"``; when given it replaces ``average``.
        group (ProcessGroup, optional): the ranks taking part; the world when None.
        async_op (bool): return a :class:`Handle` instead of waiting.

    Returns:
        torch.Tensor (or a Handle whose ``wait()`` returns it).

    Raises:
        TypeError: not a tensor, an unsupported dtype, or an ``op`` the dtype lacks.
        ValueError: an unknown ``op``.
        PeerArgumentError: on the other ranks, when a rank rejected its arguments.
        PeerError: on every rank, when ranks passed different dtypes, shapes or ops.

    Example:
        >>> gossamer.allreduce(torch.tensor([1.0, 2.0]) * (gossamer.rank() + 1))
        tensor([1.5000, 3.0000])  # Rank 0 and rank 1 of 2
        >>> gossamer.allreduce(torch.tensor([gossamer.rank()]), op="max")
        tensor([1])  # every rank
    """
    return _allreduce(tensor, average, op, group, async_op, inplace=False)


@staged
def allreduce_(
    tensor: torch.Tensor,
    *,
    average: bool = True,
    op: str | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """In-place :func:`allreduce`: writes the result into ``tensor`` and returns it."""
    return _allreduce(tensor, average, op, group, async_op, inplace=True)


def _broadcast(tensor, root, group, async_op, inplace) -> torch.Tensor | Handle:
    try:
        check_tensor(tensor, _ANY_DTYPE, "broadcast")
        check_flag(async_op, "async_op", "broadcast")
        check_rank(root, "root", group_size(group))
        check_flag(async_op, "async_op", "broadcast")
    except (TypeError, ValueError) as err:
        reject("broadcast", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("broadcast", tensor, group, aux=root)
        out = _buffer(tensor, inplace)
        global_root = root if group is None else dist.get_global_rank(group, root)
        work = dist.broadcast(as_bytes(out), global_root, group=group, async_op=True)
        transport.wait_works("broadcast", [(global_root, work)])
        count_collective(
            "broadcast", "broadcast", out.nbytes, group_size(group), group_rank(group), root
        )
        return _result(tensor, out, inplace)

    return transport.run("broadcast", body, async_op)


@staged
def broadcast(
    tensor: torch.Tensor,
    *,
    root: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Return rank ``root``'s ``tensor`` on every rank (out of place; any dtype).

    Args:
        tensor (torch.Tensor): the value on ``root``; elsewhere, a tensor of the same dtype
            and shape (its values are ignored).
        root (int): the rank (in ``group``) whose tensor is sent.
        group (ProcessGroup, optional): the ranks taking part; the world when None.
        async_op (bool): return a :class:`Handle` instead of waiting.

    Raises:
        ValueError: ``root`` out of range. PeerError: ranks disagree on root, dtype or shape
            (PeerArgumentError: another rank rejected its arguments).
    """
    return _broadcast(tensor, root, group, async_op, inplace=False)


@staged
def broadcast_(
    tensor: torch.Tensor,
    *,
    root: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """In-place :func:`broadcast`: overwrites ``tensor`` with root's and returns it."""
    return _broadcast(tensor, root, group, async_op, inplace=True)


@staged
def allgather(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype may not.
    A rank that rejects its arguments makes the others raise ``PeerArgumentError``.

    Example:
        >>> gossamer.allgather(torch.full((gossamer.rank() + 1,), gossamer.rank()))
        tensor([0, 1, 1])  # every rank, world of 2
    """
    try:
        check_tensor(tensor, _ANY_DTYPE, "allgather")
        check_flag(async_op, "async_op", "allgather")
        if tensor.dim() == 0:
            raise ValueError("allgather: tensor must have at least one dimension; got a scalar")
        group_rank(group)
        check_flag(async_op, "async_op", "allgather")
    except (TypeError, ValueError) as err:
        reject("allgather", err, group)
        raise

    def body() -> torch.Tensor:
        shapes = transport.check_same_call("allgather", tensor, group, any_first_dim=True)
        rest = tuple(tensor.shape[1:])
        row = nbytes_of(tensor.dtype, math.prod(rest))
        longest = max(s[0] for s in shapes) * row
        if longest == 0:
            return tensor.new_empty((sum(s[0] for s in shapes), *rest))
        # all_gather needs equal sizes: pad every contribution to the longest, in bytes.
        padded = torch.zeros(longest, dtype=torch.uint8, device=tensor.device)
        padded[: tensor.shape[0] * row] = as_bytes(tensor)
        parts = [torch.empty_like(padded) for _ in shapes]
        work = dist.all_gather(parts, padded, group=group, async_op=True)
        transport.wait_works("allgather", [(-1, work)])
        count_collective("allgather", "all_gather", padded.nbytes, len(shapes))
        data = torch.cat([p[: s[0] * row] for p, s in zip(parts, shapes, strict=True)])
        return from_bytes(data, tensor.dtype, (sum(s[0] for s in shapes), *rest))

    return transport.run("allgather", body, async_op)


@staged
def alltoall(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Split ``tensor`` along dim 0 into ``size`` equal blocks; block k goes to rank k.

    The result holds, in rank order, the block every rank sent to this one (out of place;
    the same shape and dtype on every rank).

    Raises:
        ValueError: dim 0 is not a multiple of the group size, or ``tensor`` is a scalar
            (the peers raise PeerArgumentError).
        PeerError: ranks passed different dtypes or shapes.

    Example:
        >>> gossamer.alltoall(torch.tensor([10, 11]) + 2 * gossamer.rank())
        tensor([10, 12])  # Rank 0 of 2
        tensor([11, 13])  # Rank 1
    """
    try:
        check_tensor(tensor, _ANY_DTYPE, "alltoall")
        size = group_size(group)
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise ValueError(
                f"alltoall: tensor dim 0 must be a multiple of the group size {size}; "
                f"got shape {tuple(tensor.shape)}"
            )
        check_flag(async_op, "async_op", "alltoall")
    except (TypeError, ValueError) as err:
        reject("alltoall", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("alltoall", tensor, group)
        source = tensor.contiguous()
        out = torch.empty_like(source)
        # Raw bytes (gloo has no all_to_all kernel for int16, bool, ...): equal blocks of
        # dim 0 are equal blocks of bytes.
        work = dist.all_to_all_single(as_bytes(out), as_bytes(source), group=group, async_op=True)
        transport.wait_works("alltoall", [(-1, work)])
        count_collective("alltoall", "all_to_all", source.nbytes, size)
        return out

    return transport.run("alltoall", body, async_op)


def barrier(*, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Block until every rank of ``group`` has called ``barrier``.

    A rank that passes a bad ``async_op`` makes the others raise ``PeerArgumentError``.
    """
    try:
        group_rank(group)
        check_flag(async_op, "async_op", "barrier")
    except (TypeError, ValueError) as err:
        reject("barrier", err, group)
        raise

    def body() -> None:
        transport.check_same_call("barrier", _NOTHING, group)
        transport.wait_works("barrier", [(-1, dist.barrier(group=group, async_op=True))])

    return transport.run("barrier", body, async_op)
