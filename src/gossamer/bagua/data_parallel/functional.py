r"""Bagua's differentiable collectives (``bagua.torch_api.data_parallel.functional``).

:func:`all_reduce` returns :math:`y = \operatorname{op}_r x_r` and, as in Bagua, its
backward pass all-reduces the incoming gradient with the same ``op``: for ``SUM``,
:math:`\partial L / \partial x_r = \sum_s \partial L_s / \partial y`.

Example:
    >>> import torch
    >>> import gossamer.bagua as bagua
    >>> from gossamer.bagua.data_parallel import functional
    >>> bagua.init_process_group()
    >>> x = torch.ones(2, requires_grad=True)
    >>> functional.all_reduce(x).sum().backward()  # world of one
    >>> x.grad
    tensor([1., 1.])
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Function

from gossamer.bagua._collectives import ReduceOp
from gossamer.bagua._groups import resolve
from gossamer.bagua.communication import allreduce_inplace

__all__ = ["ReduceOp", "all_reduce", "torch_reduce_op_to_bagua"]


def torch_reduce_op_to_bagua(op: Any) -> ReduceOp:
    """Bagua's op for ``torch.distributed.ReduceOp.SUM`` or ``MAX`` (the two Bagua maps).

    Raises:
        ValueError: any other op.
    """
    if op == dist.ReduceOp.SUM:
        return ReduceOp.SUM
    if op == dist.ReduceOp.MAX:
        return ReduceOp.MAX
    raise ValueError(f"op must be torch.distributed.ReduceOp.SUM or MAX; got {op!r}")


def all_reduce(
    tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None
) -> torch.Tensor:
    """The all-reduce of ``tensor`` over the torch process ``group`` (None: all ranks).

    ``tensor`` is not changed; a rank outside ``group`` gets a copy of its own tensor.

    Raises:
        ValueError: an ``op`` other than ``SUM`` or ``MAX``.
        TypeError: a ``group`` that is not a process group.
    """
    return _AllReduce.apply(torch_reduce_op_to_bagua(op), resolve(group, "group"), tensor)


class _AllReduce(Function):
    @staticmethod
    def forward(ctx: Any, op: ReduceOp, comm: Any, tensor: torch.Tensor) -> torch.Tensor:
        ctx.op, ctx.comm = op, comm
        result = tensor.clone()
        if comm is not None:  # None: this rank is not in the group
            allreduce_inplace(result, op, comm=comm)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, torch.Tensor]:
        return None, None, _AllReduce.apply(ctx.op, ctx.comm, grad)
