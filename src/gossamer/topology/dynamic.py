"""Dynamic topologies: infinite per-step schedules of who sends to whom."""

from __future__ import annotations

import itertools
import math
import numbers
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from gossamer.topology.topology import Topology, check_int, check_rank

__all__ = [
    "Step",
    "inner_outer_exponential_two",
    "inner_outer_ring",
    "machine_exponential_two",
    "one_peer_exponential",
]


def _rank_tuple(ranks: Iterable[int], name: str) -> tuple[int, ...]:
    if not isinstance(ranks, Iterable):
        raise TypeError(f"{name} must be an iterable of ranks; got {ranks!r}")
    result = tuple(check_int(r, f"{name} entries", minimum=0) for r in ranks)
    if len(set(result)) != len(result):
        raise ValueError(f"{name} must not repeat a rank; got {result}")
    return result


def _real(value: object, name: str) -> float:
    """``value`` as a finite float, or raise naming ``name`` (bools are not weights)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number; got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite; got {value}")
    return float(value)


def _weight_map(
    weights: Mapping[int, float], ranks: tuple[int, ...], name: str
) -> Mapping[int, float]:
    if not isinstance(weights, Mapping):
        raise TypeError(f"{name} must be a Mapping[int, float]; got {type(weights).__name__}")
    if set(weights) != set(ranks):
        # Keys may be of any type here, so they are listed, not sorted.
        raise ValueError(f"{name} keys must be exactly {sorted(ranks)}; got {list(weights)}")
    return MappingProxyType({int(r): _real(w, f"{name}[{r}]") for r, w in weights.items()})


@dataclass(frozen=True)
class Step:
    """What one rank does in one step of a dynamic topology.

    The rank computes ``x <- self_weight * x + sum_{s in recv_ranks} src_weights[s] * x_s``
    and scales what it sends to ``d`` by ``dst_weights[d]``. The weight maps are read-only.

    Attributes:
        send_ranks: Ranks (or machine ranks, see ``machine_exponential_two``) to send to.
        recv_ranks: Ranks to receive from, sorted ascending.
        self_weight: Weight on the rank's own value.
        src_weights: Receive weight per rank in ``recv_ranks``.
        dst_weights: Send-side scale per rank in ``send_ranks``.

    Raises:
        TypeError: A rank is not an int, a rank list is not iterable, a weight is not a real
            number (bools are not), or a weight map is not a ``Mapping``.
        ValueError: A rank is negative or repeated, a map's keys differ from its rank list,
            or a weight is not finite.
    """

    send_ranks: tuple[int, ...]
    recv_ranks: tuple[int, ...]
    self_weight: float
    src_weights: Mapping[int, float]
    dst_weights: Mapping[int, float]

    def __post_init__(self) -> None:
        # The dataclass is frozen, so normalised fields have to bypass __setattr__.
        send = _rank_tuple(self.send_ranks, "send_ranks")
        recv = _rank_tuple(self.recv_ranks, "recv_ranks")
        object.__setattr__(self, "send_ranks", send)
        object.__setattr__(self, "recv_ranks", recv)
        object.__setattr__(self, "self_weight", _real(self.self_weight, "self_weight"))
        object.__setattr__(self, "src_weights", _weight_map(self.src_weights, recv, "src_weights"))
        object.__setattr__(self, "dst_weights", _weight_map(self.dst_weights, send, "dst_weights"))

    def __hash__(self) -> int:
        return hash(
            (
                self.send_ranks,
                self.recv_ranks,
                self.self_weight,
                tuple(sorted(self.src_weights.items())),
                tuple(sorted(self.dst_weights.items())),
            )
        )

    @classmethod
    def uniform(cls, send_ranks: Iterable[int], recv_ranks: Iterable[int]) -> Step:
        """Return the step with uniform receive weights and unit send weights.

        ``self_weight`` and every ``src_weights`` entry are ``1 / (len(recv_ranks) + 1)``;
        every ``dst_weights`` entry is ``1.0``.

        Args:
            send_ranks: Ranks to send to.
            recv_ranks: Ranks to receive from.

        Example:
            >>> Step.uniform([1], [3]).self_weight
            0.5
        """
        send, recv = tuple(send_ranks), tuple(recv_ranks)
        share = 1.0 / (len(recv) + 1)
        return cls(send, recv, share, dict.fromkeys(recv, share), dict.fromkeys(send, 1.0))


def _clockwise_successors(topology: Topology, rank: int) -> tuple[int, ...]:
    """Return the out-neighbours of ``rank`` ordered by ``(dst - rank) mod size``."""
    size = topology.size
    return tuple(sorted(topology.out_neighbors(rank), key=lambda dst: (dst - rank) % size))


def _one_peer_steps(successors: list[tuple[int, ...]], rank: int) -> Iterator[Step]:
    def pick(source: int, step: int) -> int | None:
        peers = successors[source]
        return peers[step % len(peers)] if peers else None

    for step in itertools.count():
        target = pick(rank, step)
        send = () if target is None else (target,)
        recv = tuple(
            src for src in range(len(successors)) if src != rank and pick(src, step) == rank
        )
        yield Step.uniform(send, recv)


def one_peer_exponential(topology: Topology, rank: int) -> Iterator[Step]:
    """Return ``rank``'s schedule of sending to one out-neighbour per step.

    This is BlueFog's ``GetDynamicOnePeerSendRecvRanks``, valid for any static topology
    though normally used with ``exponential_two``. Every rank ``r`` orders its
    out-neighbours clockwise, by ``(dst - r) mod size``, into ``succ_r``; at step ``k`` it
    sends to ``succ_r[k mod len(succ_r)]``. Rank ``rank`` receives from every rank whose
    pick at step ``k`` is ``rank`` (possibly none, possibly several). On
    ``exponential_two(n)`` step ``k`` is the shift by ``2**(k mod ceil(log2 n))``. A rank
    with no out-neighbours sends nothing.

    Args:
        topology: The static topology whose edges are used.
        rank: The rank whose schedule is generated, in ``[0, topology.size)``.

    Returns:
        An infinite iterator of ``Step`` with uniform receive weights (see
        ``Step.uniform``).

    Raises:
        TypeError: ``topology`` is not a ``Topology`` or ``rank`` is not an int.
        ValueError: ``rank`` is outside ``[0, topology.size)``.

    Example:
        >>> from gossamer.topology import exponential_two
        >>> steps = one_peer_exponential(exponential_two(8), 0)
        >>> [next(steps).send_ranks for _ in range(4)]
        [(1,), (2,), (4,), (1,)]
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
    rank = check_rank(rank, topology.size)
    successors = [_clockwise_successors(topology, r) for r in range(topology.size)]
    return _one_peer_steps(successors, rank)


