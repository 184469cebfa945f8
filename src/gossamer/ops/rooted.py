"""Collectives with a root: reduce (to the root), gather (to the root), scatter (from it).

Like the other collectives, each first checks (one small allgather of a call header) that
every rank made the same call (operation, root, reduction, dtype, shape), so a mismatch
raises on every rank instead of a hang, and a rank that rejects its arguments still takes
part in that allgather, so its peers raise :class:`~gossamer.errors.PeerArgumentError` at
once. Gather and scatter move raw bytes (any dtype); reduce runs in a dtype the backend has
kernels for and returns the caller's.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.ops._common import (
    SUM_DTYPES,
    check_reduce_op,
    explain_reduce,
    explain_root,
    narrow_into,
    reduce_code,
    reject,
    torch_op,
    widen,
)
from gossamer.profiling import count_collective
from gossamer.transport import (
    DTYPES,
    Handle,
    as_bytes,
    check_flag,
    check_rank,
    check_tensor,
    from_bytes,
    group_rank,
    group_size,
    staged,
)

__all__ = ["gather", "reduce", "scatter"]

_RANKS = 1 << 20  # header aux: root * _RANKS + reduction


@transport.explains_aux("reduce")
def _explain_reduce(aux: int) -> str:
    return f"{explain_root(aux // _RANKS)}, {explain_reduce(aux % _RANKS)}"


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_rows(tensor: torch.Tensor, op: str) -> None:
    if tensor.dim() == 0:
        raise ValueError(f"{op}: tensor must have at least one dimension; got a scalar")


@staged
def reduce(
    tensor: torch.Tensor,
    *,
    root: int,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle | None:
    r"""Reduce every rank's ``tensor`` elementwise to rank ``root``: :math:`y = \sum_r x_r`.

    ``op`` picks the reduction (as :func:`~gossamer.ops.allreduce`'s): ``"sum"``,
    ``"average"`` (:math:`\frac1n\sum_r x_r`), ``"product"``, ``"min"``, ``"max"``,
    ``"band"``, ``"bor"``, ``"bxor"``. Out of place; half types are reduced in float32.

    Args:
        tensor (torch.Tensor): this rank's contribution; same dtype and shape everywhere.
        root (int): the rank (in ``group``) that receives the result.
        op (str): the reduction.
        group (ProcessGroup, optional): the ranks taking part; the world when None.
        async_op (bool): return a :class:`Handle` instead of waiting.

    Returns:
        The result on ``root``, None on the other ranks (or a Handle whose ``wait()``
        returns it).

    Raises:
        TypeError, ValueError: a bad tensor, dtype, ``root`` or ``op`` (the peers raise
            PeerArgumentError). PeerError: ranks disagree on root, op, dtype or shape.

    Example:
        >>> gossamer.reduce(torch.tensor([gossamer.rank() + 1.0]), root=0, op="max")
        tensor([2.])  # rank 0 of 2; None on rank 1
    """
    try:
        check_tensor(tensor, SUM_DTYPES, "reduce")
        check_flag(async_op, "async_op", "reduce")
        check_rank(root, "root", group_size(group))
        op = check_reduce_op(op, tensor, "reduce")
        me = group_rank(group)
    except (TypeError, ValueError) as err:
        reject("reduce", err, group)
        raise

    def body() -> torch.Tensor | None:
        transport.check_same_call("reduce", tensor, group, aux=root * _RANKS + reduce_code(op))
        out = tensor.contiguous().clone()
        wide = widen(out)
        where = _global(group, root)
        work = dist.reduce(wide, where, op=torch_op(op), group=group, async_op=True)
        transport.wait_works("reduce", [(where, work)])
        count_collective("reduce", "reduce", wide.nbytes, dist.get_world_size(group))
        if me != root:
            return None
        if op == "average":
            wide.div_(dist.get_world_size(group))
        narrow_into(out, wide)
        return out

    return transport.run("reduce", body, async_op)


@staged
def gather(
    tensor: torch.Tensor,
    *,
    root: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle | None:
    """Concatenate every rank's ``tensor`` along dimension 0, in rank order, on ``root``.

    Any dtype; every rank passes the same dtype and shape (at least one dimension).

    Returns:
        On ``root`` a tensor of ``n * tensor.shape[0]`` rows, None on the other ranks (or a
        Handle whose ``wait()`` returns it).

    Raises:
        TypeError, ValueError: a bad tensor or ``root`` (the peers raise
            PeerArgumentError). PeerError: ranks disagree on root, dtype or shape.

    Example:
        >>> gossamer.gather(torch.tensor([gossamer.rank()]), root=1)
        tensor([0, 1])  # rank 1 of 2; None on rank 0
    """
    try:
        check_tensor(tensor, DTYPES, "gather")
        check_flag(async_op, "async_op", "gather")
        _check_rows(tensor, "gather")
        size = group_size(group)
        check_rank(root, "root", size)
        me = group_rank(group)
    except (TypeError, ValueError) as err:
        reject("gather", err, group)
        raise

    def body() -> torch.Tensor | None:
        transport.check_same_call("gather", tensor, group, aux=root)
        data = as_bytes(tensor.contiguous())
        parts = [torch.empty_like(data) for _ in range(size)] if me == root else None
        where = _global(group, root)
        work = dist.gather(data, parts, dst=where, group=group, async_op=True)
        transport.wait_works("gather", [(where, work)])
        count_collective("gather", "gather", data.nbytes, size, me, root)
        if parts is None:
            return None
        shape = (size * tensor.shape[0], *tensor.shape[1:])
        return from_bytes(torch.cat(parts), tensor.dtype, shape)

    return transport.run("gather", body, async_op)


@staged
def scatter(
    tensor: torch.Tensor,
    *,
    root: int,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Split rank ``root``'s ``tensor`` along dim 0 into ``n`` equal blocks; rank k gets block k.

    Every rank passes a tensor of the same dtype and shape (only ``root``'s values are
    read, as in :func:`~gossamer.ops.broadcast`); dim 0 must be a multiple of the group
    size. Any dtype.

    Returns:
        This rank's block, ``tensor.shape[0] // n`` rows (or a Handle whose ``wait()``
        returns it).

    Raises:
        TypeError, ValueError: a bad tensor, shape or ``root`` (the peers raise
            PeerArgumentError). PeerError: ranks disagree on root, dtype or shape.

    Example:
        >>> gossamer.scatter(torch.tensor([10, 11]), root=0)
        tensor([10])  # rank 0 of 2; rank 1 gets tensor([11])
    """
    try:
        check_tensor(tensor, DTYPES, "scatter")
        check_flag(async_op, "async_op", "scatter")
        size = group_size(group)
        check_rank(root, "root", size)
        if tensor.dim() == 0 or tensor.shape[0] % size:
            raise ValueError(
                f"scatter: tensor dim 0 must be a multiple of the group size {size}; "
                f"got shape {tuple(tensor.shape)}"
            )
        me = group_rank(group)
    except (TypeError, ValueError) as err:
        reject("scatter", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("scatter", tensor, group, aux=root)
        shape = (tensor.shape[0] // size, *tensor.shape[1:])
        data = as_bytes(tensor.contiguous())
        out = torch.empty(data.numel() // size, dtype=torch.uint8, device=data.device)
        parts = list(data.chunk(size)) if me == root else None
        where = _global(group, root)
        work = dist.scatter(out, parts, src=where, group=group, async_op=True)
        transport.wait_works("scatter", [(where, work)])
        count_collective("scatter", "scatter", data.nbytes, size, me, root)
        return from_bytes(out, tensor.dtype, shape)

    return transport.run("scatter", body, async_op)
