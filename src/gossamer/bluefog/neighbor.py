"""BlueFog's neighbour operations: static and dynamic averaging, gathers, machine level, pairs.

BlueFog's argument rules are kept: ``self_weight`` and ``src_weights`` go together, and
``dst_weights`` makes a call dynamic, where ``enable_topo_check`` maps to gossamer's
``check_topology``. Weights are matched to sources by rank.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

import gossamer
from gossamer.bluefog._compat import (
    check_weight_types,
    need_float,
    plain_ranks,
    plain_weights,
    removed_kwargs,
)
from gossamer.bluefog._handles import lookup, register
from gossamer.bluefog.timeline import recorded

__all__ = [
    "hierarchical_neighbor_allreduce",
    "hierarchical_neighbor_allreduce_nonblocking",
    "neighbor_allgather",
    "neighbor_allgather_nonblocking",
    "neighbor_allreduce",
    "neighbor_allreduce_nonblocking",
    "pair_gossip",
    "pair_gossip_nonblocking",
]

logger = logging.getLogger(__name__)


def _neighbor_allgather(
    tensor: torch.Tensor,
    src_ranks: object,
    dst_ranks: object,
    enable_topo_check: bool,
    async_op: bool,
) -> Any:
    dynamic = src_ranks is not None or dst_ranks is not None
    return gossamer.neighbor_allgather(
        tensor,
        src_ranks=plain_ranks(src_ranks),
        dst_ranks=plain_ranks(dst_ranks),
        check_topology=bool(enable_topo_check) and dynamic,
        async_op=async_op,
    )


@recorded("neighbor.allgather", "ENQUEUE_NEIGHBOR_ALLGATHER")
def neighbor_allgather(
    tensor: torch.Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    """Concatenate the in-neighbours' tensors along dim 0 (:func:`gossamer.neighbor_allgather`).

    Static: from ``in_neighbor_ranks()``. Dynamic: ``src_ranks`` and ``dst_ranks`` together,
    the result in ``src_ranks`` order; ``enable_topo_check`` checks that sends match receives.
    """
    return _neighbor_allgather(tensor, src_ranks, dst_ranks, enable_topo_check, False)


@recorded("neighbor.allgather", "ENQUEUE_NEIGHBOR_ALLGATHER", lookup)
def neighbor_allgather_nonblocking(
    tensor: torch.Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`neighbor_allgather`."""
    return register(_neighbor_allgather(tensor, src_ranks, dst_ranks, enable_topo_check, True))


def _neighbor_allreduce(
    tensor: torch.Tensor,
    self_weight: object,
    src_weights: object,
    dst_weights: object,
    enable_topo_check: bool,
    async_op: bool,
) -> Any:
    need_float(tensor, "neighbor_allreduce")
    src_weights, dst_weights = plain_weights(src_weights), plain_weights(dst_weights)
    self_weight = check_weight_types(self_weight, src_weights, "src_weights")
    return gossamer.neighbor_allreduce(
        tensor,
        self_weight=self_weight,
        src_weights=src_weights,
        dst_weights=dst_weights,
        check_topology=bool(enable_topo_check) and dst_weights is not None,
        async_op=async_op,
    )


_NEIGHBOR_FIXES = {
    "neighbor_weights": "Use src_weights instead.",
    "send_neighbors": "Use dst_weights instead.",
}


@removed_kwargs(**_NEIGHBOR_FIXES)
@recorded("neighbor.allreduce", "ENQUEUE_NEIGHBOR_ALLREDUCE")
def neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> torch.Tensor:
    r"""Weighted average with the in-neighbours (:func:`gossamer.neighbor_allreduce`).

    :math:`y_i = w_{ii} x_i + \sum_j w_{ji} m_{j \to i}`. With no weights: the topology's
    edge weights if it was set with ``is_weighted=True``, else ``1/(indegree+1)`` computed
    as ``(x_i + sum_j x_j) / (indegree+1)``. ``self_weight`` and ``src_weights`` come
    together; adding ``dst_weights`` (a dict, or a list meaning weight 1) is dynamic mode,
    where ``enable_topo_check`` checks that every send has a matching receive.

    Raises:
        ValueError: weights given alone or of the wrong kind, keys that are not neighbours,
            repeated destinations, mismatched sends and receives (``enable_topo_check``).
        TypeError: the removed ``neighbor_weights`` / ``send_neighbors`` arguments.
    """
    return _neighbor_allreduce(
        tensor, self_weight, src_weights, dst_weights, enable_topo_check, False
    )


