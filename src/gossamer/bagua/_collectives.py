"""Collectives Bagua offers and :mod:`gossamer.ops` does not, on gossamer's transport.

Reductions other than sum and average, ``reduce``, ``gather``, ``scatter``,
``reduce_scatter``, ``alltoall_v``, ``send`` and ``recv``. They keep gossamer's rules: each
runs on gossamer's communication thread (so it is ordered with every other gossamer
operation of the process), a collective first checks with one small allgather that every
rank made the same call (operation, dtype, element count, root), and waits raise errors
that name the peer. Sums and averages of floating tensors go through
:func:`gossamer.ops.collectives.reduce_into`, which accumulates half types in float32.
"""

from __future__ import annotations

from enum import IntEnum

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.errors import PeerError
from gossamer.ops.collectives import reduce_into
from gossamer.profiling import count_collective, count_sent
from gossamer.transport import DTYPES, check_rank, check_tensor, group_rank, group_size

__all__ = [
    "ReduceOp",
    "allreduce",
    "alltoall_v",
    "gather",
    "recv",
    "reduce",
    "reduce_scatter",
    "scatter",
    "check_recv",
    "reduce_op",
    "send",
    "split_count",
    "write_into",
]


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


_TORCH_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.PRODUCT: dist.ReduceOp.PRODUCT,
    ReduceOp.MIN: dist.ReduceOp.MIN,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.BOR: dist.ReduceOp.BOR,
    ReduceOp.BAND: dist.ReduceOp.BAND,
    ReduceOp.BXOR: dist.ReduceOp.BXOR,
}
_BITWISE = (ReduceOp.BOR, ReduceOp.BAND, ReduceOp.BXOR)
_CALLS = ("allreduce", "reduce", "reduce_scatter", "gather", "scatter")
_MAGIC = 0xBA6A


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


def _check_op_dtype(op: ReduceOp, tensor: torch.Tensor, name: str) -> None:
    if op == ReduceOp.AVG and not tensor.is_floating_point():
        raise TypeError(f"{name}: ReduceOp.AVG needs a floating-point tensor; got {tensor.dtype}")
    if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{name}: ReduceOp.{op.name} needs an integer tensor; got {tensor.dtype}")


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _check_same(name: str, tensor: torch.Tensor, group, aux: int = 0, count: int = -1) -> None:
    """Every rank made the same call: one allgather of (operation, dtype, count, aux)."""
    count = tensor.numel() if count < 0 else count
    code = [_MAGIC, _CALLS.index(name), DTYPES.index(tensor.dtype), count, aux]
    mine = torch.tensor(code, dtype=torch.int64)
    rows = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    transport.wait_works(name, [(-1, dist.all_gather(rows, mine, group=group, async_op=True))])
    count_collective(name, "all_gather", mine.nbytes, len(rows))
    calls = [r.tolist() for r in rows]
    wrong = [r for r, c in enumerate(calls) if c != calls[0]]
    if wrong:

        def text(c: list[int]) -> str:
            dtype = str(DTYPES[c[2]]).removeprefix("torch.")
            return f"{_CALLS[c[1]]} of {c[3]} {dtype} elements (root/op {c[4]})"

        others = "; ".join(f"rank {r} called {text(calls[r])}" for r in wrong)
        raise PeerError(f"{name}: mismatched call: rank 0 called {text(calls[0])}, but {others}")


def _reduce_into(out: torch.Tensor, op: ReduceOp, group, name: str) -> None:
    if op in (ReduceOp.SUM, ReduceOp.AVG) and out.is_floating_point():
        reduce_into(out, op == ReduceOp.AVG, group)
        return
    work = dist.all_reduce(out, op=_TORCH_OPS[op], group=group, async_op=True)
    transport.wait_works(name, [(-1, work)])
    count_collective(name, "all_reduce", out.nbytes, dist.get_world_size(group))


