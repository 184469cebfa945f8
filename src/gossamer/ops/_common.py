"""What the collectives share: rejected calls, reduction operations and their dtypes."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.profiling import count_collective, timeline
from gossamer.transport import AVERAGING_DTYPES

__all__ = [
    "REDUCE_OPS",
    "SUM_DTYPES",
    "check_reduce_op",
    "explain_reduce",
    "explain_root",
    "narrow_into",
    "reduce_code",
    "reduce_in_place",
    "reject",
    "torch_op",
    "widen",
]

# The reductions, in header order ("sum" and "average" are 0 and 1: allreduce's
# ``int(average)`` on the wire).
REDUCE_OPS = ("sum", "average", "product", "min", "max", "band", "bor", "bxor")
_TORCH_OPS = {
    "sum": dist.ReduceOp.SUM,
    "average": dist.ReduceOp.SUM,  # divided afterwards: gloo has no AVG
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
    "band": dist.ReduceOp.BAND,
    "bor": dist.ReduceOp.BOR,
    "bxor": dist.ReduceOp.BXOR,
}
_BITWISE = ("band", "bor", "bxor")
SUM_DTYPES = (
    *AVERAGING_DTYPES,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
# Where a backend lacks a kernel or a sum loses bits, reduce in a wider dtype: half types in
# float32 (fp16 sums of many ranks overflow), int16 in int32 (gloo and NCCL have no int16;
# int32 holds the sum of 65536 int16 values, and casting back wraps as int16 arithmetic
# does), bool in int32 (any True gives True, as torch's bool addition does; min is "and").
_WIDE = {
    torch.float16: torch.float32,
    torch.bfloat16: torch.float32,
    torch.int16: torch.int32,
    torch.bool: torch.int32,
}


def reject(op: str, error: Exception, group: dist.ProcessGroup | None) -> None:
    """Queue this rank's part of a collective it rejected: its peers raise at once."""

    def take_part(reason: str) -> None:
        transport.check_same_call(op, None, group, rejection=reason)

    transport.reject(op, error, group, take_part)


def check_reduce_op(op: object, tensor: torch.Tensor, name: str) -> str:
    """``op`` if it is a reduction that ``tensor``'s dtype has; TypeError/ValueError if not."""
    if op not in REDUCE_OPS:
        raise ValueError(f"{name}: op must be one of {', '.join(REDUCE_OPS)}; got {op!r}")
    if op == "average" and tensor.dtype not in AVERAGING_DTYPES:
        raise TypeError(f"{name}: op 'average' needs a floating tensor; got {tensor.dtype}")
    if op in _BITWISE and (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"{name}: op {op!r} needs an integer or bool tensor; got {tensor.dtype}")
    if op in ("min", "max", "product") and tensor.is_complex():
        # min/max: no order; product: gloo does not multiply complex numbers
        raise TypeError(f"{name}: op {op!r} is not supported for complex {tensor.dtype}")
    return op  # type: ignore[return-value]


def reduce_code(op: str) -> int:
    """The reduction's number on the wire."""
    return REDUCE_OPS.index(op)


@transport.explains_aux("allreduce", "reduce_scatter")
def explain_reduce(code: int) -> str:
    """What :func:`reduce_code` wrote, for an error: ``"op sum"``."""
    return f"op {REDUCE_OPS[code]}" if 0 <= code < len(REDUCE_OPS) else f"op #{code}"


@transport.explains_aux("broadcast", "gather", "scatter")
def explain_root(root: int) -> str:
    """A rooted call's aux, for an error."""
    return f"root {root}"


def widen(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in the dtype its reduction runs in (itself when that is its own)."""
    wide = _WIDE.get(tensor.dtype)
    return tensor if wide is None else tensor.to(wide)


def narrow_into(out: torch.Tensor, wide: torch.Tensor) -> None:
    """Write the reduced ``wide`` back into ``out`` (no-op when they are one tensor)."""
    if wide is not out:
        out.copy_(wide if out.dtype != torch.bool else wide != 0)


def torch_op(op: str) -> dist.ReduceOp:
    """The ``torch.distributed`` reduction that computes ``op`` (average: a sum)."""
    return _TORCH_OPS[op]


def reduce_in_place(out: torch.Tensor, op: str, group: dist.ProcessGroup | None) -> None:
    """Reduce ``out`` over ``group`` in place with ``op``; runs on the communication thread.

    Communicators call it directly, outside the public operations' staging boundary, so a
    device tensor that would reach gloo is reduced in a host copy here (transport.staging).
    """
    if transport.needs_staging(out, group):
        host = transport.to_host(out)
        reduce_in_place(host, op, group)
        out.copy_(host)
        return
    wide = widen(out)
    with timeline.record(None, "communicating"):
        work = dist.all_reduce(wide, op=torch_op(op), group=group, async_op=True)
        transport.wait_works("allreduce", [(-1, work)])
    count_collective("allreduce", "all_reduce", wide.nbytes, dist.get_world_size(group))
    if op == "average":
        wide.div_(dist.get_world_size(group))
    narrow_into(out, wide)


def exchange_blocks(
    source: torch.Tensor, kind: str, group: dist.ProcessGroup | None
) -> torch.Tensor:
    """``kind="alltoall"`` or ``"allgather"`` of equal byte blocks, with no call header.

    Runs on the communication thread, for communicators whose call was checked already (its
    sizes follow from it), as :func:`reduce_in_place`: a header round per collective is a
    round trip on slow links. An ``alltoall`` returns the ``size`` blocks the ranks sent
    this one, an ``allgather`` every rank's ``source``, both concatenated in rank order.
    Device tensors go through the host where gloo needs it.
    """
    if transport.needs_staging(source, group):
        return exchange_blocks(transport.to_host(source), kind, group).to(source.device)
    size = dist.get_world_size(group)
    with timeline.record(None, "communicating"):
        if kind == "alltoall":
            out = torch.empty_like(source)
            work = dist.all_to_all_single(out, source, group=group, async_op=True)
        else:
            out = torch.empty(size * source.numel(), dtype=source.dtype, device=source.device)
            work = dist.all_gather(list(out.chunk(size)), source, group=group, async_op=True)
        transport.wait_works(kind, [(-1, work)])
    count_collective(kind, _TORCH_NAMES[kind], source.nbytes, size)
    return out


_TORCH_NAMES = {"alltoall": "all_to_all", "allgather": "all_gather"}
