"""Collectives that cut a tensor into one block per rank: reduce_scatter and alltoall_v.

(:func:`~gossamer.ops.alltoall` is the equal-blocks all-to-all.) Both check first, with
the call-header allgather every collective makes, that all ranks made the same call, and a
rank that rejects its arguments still takes part in it, so its peers raise
:class:`~gossamer.errors.PeerArgumentError` at once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.errors import PeerError
from gossamer.ops._common import (
    SUM_DTYPES,
    check_reduce_op,
    narrow_into,
    reduce_code,
    reject,
    torch_op,
    widen,
)
from gossamer.profiling import count_collective, count_sent
from gossamer.transport import (
    DTYPES,
    Handle,
    as_bytes,
    check_flag,
    check_tensor,
    from_bytes,
    group_rank,
    group_size,
    nbytes_of,
    staged,
)

__all__ = ["alltoall_v", "reduce_scatter"]

# torch 2.13 renamed reduce_scatter_tensor (now deprecated) to reduce_scatter_single.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _check_blocks(tensor: torch.Tensor, size: int, op: str) -> None:
    if tensor.dim() == 0 or tensor.shape[0] % size:
        raise ValueError(
            f"{op}: tensor dim 0 must be a multiple of the group size {size}; "
            f"got shape {tuple(tensor.shape)}"
        )


@staged
def reduce_scatter(
    tensor: torch.Tensor,
    *,
    op: str = "sum",
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Reduce every rank's ``tensor``; rank k keeps block k (along dim 0) of the result.

    With :math:`x_r^{(k)}` block :math:`k` of rank :math:`r`'s tensor, rank :math:`k` gets
    :math:`\sum_r x_r^{(k)}` (or the ``op`` reduction, as :func:`~gossamer.ops.allreduce`'s:
    ``"sum"``, ``"average"``, ``"product"``, ``"min"``, ``"max"``, ``"band"``, ``"bor"``,
    ``"bxor"``). Dim 0 must be a multiple of the group size; half types are reduced in
    float32. Out of place.

    Returns:
        This rank's block, ``tensor.shape[0] // n`` rows (or a Handle whose ``wait()``
        returns it).

    Raises:
        TypeError, ValueError: a bad tensor, shape or ``op`` (the peers raise
            PeerArgumentError). PeerError: ranks disagree on op, dtype or shape.

    Example:
        >>> gossamer.reduce_scatter(torch.tensor([1.0, 2.0]) * (gossamer.rank() + 1))
        tensor([3.])  # rank 0 of 2; rank 1 gets tensor([6.])
    """
    try:
        check_tensor(tensor, SUM_DTYPES, "reduce_scatter")
        check_flag(async_op, "async_op", "reduce_scatter")
        size = group_size(group)
        _check_blocks(tensor, size, "reduce_scatter")
        op = check_reduce_op(op, tensor, "reduce_scatter")
    except (TypeError, ValueError) as err:
        reject("reduce_scatter", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("reduce_scatter", tensor, group, aux=reduce_code(op))
        wide = widen(tensor.contiguous())
        block = torch.empty(
            (tensor.shape[0] // size, *tensor.shape[1:]), dtype=wide.dtype, device=wide.device
        )
        work = _reduce_scatter(block, wide, op=torch_op(op), group=group, async_op=True)
        transport.wait_works("reduce_scatter", [(-1, work)])
        count_collective("reduce_scatter", "reduce_scatter", wide.nbytes, size)
        if op == "average":
            block.div_(size)
        out = torch.empty(block.shape, dtype=tensor.dtype, device=tensor.device)
        narrow_into(out, block)
        return out

    return transport.run("reduce_scatter", body, async_op)


def _check_counts(value: object, name: str, size: int) -> list[int]:
    if (
        isinstance(value, (str, bytes))
        or not isinstance(value, Sequence)
        or len(value) != size
        or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value)
    ):
        raise ValueError(f"alltoall_v: {name} must be {size} ints >= 0; got {value!r}")
    return list(value)


@staged
def alltoall_v(
    tensor: torch.Tensor,
    *,
    send_counts: Sequence[int],
    send_displs: Sequence[int] | None = None,
    recv_counts: Sequence[int] | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """All-to-all with blocks of any size: rank k gets ``send_counts[k]`` rows of this rank.

    ``tensor`` is cut along dim 0, in rank order, into blocks of ``send_counts`` rows
    (their sum must be ``tensor.shape[0]``), or, with ``send_displs``, block k is rows
    ``send_displs[k] .. send_displs[k] + send_counts[k]`` (MPI's ``alltoallv``). The
    result holds, in rank order, the block every rank sent to this one. The counts go
    round with the call check, so ``recv_counts`` is optional; when given it is checked
    against what the peers send. Any dtype; the dims after the first must agree on every
    rank.

    Returns:
        ``sum`` of the received counts rows (or a Handle whose ``wait()`` returns it).

    Raises:
        TypeError, ValueError: a bad tensor or counts (the peers raise PeerArgumentError).
        PeerError: on every rank, when a rank's ``recv_counts`` disagree with what its
            peers send, or ranks disagree on dtype or trailing dims.

    Example:
        >>> gossamer.alltoall_v(torch.arange(3) + 10 * gossamer.rank(), send_counts=[1, 2])
        tensor([ 0, 10])  # rank 0 of 2 (rank 1 sent its first row); rank 1: [1, 2, 11, 12]
    """
    try:
        check_tensor(tensor, DTYPES, "alltoall_v")
        check_flag(async_op, "async_op", "alltoall_v")
        if tensor.dim() == 0:
            raise ValueError("alltoall_v: tensor must have at least one dimension; got a scalar")
        size, me = group_size(group), group_rank(group)
        sends = _check_counts(send_counts, "send_counts", size)
        recvs = None if recv_counts is None else _check_counts(recv_counts, "recv_counts", size)
        rows = _rows(tensor, sends, send_displs, size)
    except (TypeError, ValueError) as err:
        reject("alltoall_v", err, group)
        raise

    def body() -> torch.Tensor:
        transport.check_same_call("alltoall_v", tensor, group, any_first_dim=True)
        table = _count_table(sends, recvs, size, group)
        incoming = table[:, me].tolist()
        width = nbytes_of(tensor.dtype, math.prod(tensor.shape[1:]))  # bytes per row
        data = as_bytes(tensor.contiguous()).view(-1)
        blocks = [data[i * width : (i + c) * width] for i, c in zip(rows, sends, strict=True)]
        out = torch.empty(sum(incoming) * width, dtype=torch.uint8, device=tensor.device)
        work = dist.all_to_all_single(
            out,
            torch.cat(blocks) if blocks else data[:0],
            [c * width for c in incoming],
            [c * width for c in sends],
            group=group,
            async_op=True,
        )
        transport.wait_works("alltoall_v", [(-1, work)])
        count_sent("alltoall_v", sum(c for r, c in enumerate(sends) if r != me) * width)
        return from_bytes(out, tensor.dtype, (sum(incoming), *tensor.shape[1:]))

    return transport.run("alltoall_v", body, async_op)


def _rows(tensor: torch.Tensor, sends: list[int], displs: object, size: int) -> list[int]:
    """The first row of every block; ValueError if a block leaves the tensor."""
    if displs is None:
        if sum(sends) != tensor.shape[0]:
            raise ValueError(
                f"alltoall_v: send_counts must add up to tensor dim 0 ({tensor.shape[0]}); "
                f"got {sends}"
            )
        return [sum(sends[:k]) for k in range(size)]
    starts = _check_counts(displs, "send_displs", size)
    if any(d + c > tensor.shape[0] for d, c in zip(starts, sends, strict=True)):
        raise ValueError(
            f"alltoall_v: send_displs + send_counts exceed the {tensor.shape[0]} rows of "
            f"tensor; got send_displs {starts}, send_counts {sends}"
        )
    return starts


def _count_table(
    sends: list[int], recvs: list[int] | None, size: int, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """Every rank's send counts (row r: what rank r sends to each); checks given receives."""
    expected = recvs if recvs is not None else [-1] * size
    mine = torch.tensor([*sends, *expected], dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(size)]
    work = dist.all_gather(rows, mine, group=group, async_op=True)
    transport.wait_works("alltoall_v", [(-1, work)])
    table = torch.stack(rows)
    sent, wanted = table[:, :size], table[:, size:]
    bad = ((sent != wanted.T) & (wanted.T >= 0)).nonzero().tolist()
    if bad:
        pairs = ", ".join(
            f"{i}->{j}: {sent[i, j]} sent, {wanted[j, i]} expected" for i, j in bad[:6]
        )
        raise PeerError(f"alltoall_v: send and receive counts do not match ({pairs})")
    return sent