def _check_layout(world_size: object, local_size: object, rank: object) -> tuple[int, int, int]:
    """Validate a homogeneous layout and return ``(num_machines, local_size, rank)``."""
    world = check_int(world_size, "world_size", minimum=1)
    local = check_int(local_size, "local_size", minimum=1)
    if world % local:
        raise ValueError(
            f"world_size must be a multiple of local_size (same number of ranks on every "
            f"machine); got world_size={world}, local_size={local}"
        )
    return world // local, local, check_rank(rank, world)


def _exp2_exponent(count: int) -> int:
    """Return ``floor(log2(count - 1))``, the largest ``t`` with ``2**t < count``."""
    return (count - 1).bit_length() - 1


def _machine_steps(machine: int, machines: int) -> Iterator[Step]:
    period = _exp2_exponent(machines) + 1
    for step in itertools.count():
        dist = 2 ** (step % period)
        yield Step.uniform([(machine + dist) % machines], [(machine - dist) % machines])


def machine_exponential_two(world_size: int, local_size: int, rank: int) -> Iterator[Step]:
    """Return the exponential-2 schedule between machines for the machine of ``rank``.

    BlueFog's ``GetExp2DynamicSendRecvMachineRanks``. The ``send_ranks`` and
    ``recv_ranks`` of each step are **machine** ranks, not process ranks; it is meant for
    hierarchical (machine-level) averaging. With ``M = world_size // local_size``
    machines, ``m = rank // local_size`` and ``e = floor(log2(M - 1))``, step ``k`` uses
    ``d = 2**(k mod (e + 1))``, sends to machine ``(m + d) mod M`` and receives from
    ``(m - d) mod M``.

    Args:
        world_size: Total number of ranks.
        local_size: Ranks per machine; ``world_size`` must be a multiple of it.
        rank: Global rank of the caller, in ``[0, world_size)``.

    Returns:
        An infinite iterator of ``Step`` over machine ranks, with uniform receive weights.

    Raises:
        TypeError: An argument is not an int.
        ValueError: ``world_size`` or ``local_size`` is below 1, ``world_size`` is not a
            multiple of ``local_size``, there is only one machine, or ``rank`` is out of
            range.

    Example:
        >>> steps = machine_exponential_two(16, 2, 0)
        >>> [next(steps).send_ranks for _ in range(4)]
        [(1,), (2,), (4,), (1,)]
    """
    machines, local, rank = _check_layout(world_size, local_size, rank)
    if machines < 2:
        raise ValueError(
            f"machine_exponential_two needs at least two machines; got world_size={world_size}, "
            f"local_size={local_size}"
        )
    return _machine_steps(rank // local, machines)


def _inner_outer_steps(
    machines: int,
    local: int,
    rank: int,
    outer_dist: Callable[[int], int],
    inner_dist: Callable[[int], int],
) -> Iterator[Step]:
    machine, local_rank = divmod(rank, local)
    base = machine * local
    for step in itertools.count():
        outside = step % local
        if local_rank == outside and machines == 1:
            # BlueFog would send to itself here; with no other machine the rank idles.
            yield Step.uniform((), ())
            continue
        if local_rank == outside:
            dist = outer_dist(step)
            send = ((machine + dist) % machines) * local + local_rank
            recv = ((machine - dist) % machines) * local + local_rank
        else:
            dist = inner_dist(step)
            # Walk ``dist`` places on the inner ring that leaves out the outside rank: the
            # hop grows by one when the walk would land on or pass over it.
            forward = dist + (dist >= (outside - local_rank) % local)
            backward = dist + (dist >= (local_rank - outside) % local)
            send = base + (local_rank + forward) % local
            recv = base + (local_rank - backward) % local
        yield Step.uniform((send,), (recv,))


def _check_inner_outer(
    world_size: object, local_size: object, rank: object
) -> tuple[int, int, int]:
    machines, local, rank = _check_layout(world_size, local_size, rank)
    if local <= 2:
        raise ValueError(
            f"local_size must be > 2 for an inner-outer schedule (one rank per step leaves the "
            f"inner ring); got {local}. Use machine_exponential_two or one_peer_exponential"
        )
    return machines, local, rank


def inner_outer_ring(world_size: int, local_size: int, rank: int) -> Iterator[Step]:
    """Return ``rank``'s schedule for the inner-ring / outer-ring topology.

    BlueFog's ``GetInnerOuterRingDynamicSendRecvRanks``. At step ``k`` the local rank
    ``o = k mod local_size`` of every machine is the *outside* rank: on machine ``m`` it
    sends to the same local rank on machine ``m + 1`` and receives from machine ``m - 1``
    (mod the number of machines). The other ranks of the machine form a ring that skips
    ``o``: each sends to the next one and receives from the previous one. Ranks are global.

    With a single machine, the outside rank sends and receives nothing that step (BlueFog
    sends it to itself).

    Args:
        world_size: Total number of ranks.
        local_size: Ranks per machine, at least 3; ``world_size`` must be a multiple of it.
        rank: Global rank of the caller, in ``[0, world_size)``.

    Returns:
        An infinite iterator of ``Step`` with one send and one receive rank (uniform
        weights ``1/2``).

    Raises:
        TypeError: An argument is not an int.
        ValueError: ``local_size <= 2``, ``world_size`` is not a multiple of ``local_size``
            or ``rank`` is out of range.

    Example:
        >>> steps = inner_outer_ring(8, 4, 0)
        >>> [next(steps).send_ranks for _ in range(4)]
        [(4,), (2,), (1,), (1,)]
    """
    machines, local, rank = _check_inner_outer(world_size, local_size, rank)
    return _inner_outer_steps(machines, local, rank, lambda _: 1, lambda _: 1)


def inner_outer_exponential_two(world_size: int, local_size: int, rank: int) -> Iterator[Step]:
    """Return ``rank``'s schedule for the inner-exp2 / outer-exp2 topology.

    BlueFog's ``GetInnerOuterExpo2DynamicSendRecvRanks``: the scheme of
    ``inner_outer_ring`` with exponential-2 distances. With ``M`` machines and
    ``L = local_size``, at step ``k`` the outside rank ``o = k mod L`` sends to the same
    local rank ``2**(k mod (floor(log2(M - 1)) + 1))`` machines ahead and receives from as
    many behind. The other ranks move ``2**(k mod (floor(log2(L - 2)) + 1))`` places on the
    inner ring of ``L - 1`` ranks that leaves out ``o``; in local-rank terms the hop is one
    longer when it would reach or pass ``o``. Ranks are global.

    As BlueFog notes, some local ranks are only ever outside at the same outer distance,
    e.g. for 16 machines of 4 ranks local rank 1 always hops 2 machines. With a single
    machine, the outside rank idles that step (BlueFog fails there).

    Args:
        world_size: Total number of ranks.
        local_size: Ranks per machine, at least 3; ``world_size`` must be a multiple of it.
        rank: Global rank of the caller, in ``[0, world_size)``.

    Returns:
        An infinite iterator of ``Step`` with one send and one receive rank (uniform
        weights ``1/2``).

    Raises:
        TypeError: An argument is not an int.
        ValueError: ``local_size <= 2``, ``world_size`` is not a multiple of ``local_size``
            or ``rank`` is out of range.
    """
    machines, local, rank = _check_inner_outer(world_size, local_size, rank)
    outer_period = _exp2_exponent(machines) + 1 if machines > 1 else 1
    inner_period = _exp2_exponent(local - 1) + 1
    return _inner_outer_steps(
        machines,
        local,
        rank,
        lambda step: 2 ** (step % outer_period),
        lambda step: 2 ** (step % inner_period),
    )
