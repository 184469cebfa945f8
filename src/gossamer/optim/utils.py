"""Training helpers: broadcast or average parameters and optimizer state, consensus distance."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch
import torch.distributed as dist

from gossamer import context, ops, transport

__all__ = [
    "allreduce_parameters",
    "broadcast_optimizer_state",
    "broadcast_parameters",
    "consensus_distance",
]


def _tensors(params: object) -> list[torch.Tensor]:
    """Tensors of a state_dict, a module, ``(name, tensor)`` pairs or plain tensors."""
    if isinstance(params, torch.nn.Module):
        params = params.state_dict()
    if isinstance(params, Mapping):
        items = [params[k] for k in sorted(params)]
    elif isinstance(params, Iterable):
        items = [p[1] if isinstance(p, tuple) else p for p in params]
    else:
        raise TypeError(f"params must be a state_dict, a module or an iterable; got {params!r}")
    bad = [type(t).__name__ for t in items if not isinstance(t, torch.Tensor)]
    if bad:
        raise TypeError(f"params must hold tensors; got {bad[:3]}")
    return items


def broadcast_parameters(params: object, root_rank: int = 0) -> None:
    """Overwrite every rank's parameters (in place) with rank ``root_rank``'s.

    Args:
        params: a ``state_dict``, an ``nn.Module``, ``named_parameters()`` or tensors.
        root_rank (int): the rank whose values everyone takes.
    """
    handles = [ops.broadcast_(t.data, root=root_rank, async_op=True) for t in _tensors(params)]
    for handle in handles:
        handle.wait()


def allreduce_parameters(params: object) -> None:
    """Replace every rank's parameters (in place) by their average over all ranks."""
    tensors = [t for t in _tensors(params) if t.is_floating_point()]
    handles = [ops.allreduce_(t.data, async_op=True) for t in tensors]
    for handle in handles:
        handle.wait()


def broadcast_optimizer_state(optimizer: torch.optim.Optimizer, root_rank: int = 0) -> None:
    """Give every rank rank ``root_rank``'s optimizer state (hyper-parameters and buffers).

    The whole ``state_dict`` travels as one pickled object, so this is meant for start-up,
    not for every step.
    """
    inner = getattr(optimizer, "optimizer", optimizer)  # a DecentralizedOptimizer wraps one
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {optimizer!r}")
    transport.group_rank(None)
    transport.check_rank(root_rank, "root_rank", context.size())
    payload = [inner.state_dict() if context.rank() == root_rank else None]

    def body() -> None:
        dist.broadcast_object_list(payload, src=root_rank)

    transport.run("broadcast_optimizer_state", body, False)
    if context.rank() != root_rank:
        inner.load_state_dict(payload[0])


def consensus_distance(params: object) -> float:
    r"""Root-mean-square distance of the ranks' parameters from their average.

    .. math:: \sqrt{\frac1n \sum_i \lVert x_i - \bar x \rVert^2},\quad
        \bar x = \frac1n \sum_i x_i

    Collective. 0 when all ranks hold the same model.
    """
    tensors = [t.detach().double().flatten() for t in _tensors(params) if t.is_floating_point()]
    flat = torch.cat(tensors) if tensors else torch.zeros(1, dtype=torch.float64)
    mean = ops.allreduce(flat)
    squared = ops.allreduce(((flat - mean) ** 2).sum().reshape(1))
    return float(squared.sqrt())
