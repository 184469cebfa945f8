"""Argument checks at the public boundary; each error names the argument and the value."""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.errors import TopologyError
from gossamer.topology import Topology

__all__ = [
    "AVERAGING_DTYPES",
    "check_flag",
    "check_rank",
    "check_rank_list",
    "check_tensor",
    "check_topology",
    "check_weight",
    "check_weights",
    "group_rank",
    "group_size",
]

# Dtypes a weighted average is defined for (the weights are real numbers).
AVERAGING_DTYPES = (
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.complex128,
)


def check_tensor(tensor: object, dtypes: Collection[torch.dtype], op: str) -> torch.Tensor:
    """Return ``tensor`` if it is a tensor of one of ``dtypes``."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{op}: tensor must be a torch.Tensor; got {type(tensor).__name__}")
    if tensor.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: tensor dtype {tensor.dtype} is not supported; use one of {names}")
    if tensor.is_sparse:
        raise TypeError(f"{op}: sparse tensors are not supported")
    return tensor


def check_flag(value: object, name: str, op: str | None = None) -> bool:
    """Return ``value`` if it is a bool.

    0, 1 and numpy bools are refused too: a flag that is not a bool is almost always an
    argument in the wrong place.
    """
    if not isinstance(value, bool):
        where = f"{op}: " if op else ""
        raise TypeError(f"{where}{name} must be a bool; got {value!r}")
    return value


def check_rank(value: object, name: str, size: int, unit: str = "rank") -> int:
    """Return ``value`` if it is an int in ``[0, size)``; ``unit`` names what it counts."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int {unit}; got {value!r}")
    if not 0 <= value < size:
        raise ValueError(f"{name} must be a {unit} in [0, {size}); got {value}")
    return value


def check_weight(value: object, name: str) -> float:
    """Return ``value`` as a float if it is a finite real number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return float(value)


def check_weights(
    weights: object,
    name: str,
    size: int,
    me: int,
    allowed: Collection[int] | None = None,
    allowed_what: str = "",
    unit: str = "rank",
) -> dict[int, float]:
    """Return ``weights`` as ``{rank: float}``: a mapping of other ranks to finite numbers.

    ``allowed`` restricts the keys (e.g. to the in-neighbours, described by ``allowed_what``);
    ``unit`` names what the keys count (``"machine"`` for machine weights).
    """
    if not isinstance(weights, Mapping):
        raise TypeError(f"{name} must be a mapping {{rank: weight}}; got {type(weights).__name__}")
    out = {}
    for rank, weight in weights.items():
        check_rank(rank, f"{name} key", size, unit)
        if rank == me:
            raise ValueError(f"{name} must not contain this {unit} ({me}); use self_weight")
        out[rank] = check_weight(weight, f"{name}[{rank}]")
    if allowed is not None:
        extra = sorted(set(out) - set(allowed))
        if extra:
            raise ValueError(
                f"{name} keys must be {allowed_what} of rank {me} ({sorted(allowed)}); got {extra}"
            )
    return out


def check_rank_list(ranks: object, name: str, size: int, me: int, unit: str = "rank") -> list[int]:
    """Return ``ranks`` as a list: distinct ints in range, without this rank (``unit``)."""
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence | set | frozenset):
        raise TypeError(f"{name} must be a sequence of {unit}s; got {type(ranks).__name__}")
    out = [check_rank(r, f"{name} entry", size, unit) for r in ranks]
    if len(set(out)) != len(out):
        raise ValueError(f"{name} must not repeat a {unit}; got {list(ranks)}")
    if me in out:
        raise ValueError(f"{name} must not contain this {unit} ({me})")
    return out


def group_rank(group: dist.ProcessGroup | None) -> int:
    """This process's rank in ``group`` (the world when None)."""
    context.rank()  # raises NotInitializedError before init
    if group is None:
        return dist.get_rank()
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup or None; got {group!r}")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"rank {context.rank()} is not a member of group {group!r}")
    return rank


def group_size(group: dist.ProcessGroup | None) -> int:
    """Number of ranks in ``group`` (the world when None)."""
    group_rank(group)
    return dist.get_world_size(group)


def check_topology(topology: object, group: dist.ProcessGroup | None, name: str) -> Topology:
    """Return ``topology`` if it is a Topology of the group's size, else raise."""
    if not isinstance(topology, Topology):
        raise TypeError(f"{name} must be a gossamer.topology.Topology; got {topology!r}")
    size = group_size(group)
    if topology.size != size:
        raise TopologyError(f"{name} has {topology.size} ranks but the group has {size}")
    return topology
