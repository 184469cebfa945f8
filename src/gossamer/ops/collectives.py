"""Collectives over all ranks of a group: allreduce, broadcast, allgather, barrier.

Each checks first (one small allgather of a call header) that every rank called the same
operation on the same dtype and shape, so a mismatch raises on every rank instead of
producing garbage or a hang.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.profiling import timeline
from gossamer.transport import (
    AVERAGING_DTYPES,
    DTYPES,
    Handle,
    check_flag,
    check_rank,
    check_tensor,
    group_rank,
    group_size,
)

__all__ = [
    "allgather",
    "allreduce",
    "allreduce_",
    "barrier",
    "broadcast",
    "broadcast_",
    "reduce_into",
]

_SUM_DTYPES = (*AVERAGING_DTYPES, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
_ANY_DTYPE = DTYPES


def reduce_into(out: torch.Tensor, average: bool, group: dist.ProcessGroup | None) -> None:
    """Sum (or average) ``out`` over ``group`` in place; runs on the communication thread."""
    # Half types are summed in float32: fp16 sums of many ranks overflow and lose bits.
    wide = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
    with timeline.record(None, "communicating"):
        work = dist.all_reduce(wide, group=group, async_op=True)
        transport.wait_works("allreduce", [(-1, work)])
    if average:
        wide.div_(dist.get_world_size(group))
    if wide is not out:
        out.copy_(wide)


def _buffer(tensor: torch.Tensor, inplace: bool) -> torch.Tensor:
    """Where the collective writes: the tensor itself (in place, if contiguous) or a copy."""
    return tensor if inplace and tensor.is_contiguous() else tensor.contiguous().clone()


def _result(tensor: torch.Tensor, out: torch.Tensor, inplace: bool) -> torch.Tensor:
    if inplace and out is not tensor:
        tensor.copy_(out)
        return tensor
    return out


def _allreduce(tensor, average, group, async_op, inplace) -> torch.Tensor | Handle:
    # average first: it decides which dtypes are allowed, so a bad one must not be blamed
    # on the tensor.
    check_flag(average, "average", "allreduce")
    check_tensor(tensor, AVERAGING_DTYPES if average else _SUM_DTYPES, "allreduce")
    group_rank(group)

    def body() -> torch.Tensor:
        transport.check_same_call("allreduce", tensor, group, aux=int(average))
        out = _buffer(tensor, inplace)
        reduce_into(out, average, group)
        return _result(tensor, out, inplace)

    return transport.run("allreduce", body, async_op)


def allreduce(
    tensor: torch.Tensor,
    *,
    average: bool = True,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Sum or average ``tensor`` over all ranks: :math:`y = \sum_r x_r` (/ n if ``average``).

    Out of place: the input is not modified. Averaging needs a floating dtype (float16 and
    bfloat16 are accumulated in float32); sums also take integer dtypes.

    Args:
        tensor (torch.Tensor): this rank's contribution; same dtype and shape on every rank.
        average (bool): divide the sum by the group size.
        group (ProcessGroup, optional): the ranks taking part; the world when None.
        async_op (bool): return a :class:`Handle` instead of waiting.

    Returns:
        torch.Tensor (or a Handle whose ``wait()`` returns it).

    Raises:
        TypeError: not a tensor, or an unsupported dtype.
        PeerError: on every rank, when ranks passed different dtypes or shapes.

    Example:
        >>> gossamer.allreduce(torch.tensor([1.0, 2.0]) * (gossamer.rank() + 1))
        tensor([1.5000, 3.0000])  # Rank 0 and rank 1 of 2
    """
    return _allreduce(tensor, average, group, async_op, inplace=False)


def allreduce_(
    tensor: torch.Tensor,
    *,
    average: bool = True,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """In-place :func:`allreduce`: writes the result into ``tensor`` and returns it."""
    return _allreduce(tensor, average, group, async_op, inplace=True)


def _broadcast(tensor, root, group, async_op, inplace) -> torch.Tensor | Handle:
    check_tensor(tensor, _ANY_DTYPE, "broadcast")
    check_rank(root, "root", group_size(group))

    def body() -> torch.Tensor:
        transport.check_same_call("broadcast", tensor, group, aux=root)
        out = _buffer(tensor, inplace)
        global_root = root if group is None else dist.get_global_rank(group, root)
        work = dist.broadcast(out, global_root, group=group, async_op=True)
        transport.wait_works("broadcast", [(global_root, work)])
        return _result(tensor, out, inplace)

    return transport.run("broadcast", body, async_op)


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
        ValueError: ``root`` out of range. PeerError: ranks disagree on root, dtype or shape.
    """
    return _broadcast(tensor, root, group, async_op, inplace=False)


def broadcast_(
    tensor: torch.Tensor,
    *,
    root: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """In-place :func:`broadcast`: overwrites ``tensor`` with root's and returns it."""
    return _broadcast(tensor, root, group, async_op, inplace=True)


def allgather(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order.

    The first dimension may differ between ranks; the other dimensions and the dtype may not.

    Example:
        >>> gossamer.allgather(torch.full((gossamer.rank() + 1,), gossamer.rank()))
        tensor([0, 1, 1])  # every rank, world of 2
    """
    check_tensor(tensor, _ANY_DTYPE, "allgather")
    if tensor.dim() == 0:
        raise ValueError("allgather: tensor must have at least one dimension; got a scalar")
    group_rank(group)

    def body() -> torch.Tensor:
        shapes = transport.check_same_call("allgather", tensor, group, any_first_dim=True)
        longest = max(s[0] for s in shapes)
        # all_gather needs equal sizes: pad every contribution to the longest first dim.
        padded = tensor.new_zeros((longest, *tensor.shape[1:]))
        padded[: tensor.shape[0]] = tensor
        parts = [torch.empty_like(padded) for _ in shapes]
        work = dist.all_gather(parts, padded, group=group, async_op=True)
        transport.wait_works("allgather", [(-1, work)])
        return torch.cat([p[: s[0]] for p, s in zip(parts, shapes, strict=True)])

    return transport.run("allgather", body, async_op)


def barrier(*, group: dist.ProcessGroup | None = None, async_op: bool = False) -> Handle | None:
    """Block until every rank of ``group`` has called ``barrier``."""
    group_rank(group)

    def body() -> None:
        transport.wait_works("barrier", [(-1, dist.barrier(group=group, async_op=True))])

    return transport.run("barrier", body, async_op)