@removed_kwargs(**_NEIGHBOR_FIXES)
@recorded("neighbor.allreduce", "ENQUEUE_NEIGHBOR_ALLREDUCE", lookup)
def neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = True,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`neighbor_allreduce`."""
    return register(
        _neighbor_allreduce(tensor, self_weight, src_weights, dst_weights, enable_topo_check, True)
    )


def _hierarchical(
    tensor: torch.Tensor,
    self_weight: object,
    src_machine_weights: object,
    dst_machine_weights: object,
    check: bool,
    async_op: bool,
) -> Any:
    op = "hierarchical_neighbor_allreduce"
    need_float(tensor, op)
    src = plain_weights(src_machine_weights)
    dst = plain_weights(dst_machine_weights)
    self_weight = check_weight_types(self_weight, src, "src_machine_weights")
    if check:
        logger.warning("%s: enable_topo_check is not supported and is ignored", op)
    no_weights = self_weight is None and src is None and dst is None
    if no_weights and gossamer.get_machine_topology() is None:
        raise RuntimeError(
            f"{op}: no machine topology is set; call bf.set_machine_topology() or pass "
            "self_weight, src_machine_weights and dst_machine_weights"
        )
    return gossamer.hierarchical_neighbor_allreduce(
        tensor,
        self_weight=self_weight,
        src_machine_weights=src,
        dst_machine_weights=dst,
        async_op=async_op,
    )


_MACHINE_FIXES = {
    "neighbor_machine_weights": "Use src_machine_weights instead.",
    "send_neighbor_machines": "Use dst_machine_weights instead.",
}


@removed_kwargs(**_MACHINE_FIXES)
@recorded("neighbor.allreduce", "ENQUEUE_NEIGHBOR_ALLREDUCE")
def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> torch.Tensor:
    """Neighbour averaging between machines (:func:`gossamer.hierarchical_neighbor_allreduce`).

    With no weights the machine topology gives them (``RuntimeError`` if none is set);
    otherwise all three weight arguments are needed (machine ranks, any machines).
    """
    return _hierarchical(
        tensor, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, False
    )


@removed_kwargs(**_MACHINE_FIXES)
@recorded("neighbor.allreduce", "ENQUEUE_NEIGHBOR_ALLREDUCE", lookup)
def hierarchical_neighbor_allreduce_nonblocking(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    enable_topo_check: bool = False,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`hierarchical_neighbor_allreduce`."""
    return register(
        _hierarchical(
            tensor, self_weight, src_machine_weights, dst_machine_weights, enable_topo_check, True
        )
    )


@recorded("pair.gossip", "ENQUEUE_PAIR_GOSSIP")
def pair_gossip(
    tensor: torch.Tensor,
    target_rank: int,
    self_weight: float | None = None,
    pair_weight: float | None = None,
    name: str | None = None,
) -> torch.Tensor:
    """Average with ``target_rank``, which calls it back (:func:`gossamer.pair_gossip`)."""
    need_float(tensor, "pair_gossip")
    return gossamer.pair_gossip(
        tensor, target_rank, self_weight=self_weight, pair_weight=pair_weight
    )


@recorded("pair.gossip", "ENQUEUE_PAIR_GOSSIP", lookup)
def pair_gossip_nonblocking(
    tensor: torch.Tensor,
    target_rank: int,
    self_weight: float | None = None,
    pair_weight: float | None = None,
    name: str | None = None,
) -> int:
    """Nonblocking :func:`pair_gossip`."""
    need_float(tensor, "pair_gossip")
    return register(
        gossamer.pair_gossip(
            tensor, target_rank, self_weight=self_weight, pair_weight=pair_weight, async_op=True
        )
    )