def allreduce(tensor: torch.Tensor, op: ReduceOp, group=None) -> torch.Tensor:
    """``op`` over every rank's ``tensor``, elementwise; out of place, every rank gets it."""
    op = reduce_op(op)
    check_tensor(tensor, DTYPES, "allreduce")
    _check_op_dtype(op, tensor, "allreduce")
    group_rank(group)

    def body() -> torch.Tensor:
        _check_same("allreduce", tensor, group, aux=int(op))
        out = tensor.contiguous().clone()
        _reduce_into(out, op, group, "allreduce")
        return out

    return transport.run("allreduce", body, False)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp, group=None) -> torch.Tensor:
    """``op`` over every rank's ``tensor``; the result is meaningful on ``dst`` only."""
    op = reduce_op(op)
    check_tensor(tensor, DTYPES, "reduce")
    _check_op_dtype(op, tensor, "reduce")
    check_rank(dst, "dst", group_size(group))

    def body() -> torch.Tensor:
        _check_same("reduce", tensor, group, aux=dst * 16 + int(op))
        out = tensor.contiguous().clone()
        wide = out.float() if out.dtype in (torch.float16, torch.bfloat16) else out
        torch_op = dist.ReduceOp.SUM if op == ReduceOp.AVG else _TORCH_OPS[op]
        work = dist.reduce(wide, _global(group, dst), op=torch_op, group=group, async_op=True)
        transport.wait_works("reduce", [(_global(group, dst), work)])
        count_collective("reduce", "reduce", wide.nbytes, dist.get_world_size(group))
        if op == ReduceOp.AVG:
            wide.div_(dist.get_world_size(group))
        return wide.to(out.dtype)

    return transport.run("reduce", body, False)


def split_count(tensor: torch.Tensor, size: int, name: str, what: str) -> int:
    """``tensor.numel() // size``; ValueError (naming ``what``) if it does not divide."""
    if tensor.numel() % size:
        raise ValueError(
            f"{name}: {what} must have a multiple of the group size ({size}) elements; "
            f"got {tensor.numel()}"
        )
    return tensor.numel() // size


def alltoall_v(
    tensor: torch.Tensor,
    send_counts: list[int],
    send_displs: list[int],
    recv_counts: list[int],
    group=None,
) -> torch.Tensor:
    """Rank ``j`` gets ``tensor[send_displs[j] : send_displs[j] + send_counts[j]]``.

    Returns what arrived, concatenated in rank order (``sum(recv_counts)`` elements).

    Raises:
        PeerError: on every rank, when a rank's send counts disagree with the receive
            counts its peers expect.
    """
    check_tensor(tensor, DTYPES, "alltoall_v")
    size = group_size(group)
    for name, value in (
        ("send_counts", send_counts),
        ("send_displs", send_displs),
        ("recv_counts", recv_counts),
    ):
        if len(value) != size or any(
            isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in value
        ):
            raise ValueError(f"alltoall_v: {name} must be {size} ints >= 0; got {value!r}")
    flat = tensor.contiguous().reshape(-1)
    if any(d + c > flat.numel() for d, c in zip(send_displs, send_counts, strict=True)):
        raise ValueError(
            f"alltoall_v: send_displs + send_counts exceed the {flat.numel()} elements "
            "of send_tensor"
        )

    def body() -> torch.Tensor:
        mine = torch.tensor([*send_counts, *recv_counts], dtype=torch.int64)
        rows = [torch.empty_like(mine) for _ in range(size)]
        work = dist.all_gather(rows, mine, group=group, async_op=True)
        transport.wait_works("alltoall_v", [(-1, work)])
        count_collective("alltoall_v", "all_gather", mine.nbytes, size)
        sends = torch.stack([r[:size] for r in rows])
        recvs = torch.stack([r[size:] for r in rows])
        bad = (sends != recvs.T).nonzero().tolist()
        if bad:
            pairs = ", ".join(
                f"{i}->{j}: {sends[i, j]} sent, {recvs[j, i]} expected" for i, j in bad[:6]
            )
            raise PeerError(f"alltoall_v: send and receive counts do not match ({pairs})")
        parts = [flat[d : d + c] for d, c in zip(send_displs, send_counts, strict=True)]
        out = torch.empty(sum(recv_counts), dtype=flat.dtype, device=flat.device)
        work = dist.all_to_all_single(
            out, torch.cat(parts), list(recv_counts), list(send_counts), group=group, async_op=True
        )
        transport.wait_works("alltoall_v", [(-1, work)])
        me = group_rank(group)
        others = sum(c for j, c in enumerate(send_counts) if j != me)
        count_sent("alltoall_v", others * flat.element_size())
        return out

    return transport.run("alltoall_v", body, False)


