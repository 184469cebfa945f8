"""BlueFog's collectives in every spelling: blocking, ``_nonblocking`` (int handles), in place.

Each name maps onto one gossamer operation (``async_op=True`` for the nonblocking ones).
gossamer matches operations across ranks by call order; ``name`` only names the operation's
row on the timeline, as BlueFog's tensor name (:func:`gossamer.bluefog.timeline.recorded`).
A nonblocking call (here or in :mod:`gossamer.bluefog.neighbor`) returns an ``int``;
:func:`poll`, :func:`synchronize` and :func:`wait` take it.
"""

from __future__ import annotations

from typing import Any

import torch

import gossamer
from gossamer.bluefog._compat import need_float
from gossamer.bluefog._handles import lookup, register, take
from gossamer.bluefog.timeline import recorded

__all__ = [
    "allgather",
    "allgather_nonblocking",
    "allreduce",
    "allreduce_",
    "allreduce_nonblocking",
    "allreduce_nonblocking_",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_nonblocking",
    "broadcast_nonblocking_",
    "poll",
    "synchronize",
    "wait",
]


def poll(handle: int) -> bool:
    """True once the nonblocking operation ``handle`` has finished; never blocks.

    Raises:
        ValueError: ``handle`` is unknown (or already synchronized).
    """
    core = lookup(handle)
    if core is None:
        raise ValueError(f"Cannot find handle {handle!r} to poll")
    return core.is_completed()


def synchronize(handle: int) -> torch.Tensor:
    """Wait for the nonblocking operation ``handle`` and return its output tensor.

    Raises:
        ValueError: ``handle`` is unknown (or already synchronized).
        gossamer.errors.GossamerError: what the operation raised.
    """
    result = take(handle)
    if result is None:
        raise ValueError("Cannot find handle to synchronize")
    return result()


def wait(handle: int) -> torch.Tensor:
    """Same as :func:`synchronize`."""
    return synchronize(handle)


def barrier() -> None:
    """Block until every rank has called ``barrier`` (:func:`gossamer.barrier`)."""
    gossamer.barrier()


# ---------------------------------------------------------------------- allreduce
def _allreduce(
    tensor: torch.Tensor, average: bool, is_hierarchical_local: bool, inplace: bool, async_op: bool
) -> Any:
    if average:
        need_float(tensor, "allreduce with average=True")
    if is_hierarchical_local:
        fn = gossamer.local_allreduce_ if inplace else gossamer.local_allreduce
    else:
        fn = gossamer.allreduce_ if inplace else gossamer.allreduce
    return fn(tensor, average=average, async_op=async_op)


@recorded("allreduce", "ENQUEUE_ALLREDUCE")
def allreduce(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """Sum or average over all ranks, out of place (:func:`gossamer.allreduce`).

    ``is_hierarchical_local=True`` reduces over this machine's ranks only
    (:func:`gossamer.local_allreduce`), dividing by ``local_size()`` for the average.
    """
    return _allreduce(tensor, average, is_hierarchical_local, False, False)


@recorded("allreduce", "ENQUEUE_ALLREDUCE", lookup)
def allreduce_nonblocking(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`allreduce`; returns a handle for :func:`synchronize`."""
    return register(_allreduce(tensor, average, is_hierarchical_local, False, True))


@recorded("allreduce", "ENQUEUE_ALLREDUCE")
def allreduce_(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """In-place :func:`allreduce`: writes into ``tensor`` and returns it."""
    return _allreduce(tensor, average, is_hierarchical_local, True, False)


@recorded("allreduce", "ENQUEUE_ALLREDUCE", lookup)
def allreduce_nonblocking_(
    tensor: torch.Tensor,
    average: bool = True,
    is_hierarchical_local: bool = False,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`allreduce_`; :func:`synchronize` returns ``tensor`` itself."""
    return register(_allreduce(tensor, average, is_hierarchical_local, True, True))


# ---------------------------------------------------------------------- broadcast, allgather
@recorded("broadcast", "ENQUEUE_BROADCAST")
def broadcast(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """Rank ``root_rank``'s tensor on every rank, out of place (:func:`gossamer.broadcast`)."""
    return gossamer.broadcast(tensor, root=root_rank)


@recorded("broadcast", "ENQUEUE_BROADCAST", lookup)
def broadcast_nonblocking(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Nonblocking :func:`broadcast`."""
    return register(gossamer.broadcast(tensor, root=root_rank, async_op=True))


@recorded("broadcast", "ENQUEUE_BROADCAST")
def broadcast_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> torch.Tensor:
    """In-place :func:`broadcast`: overwrites ``tensor`` and returns it."""
    return gossamer.broadcast_(tensor, root=root_rank)


@recorded("broadcast", "ENQUEUE_BROADCAST", lookup)
def broadcast_nonblocking_(tensor: torch.Tensor, root_rank: int, name: str | None = None) -> int:
    """Nonblocking :func:`broadcast_`."""
    return register(gossamer.broadcast_(tensor, root=root_rank, async_op=True))


@recorded("allgather", "ENQUEUE_ALLGATHER")
def allgather(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 in rank order (:func:`gossamer.allgather`)."""
    return gossamer.allgather(tensor)


@recorded("allgather", "ENQUEUE_ALLGATHER", lookup)
def allgather_nonblocking(tensor: torch.Tensor, name: str | None = None) -> int:
    """Nonblocking :func:`allgather`."""
    return register(gossamer.allgather(tensor, async_op=True))
