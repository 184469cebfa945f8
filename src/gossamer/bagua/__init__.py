"""Bagua compatibility: ``import gossamer.bagua as bagua`` runs a ``bagua.torch_api`` program.

The names, arguments and defaults are Bagua's; each is built on gossamer's layers: the
collectives on :mod:`gossamer.ops` and gossamer's transport, the algorithms' rounds on
communicators (:mod:`gossamer.bagua.communicators`, subclasses of
:class:`gossamer.communicators.Communicator`), buckets on :mod:`gossamer.fusion`,
compression on :mod:`gossamer.compression`, machines on gossamer's rank layout. Importing
the package adds ``with_bagua`` (and the ``bagua_*`` properties) to ``torch.nn.Module`` and
the ``ensure_bagua_tensor`` family to ``torch.Tensor`` and ``bagua_patch`` (with
``bagua_pg`` and ``bagua_get_*_communicator``) to ``torch.distributed.ProcessGroup``, as
Bagua does. Differences from
Bagua are listed in ``docs/bagua-migration.md``: CPU tensors work (gloo), ``shift_one``
takes any number of ranks, there is no autotune service.

Example:
    >>> import torch
    >>> import gossamer.bagua as bagua
    >>> from gossamer.bagua.algorithms import gradient_allreduce
    >>> bagua.init_process_group()
    >>> model = torch.nn.Linear(4, 1)
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> model = model.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    >>> model(torch.ones(2, 4)).sum().backward()  # gradients averaged over the ranks here
    >>> opt.step()
"""

from __future__ import annotations

from gossamer.bagua import _groups, algorithms, communication, communicators, data_parallel, env
from gossamer.bagua import distributed as _distributed
from gossamer.bagua import tensor as _tensor
from gossamer.bagua.communication import (
    BaguaProcessGroup,
    ReduceOp,
    allgather,
    allgather_inplace,
    allreduce,
    allreduce_inplace,
    alltoall,
    alltoall_inplace,
    alltoall_v,
    alltoall_v_inplace,
    barrier,
    broadcast,
    broadcast_object,
    from_torch_group,
    gather,
    gather_inplace,
    get_backend,
    init_process_group,
    is_initialized,
    new_group,
    recv,
    reduce,
    reduce_inplace,
    reduce_scatter,
    reduce_scatter_inplace,
    scatter,
    scatter_inplace,
    send,
)
from gossamer.bagua.distributed import BaguaModule
from gossamer.bagua.env import get_local_rank, get_local_size, get_rank, get_world_size
from gossamer.bagua.tensor import BaguaTensor

__all__ = [
    "BaguaModule",
    "BaguaProcessGroup",
    "BaguaTensor",
    "ReduceOp",
    "algorithms",
    "allgather",
    "allgather_inplace",
    "allreduce",
    "allreduce_inplace",
    "alltoall",
    "alltoall_inplace",
    "alltoall_v",
    "alltoall_v_inplace",
    "barrier",
    "broadcast",
    "broadcast_object",
    "communication",
    "communicators",
    "data_parallel",
    "env",
    "from_torch_group",
    "gather",
    "gather_inplace",
    "get_backend",
    "get_local_rank",
    "get_local_size",
    "get_rank",
    "get_world_size",
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

# As in Bagua, importing the package patches torch.nn.Module, torch.Tensor and ProcessGroup.
_distributed.install()
_tensor.install()
_groups.install()
