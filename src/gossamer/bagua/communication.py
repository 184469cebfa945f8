"""Bagua's communication API (``bagua.torch_api.communication``) on gossamer.

The primitives keep Bagua's names, argument order and defaults: out-of-place ones write
``recv_tensor``, ``*_inplace`` ones overwrite their argument, and ``comm`` is a
communicator from ``group.get_global_communicator()`` (None: the default group). Unlike
Bagua they also take CPU tensors (gloo) besides CUDA ones (NCCL), and they check that every
rank made the same call (a rank that rejects its arguments makes its peers raise at once):
every primitive is one :mod:`gossamer.ops` operation (Bagua's ``ReduceOp`` translated to
its ``op`` names), all on gossamer's communication thread.

Example:
    >>> import torch
    >>> import gossamer.bagua as bagua
    >>> bagua.init_process_group()
    >>> recv = torch.zeros(2)
    >>> bagua.allreduce(torch.ones(2), recv)  # world of one
    >>> recv
    tensor([1., 1.])
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gossamer import context, ops
from gossamer.bagua._collectives import (
    ReduceOp,
    check_rank,
    check_recv,
    numel_of,
    op_name,
    rejecting,
    write_into,
)
from gossamer.bagua._exchanges import (
    allgather,
    allgather_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    gather,
    gather_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
)
from gossamer.bagua._groups import (
    BaguaCommunicator,
    BaguaProcessGroup,
    CommMember,
    comm,
    default_group,
    from_torch_group,
    get_communicator,
    new_group,
    resolve,
)

__all__ = [
    "BaguaCommunicator",
    "BaguaProcessGroup",
    "CommMember",
    "ReduceOp",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_coalesced_inplace",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "broadcast_coalesced",
    "broadcast_object",
    "comm",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_backend",
    "get_communicator",
    "init_process_group",
    "is_initialized",
    "new_group",
    "recv",
    "reduce",
    "reduce_inplace",
    "reduce_scatter",
    "reduce_scatter_inplace",
    "scatter",
    "scatter_inplace",
    "send",
]


def init_process_group(
    store: dist.Store | None = None,
    rank: int = -1,
    world_size: int = -1,
    local_world_size: int = -1,
) -> None:
    """Join the job (Bagua's first call): start ``torch.distributed`` and gossamer.

    Reads what ``gossamer run`` (torchrun) sets; started with plain ``python`` the program
    is a world of one. CUDA tensors travel over NCCL when CUDA is available, CPU tensors
    over gloo. Calling it again, or after :func:`gossamer.init`, does nothing (Bagua raises).

    Args:
        store (torch.distributed.Store, optional): a key-value store to meet through instead
            of the launcher's variables; then ``rank`` and ``world_size`` are required.
        rank (int): this process's rank, with ``store``.
        world_size (int): number of processes, with ``store``.
        local_world_size (int): processes per machine, with ``store`` (machines are found
            by host name, or ``GOSSAMER_NODES_PER_MACHINE``; the value is only checked).

    Raises:
        ValueError: ``store`` without a valid ``rank``, ``world_size`` or ``local_world_size``.
    """
    if context.is_initialized():
        return
    cuda = torch.cuda.is_available()
    if store is not None:
        if not (isinstance(world_size, int) and world_size > 0):
            raise ValueError(f"world_size must be a positive int with store; got {world_size!r}")
        if not (isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank must be in [0, {world_size}) with store; got {rank!r}")
        if not (isinstance(local_world_size, int) and local_world_size > 0):
            raise ValueError(
                f"local_world_size must be a positive int with store; got {local_world_size!r}"
            )
        if not dist.is_initialized():
            dist.init_process_group(
                "cpu:gloo,cuda:nccl" if cuda else "gloo",
                store=store,
                rank=rank,
                world_size=world_size,
                timeout=timedelta(minutes=30),
            )
    # Bagua always runs NCCL; here NCCL where CUDA is, gloo elsewhere.
    context.init(backend="auto" if cuda else None)


def is_initialized() -> bool:
    """True once :func:`init_process_group` (or :func:`gossamer.init`) has run."""
    return context.is_initialized()


def _comm(comm_: object) -> BaguaCommunicator | None:
    return resolve(comm_)


def _get_default_group() -> BaguaProcessGroup:
    """The default group (all ranks), as Bagua's private helper of the same name.

    Raises:
        RuntimeError: before :func:`init_process_group`.
    """
    if not is_initialized():
        raise RuntimeError(
            "Default process group has not been initialized, "
            "please make sure to call init_process_group."
        )
    return default_group()


def _rank_not_in_comm(comm: object = None) -> bool:
    """True when ``comm`` is ``CommMember.NON_COMM_MEMBER`` (None: the default group)."""
    return comm is CommMember.NON_COMM_MEMBER


def _rank_not_in_group(group: BaguaProcessGroup | None = None) -> bool:
    """True when this rank is not a member of ``group`` (None: the default group)."""
    return group is not None and _rank_not_in_comm(group.get_global_communicator())


def send(tensor: torch.Tensor, dst: int, comm: BaguaCommunicator | None = None) -> None:
    """Send ``tensor`` to rank ``dst`` of the communicator (blocking)."""
    c = _comm(comm)
    if c is not None:
        ops.send(tensor, dst=dst, group=c.group)


def recv(tensor: torch.Tensor, src: int, comm: BaguaCommunicator | None = None) -> None:
    """Receive into ``tensor`` what rank ``src`` of the communicator sends (blocking)."""
    c = _comm(comm)
    if c is not None:
        write_into(tensor, ops.recv(tensor, src=src, group=c.group), "recv")


def broadcast(tensor: torch.Tensor, src: int = 0, comm: BaguaCommunicator | None = None) -> None:
    """Overwrite ``tensor`` on every rank with rank ``src``'s (in place)."""
    c = _comm(comm)
    if c is not None:
        with rejecting("broadcast", c.group):
            check_rank(src, "src", "broadcast", c.nranks())
        ops.broadcast_(tensor, root=src, group=c.group)


def broadcast_coalesced(
    tensors: Sequence[torch.Tensor], src: int = 0, comm: BaguaCommunicator | None = None
) -> None:
    """:func:`broadcast` of several tensors, flattened into one message per dtype."""
    c = _comm(comm)
    if c is None:
        return
    from gossamer.fusion import bucketize

    for bucket in bucketize(list(tensors), 2**62):
        flat = ops.broadcast_(bucket.pack(), root=src, group=c.group)
        bucket.unpack(flat, lambda t: t)


def broadcast_object(obj: object, src: int = 0, comm: BaguaCommunicator | None = None) -> object:
    """Rank ``src``'s ``obj`` (pickled) on every rank."""
    c = _comm(comm)
    if c is None:
        return obj
    with rejecting("broadcast", c.group):
        check_rank(src, "src", "broadcast_object", c.nranks())
    device = context.device()
    if c.rank() == src:
        payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(device)
        size = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    ops.broadcast_(size, root=src, group=c.group)
    if c.rank() != src:
        payload = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    ops.broadcast_(payload, root=src, group=c.group)
    return obj if c.rank() == src else pickle.load(io.BytesIO(payload.cpu().numpy().tobytes()))


def reduce(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    comm: BaguaCommunicator | None = None,
) -> None:
    """Reduce ``send_tensor`` over the ranks with ``op`` into ``recv_tensor`` on rank ``dst``."""
    c = _comm(comm)
    if c is not None:
        with rejecting("reduce", c.group):
            check_rank(dst, "dst", "reduce", c.nranks())
            if c.rank() == dst:
                check_recv(recv_tensor, numel_of(send_tensor, "send_tensor", "reduce"), "reduce")
            name = op_name(op)
        result = ops.reduce(send_tensor, root=dst, op=name, group=c.group)
        if result is not None:
            write_into(recv_tensor, result, "reduce")


def reduce_inplace(
    tensor: torch.Tensor,
    dst: int,
    op: ReduceOp = ReduceOp.SUM,
    comm: BaguaCommunicator | None = None,
) -> None:
    """In-place :func:`reduce`: ``tensor`` on rank ``dst`` holds the result."""
    reduce(tensor, tensor, dst, op, comm)


def allreduce(
    send_tensor: torch.Tensor,
    recv_tensor: torch.Tensor,
    op: ReduceOp = ReduceOp.SUM,
    comm: BaguaCommunicator | None = None,
) -> None:
    r"""Reduce ``send_tensor`` over the ranks with ``op`` into every rank's ``recv_tensor``.

    With ``ReduceOp.SUM`` :math:`y = \sum_r x_r`, with ``ReduceOp.AVG`` :math:`y = \frac1n
    \sum_r x_r` (floating tensors only); ``PRODUCT``, ``MIN``, ``MAX`` and, for integer
    tensors, ``BAND``, ``BOR``, ``BXOR`` work elementwise.

    Example:
        >>> send = torch.arange(2) + 1 + 2 * bagua.get_rank()  # doctest: +SKIP
        >>> recv = torch.zeros(2, dtype=torch.int64)
        >>> bagua.allreduce(send, recv)
        >>> recv
        tensor([4, 6])  # ranks 0 and 1 of 2
    """
    c = _comm(comm)
    if c is None:
        return
    with rejecting("allreduce", c.group):
        check_recv(recv_tensor, numel_of(send_tensor, "send_tensor", "allreduce"), "allreduce")
        name = op_name(op)
    result = ops.allreduce(send_tensor, op=name, group=c.group)
    write_into(recv_tensor, result, "allreduce")


def allreduce_inplace(
    tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, comm: BaguaCommunicator | None = None
) -> None:
    """In-place :func:`allreduce`."""
    allreduce(tensor, tensor, op, comm)


def allreduce_coalesced_inplace(
    tensors: Sequence[torch.Tensor],
    op: ReduceOp = ReduceOp.SUM,
    comm: BaguaCommunicator | None = None,
) -> None:
    """In-place :func:`allreduce` of several tensors, flattened into one message per dtype."""
    from gossamer.fusion import bucketize

    for bucket in bucketize(list(tensors), 2**62):
        flat = bucket.pack()
        allreduce(flat, flat, op, comm)
        bucket.unpack(flat, lambda t: t)


def get_backend(model_name: str) -> object:
    """The communication backend of the model named ``model_name`` (after ``with_bagua``).

    Raises:
        KeyError: no wrapped model has that name.
    """
    from gossamer.bagua._state import state

    model = state().models.get(model_name)
    if model is None:
        raise KeyError(f"no model named {model_name!r} was wrapped with with_bagua()")
    return model._bagua_backend


def barrier(comm: BaguaCommunicator | None = None) -> None:
    """Block until every rank of the communicator has called ``barrier``."""
    c = _comm(comm)
    if c is not None:
        ops.barrier(group=c.group)
