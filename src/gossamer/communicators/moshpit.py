r"""Moshpit averaging (Ryabinin et al., 2021, "Moshpit SGD"): group averages along a grid.

The ranks sit on a grid :math:`m_1 \times \dots \times m_d` (:math:`n = \prod_k m_k`; rank
``r`` has the row-major coordinates :math:`c(r)`, the last one fastest). Round :math:`t`
(counted from 0) uses the dimension :math:`k = t \bmod d`: each rank averages with the ranks
that share all its coordinates but the :math:`k`-th,

.. math:: x_r \leftarrow \frac{1}{|G_k(r)|} \sum_{s \in G_k(r)} x_s, \qquad
    G_k(r) = \{ s : c_j(s) = c_j(r) \ \forall j \ne k \}.

After rounds along dimensions :math:`0, \dots, k-1`, :math:`x_r` is the mean over the slab of
ranks sharing :math:`c_k(r), \dots, c_{d-1}(r)`; so every :math:`d` consecutive rounds give
the exact global mean, at the cost per round of an allreduce among :math:`m_k` ranks.

Dead ranks (the ``live`` set): a group averages over its live members only,
:math:`G_k(r) \cap L`. The groups of a round are disjoint and each keeps its sum, so the
survivors' sum :math:`\sum_{s \in L} x_s` is kept by every round: the survivors converge to
their mean at the time the live set last changed. They no longer get there in :math:`d`
rounds (a survivor alone in its group along :math:`k` keeps its value that round), but
geometrically, as long as the survivors stay connected through grid lines. Who is dead is
told to the communicator (:meth:`MoshpitAverage.mark_dead`), or, with ``elastic=True``,
learned from the runtime's membership: every round is then a
:class:`~gossamer.communicators.elastic.GroupRound` (point to point among the group's live
members), so a member that dies in the middle of a round is dropped from that round by
all the others, which average among themselves (``docs/fault-tolerance.md``).
:func:`elastic_global_average` runs :math:`d` such rounds: the global rounds of elastic
neighbour averaging (``global_average_every``).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterable, Sequence
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from gossamer import context, ops, transport
from gossamer.communicators.base import Communicator, Deferred, Pending
from gossamer.communicators.elastic import GroupRound
from gossamer.fusion import Bucket
from gossamer.topology import connected_components

__all__ = ["MoshpitAverage", "elastic_global_average", "grid_groups", "near_cubic_grid"]


def _check_positive_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1; got {value}")
    return int(value)


def _prime_factors(size: int) -> list[int]:
    factors, p = [], 2
    while p * p <= size:
        while size % p == 0:
            factors.append(p)
            size //= p
        p += 1
    return factors + ([size] if size > 1 else [])


def _factorisations(size: int, count: int, smallest: int) -> Iterable[tuple[int, ...]]:
    """Every ``(f_1 <= ... <= f_count)`` with product ``size`` and ``f_1 >= smallest >= 2``."""
    if count == 1:
        if size >= smallest:
            yield (size,)
        return
    f = smallest
    while f**count <= size:
        if size % f == 0:
            for rest in _factorisations(size // f, count - 1, f):
                yield (f, *rest)
        f += 1


def near_cubic_grid(size: int, ndim: int | None = None) -> tuple[int, ...]:
    """Return the most balanced grid of ``size`` ranks in ``ndim`` dimensions of size >= 2.

    Among the factorisations ``size = m_1 * ... * m_ndim`` with every ``m_k >= 2`` it picks
    the one with the smallest largest side (then the smallest sum), sides ascending. By
    default ``ndim`` is ``min(3, number of prime factors of size)``: a near-cubic grid, never
    a side of 1 (a round along it would do nothing). ``size = 1`` gives ``(1,)``; a prime
    gives ``(size,)``, one group of everyone.

    Args:
        size: Number of ranks, at least 1.
        ndim: Number of dimensions, at least 1 and at most the number of prime factors of
            ``size`` (counted with multiplicity).

    Returns:
        The grid, e.g. ``(2, 2)`` for 4, ``(2, 3)`` for 6, ``(2, 2, 2)`` for 8, ``(4, 4, 4)``
        for 64.

    Raises:
        TypeError: ``size`` or ``ndim`` is not an int.
        ValueError: ``size < 1``, ``ndim < 1``, or ``ndim`` more than ``size`` has prime
            factors.

    Example:
        >>> near_cubic_grid(36)
        (3, 3, 4)
    """
    size = _check_positive_int(size, "size")
    if size == 1:
        if ndim is not None:
            _check_positive_int(ndim, "ndim")
        return (1,)
    primes = _prime_factors(size)
    if ndim is None:
        ndim = min(3, len(primes))
    ndim = _check_positive_int(ndim, "ndim")
    if ndim > len(primes):
        raise ValueError(
            f"ndim must be at most {len(primes)} for size {size} (= {' * '.join(map(str, primes))})"
            f", so that every side is >= 2; got {ndim}"
        )
    return min(_factorisations(size, ndim, 2), key=lambda g: (max(g), sum(g)))


def _check_grid(grid: object) -> tuple[int, ...]:
    if isinstance(grid, str | bytes) or not isinstance(grid, Sequence) or not grid:
        raise TypeError(f"grid must be a non-empty sequence of ints; got {grid!r}")
    return tuple(_check_positive_int(m, "grid entries") for m in grid)


def grid_groups(grid: Sequence[int], dim: int) -> list[tuple[int, ...]]:
    """Return the groups of a round along ``dim``: ranks that differ only in coordinate ``dim``.

    Ranks are numbered row-major (the last coordinate fastest), as ``np.ravel_multi_index``.

    Args:
        grid: The sides ``(m_1, ..., m_d)``.
        dim: A dimension in ``[0, d)``.

    Returns:
        ``prod(grid) / grid[dim]`` groups of ``grid[dim]`` ranks each, every group sorted and
        the groups ordered by their first rank.

    Raises:
        TypeError: ``grid`` is not a sequence of ints, or ``dim`` not an int.
        ValueError: a side below 1, or ``dim`` out of range.

    Example:
        >>> grid_groups((2, 3), 0)
        [(0, 3), (1, 4), (2, 5)]
    """
    grid = _check_grid(grid)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim must be an int; got {dim!r}")
    if not 0 <= dim < len(grid):
        raise ValueError(f"dim must be in [0, {len(grid)}) for grid {grid}; got {dim}")
    ranks = np.moveaxis(np.arange(math.prod(grid)).reshape(grid), dim, -1)
    return sorted(tuple(int(r) for r in line) for line in ranks.reshape(-1, grid[dim]))


def _rank_set(ranks: object, name: str, size: int | None = None) -> frozenset[int]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, int | np.integer | Iterable):
        raise TypeError(f"{name} must be a rank or an iterable of ranks; got {ranks!r}")
    items = [ranks] if isinstance(ranks, int | np.integer) else list(ranks)
    for r in items:
        if isinstance(r, bool) or not isinstance(r, int | np.integer):
            raise TypeError(f"{name} entries must be ints; got {r!r}")
    bad = [int(r) for r in items if r < 0 or (size is not None and r >= size)]
    if bad:
        limit = f"[0, {size})" if size is not None else ">= 0"
        raise ValueError(f"{name} must be ranks in {limit}; got {bad}")
    return frozenset(int(r) for r in items)


class MoshpitAverage(Communicator):
    r"""Each round averages within the groups of one grid dimension, in turn (Moshpit).

    Round :math:`t` averages each rank with the live ranks sharing all its grid coordinates
    but the one of dimension :math:`t \bmod d`; with every rank live, :math:`d` rounds give
    the exact global mean. See the module docstring for the math and for dead ranks.

    :meth:`bind` creates one process group per grid line (collective: every rank of the
    world must call it, with the same grid, while every rank is alive). A round whose group
    is all live is an ``allreduce`` on that group; a group that lost members averages its
    live members by point-to-point exchange (``neighbor_allreduce`` with weights
    :math:`1/|G \cap L|`), so no collective ever waits for a dead rank.

    Args:
        grid (Sequence[int], optional): the sides; their product must be the world size.
            None: :func:`near_cubic_grid` of the world size, chosen at :meth:`bind`.
        live (Iterable[int], optional): the live ranks (None: every rank).
        elastic (bool): learn deaths from the membership and survive a death in the middle
            of a round (every round point to point; no process groups are created).

    Attributes:
        rounds (int): rounds started so far (:meth:`next_round`); the only state in
            :meth:`state_dict`. The current round's dimension is ``(rounds - 1) mod d``.
    """

    name = "moshpit"

    def __init__(
        self,
        grid: Sequence[int] | None = None,
        *,
        live: Iterable[int] | None = None,
        elastic: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool; got {elastic!r}")
        self.elastic = elastic
        self.grid: tuple[int, ...] | None = None if grid is None else _check_grid(grid)
        self._live: frozenset[int] | None = None if live is None else _rank_set(live, "live")
        # dimension -> this rank's group (its global ranks) and the process group over it.
        self._groups: list[tuple[tuple[int, ...], dist.ProcessGroup | None]] = []

    @property
    def live(self) -> frozenset[int]:
        """The live ranks (every rank until told otherwise; elastic: less the agreed dead)."""
        live = frozenset(range(context.size())) if self._live is None else self._live
        if self.elastic and context.size() > 1:
            live -= transport.get_membership().dead
        return live

    @property
    def dimension(self) -> int:
        """The grid dimension of the current round, ``(rounds - 1) mod d`` (0 before any)."""
        grid = self._bound_grid()
        return max(self.rounds - 1, 0) % len(grid)

    def _bound_grid(self) -> tuple[int, ...]:
        if self.grid is None:
            raise RuntimeError("MoshpitAverage: call bind() first (it picks the grid)")
        return self.grid

    def bind(self, buckets: Sequence[Bucket] = ()) -> None:
        """Check the grid and create one process group per grid line (collective).

        Every rank of the world creates every group, in the same order (``new_group`` is
        collective), on the communication thread behind pending operations.

        Raises:
            ValueError: the grid's product differs from the world size, or ``live`` names a
                rank outside the world or leaves none.
        """
        size = context.size()
        grid = near_cubic_grid(size) if self.grid is None else self.grid
        if math.prod(grid) != size:
            raise ValueError(
                f"grid must have as many cells as ranks: prod({grid}) = {math.prod(grid)}, "
                f"world size {size}"
            )
        self.grid = grid
        if self._live is not None:
            self._set_live(self._live, "live")
        if self.elastic:
            self._groups = [(_my_group(grid, dim), None) for dim in range(len(grid))]
        else:
            self._groups = transport.run("moshpit_groups", self._new_groups, False)

    def _new_groups(self) -> list[tuple[tuple[int, ...], dist.ProcessGroup | None]]:
        grid, me = self._bound_grid(), context.rank()
        mine: list[tuple[tuple[int, ...], dist.ProcessGroup | None]] = []
        for dim in range(len(grid)):
            chosen: tuple[tuple[int, ...], dist.ProcessGroup | None] = ((me,), None)
            for members in grid_groups(grid, dim):
                # A side of 1 is a round without peers: no group to create.
                group = (
                    dist.new_group(list(members), timeout=timedelta(seconds=context.timeout()))
                    if len(members) > 1
                    else None
                )
                if me in members:
                    chosen = (members, group)
            mine.append(chosen)
        return mine

    def set_live(self, ranks: Iterable[int]) -> None:
        """Set the live ranks; every live rank must make the same call before the same round.

        The live set may only shrink: a rank cannot come back (joining is not built).

        Raises:
            TypeError: ``ranks`` is not an iterable of ints.
            ValueError: a rank outside the world, a rank that was dead, or no rank at all.
        """
        self._set_live(ranks, "ranks")

    def _set_live(self, ranks: Iterable[int], name: str) -> None:
        live = _rank_set(ranks, name, context.size())
        if not live:
            raise ValueError(f"{name} must keep at least one rank live; got {sorted(live)}")
        back = sorted(live - self.live)
        if back:
            raise ValueError(
                f"{name} names ranks that were dead: {back}; the live set may only shrink "
                "(joining is not built)"
            )
        self._live = live
        if self.grid is not None:
            self._warn_if_split(live)

    def mark_dead(self, ranks: int | Iterable[int]) -> None:
        """Remove ``ranks`` from the live set (same call on every live rank, same round).

        Raises:
            TypeError: ``ranks`` is not a rank or an iterable of ints.
            ValueError: a rank outside the world, or every rank dead.
        """
        self._set_live(self.live - _rank_set(ranks, "ranks", context.size()), "ranks")

    def _warn_if_split(self, live: frozenset[int]) -> None:
        grid = self._bound_grid()
        adjacency = np.zeros((math.prod(grid),) * 2, dtype=bool)
        for dim in range(len(grid)):
            for members in grid_groups(grid, dim):
                alive = [r for r in members if r in live]
                adjacency[np.ix_(alive, alive)] = True
        order = sorted(live)
        parts = connected_components(adjacency[np.ix_(order, order)])
        if len(parts) > 1:
            warnings.warn(
                f"MoshpitAverage: the live ranks share no grid line across groups "
                f"{[[order[i] for i in p] for p in parts]}; each part averages only itself",
                RuntimeWarning,
                stacklevel=3,
            )

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        if not self._groups:
            raise RuntimeError("MoshpitAverage: call bind() before start()")
        me, live = context.rank(), self.live
        members, group = self._groups[self.dimension]
        if self.elastic:  # a rank the others found dead raises there, naming itself
            everyone = frozenset(range(context.size()))
            told = frozenset() if self._live is None else everyone - self._live
            return GroupRound(members, told, self.rounds).start(flat)
        if me not in live:
            return None  # a dead rank takes no part
        alive = [r for r in members if r in live]
        if len(alive) == 1:
            return None
        if len(alive) == len(members):
            return ops.allreduce(flat, group=group, async_op=True)
        peers = [r for r in alive if r != me]
        share = 1.0 / len(alive)
        return ops.neighbor_allreduce(
            flat,
            self_weight=share,
            src_weights=dict.fromkeys(peers, share),
            dst_weights=peers,
            async_op=True,
        )

    def close(self) -> None:
        """Drop the process groups (the runtime destroys them at shutdown)."""
        self._groups = []

    def __repr__(self) -> str:
        return f"MoshpitAverage(grid={self.grid}, rounds={self.rounds}, live={len(self.live)})"


def _my_group(grid: Sequence[int], dim: int) -> tuple[int, ...]:
    """This rank's grid line along ``dim``."""
    me = context.rank()
    return next(members for members in grid_groups(grid, dim) if me in members)


def elastic_global_average(flat: torch.Tensor, round: int = -1) -> Pending:
    """The mean of ``flat`` over the live ranks by :math:`d` Moshpit rounds that outlive deaths.

    The grid is :func:`near_cubic_grid` of the world size; each round is a
    :class:`~gossamer.communicators.elastic.GroupRound` along one dimension. With every rank
    live the result is the exact mean; after a death, the survivors' sum is kept and they
    converge to their mean over later global rounds (see the module's text). The rounds run
    when the result is waited for (each needs the last one's value), so every rank must
    wait its global rounds in the same order.
    """
    grid = near_cubic_grid(context.size())

    def run() -> torch.Tensor:
        x = flat
        for dim in range(len(grid)):
            x = GroupRound(_my_group(grid, dim), round=round).start(x).wait()
        return x

    return Deferred(run)