def reduce_scatter(tensor: torch.Tensor, op: ReduceOp, group=None) -> torch.Tensor:
    """Reduce the flat ``tensor`` over every rank; rank ``i`` keeps chunk ``i`` of the result."""
    op = reduce_op(op)
    check_tensor(tensor, DTYPES, "reduce_scatter")
    _check_op_dtype(op, tensor, "reduce_scatter")
    count = split_count(tensor, group_size(group), "reduce_scatter", "send_tensor")

    def body() -> torch.Tensor:
        _check_same("reduce_scatter", tensor, group, aux=int(op))
        flat = tensor.contiguous().reshape(-1)
        wide = flat.float() if flat.dtype in (torch.float16, torch.bfloat16) else flat
        out = torch.empty(count, dtype=wide.dtype, device=wide.device)
        torch_op = dist.ReduceOp.SUM if op == ReduceOp.AVG else _TORCH_OPS[op]
        work = dist.reduce_scatter_tensor(out, wide, op=torch_op, group=group, async_op=True)
        transport.wait_works("reduce_scatter", [(-1, work)])
        count_collective("reduce_scatter", "reduce_scatter", wide.nbytes, group_size(group))
        if op == ReduceOp.AVG:
            out.div_(dist.get_world_size(group))
        return out.to(flat.dtype)

    return transport.run("reduce_scatter", body, False)


def gather(tensor: torch.Tensor, dst: int, group=None) -> torch.Tensor | None:
    """Rank ``dst`` gets every rank's flat ``tensor`` concatenated in rank order; others None."""
    check_tensor(tensor, DTYPES, "gather")
    size = group_size(group)
    check_rank(dst, "dst", size)
    me = group_rank(group)

    def body() -> torch.Tensor | None:
        _check_same("gather", tensor, group, aux=dst)
        flat = tensor.contiguous().reshape(-1)
        parts = [torch.empty_like(flat) for _ in range(size)] if me == dst else None
        where = _global(group, dst)
        work = dist.gather(flat, parts, dst=where, group=group, async_op=True)
        transport.wait_works("gather", [(where, work)])
        count_collective("gather", "gather", flat.nbytes, size, me, dst)
        return torch.cat(parts) if parts is not None else None

    return transport.run("gather", body, False)


def scatter(tensor: torch.Tensor, count: int, src: int, group=None) -> torch.Tensor:
    """Rank ``i`` gets elements ``i*count .. (i+1)*count`` of rank ``src``'s flat ``tensor``.

    On other ranks ``tensor`` only gives the dtype and device.
    """
    check_tensor(tensor, DTYPES, "scatter")
    size = group_size(group)
    check_rank(src, "src", size)
    me = group_rank(group)
    if me == src and tensor.numel() != size * count:
        raise ValueError(
            f"scatter: the source tensor must have group size x count = {size * count} "
            f"elements; got {tensor.numel()}"
        )

    def body() -> torch.Tensor:
        _check_same("scatter", tensor, group, aux=src, count=count)
        out = torch.empty(count, dtype=tensor.dtype, device=tensor.device)
        parts = list(tensor.contiguous().reshape(-1).split(count)) if me == src else None
        where = _global(group, src)
        work = dist.scatter(out, parts, src=where, group=group, async_op=True)
        transport.wait_works("scatter", [(where, work)])
        count_collective("scatter", "scatter", size * out.nbytes, size, me, src)
        return out

    return transport.run("scatter", body, False)


def send(tensor: torch.Tensor, dst: int, group=None) -> None:
    """Send ``tensor`` to rank ``dst``, which must call :func:`recv` with a same-sized tensor."""
    check_tensor(tensor, DTYPES, "send")
    check_rank(dst, "dst", group_size(group))
    if dst == group_rank(group):
        raise ValueError(f"send: dst must be another rank; got this rank ({dst})")

    def body() -> None:
        where = _global(group, dst)
        work = dist.isend(tensor.contiguous(), where, group=group)
        transport.wait_works("send", [(where, work)])
        count_sent("send", tensor.nbytes)

    transport.run("send", body, False)


def recv(tensor: torch.Tensor, src: int, group=None) -> None:
    """Receive into ``tensor`` (in place) what rank ``src`` sends with :func:`send`."""
    check_tensor(tensor, DTYPES, "recv")
    check_rank(src, "src", group_size(group))
    if src == group_rank(group):
        raise ValueError(f"recv: src must be another rank; got this rank ({src})")

    def body() -> None:
        where = _global(group, src)
        buffer = tensor if tensor.is_contiguous() else torch.empty_like(tensor).contiguous()
        work = dist.irecv(buffer, where, group=group)
        transport.wait_works("recv", [(where, work)])
        if buffer is not tensor:
            tensor.copy_(buffer)

    transport.run("recv", body, False)
