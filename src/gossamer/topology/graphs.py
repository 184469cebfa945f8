"""Generators of BlueFog's static topologies, each returning a named ``Topology``."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from gossamer.topology.topology import Topology, check_int, check_rank
from gossamer.topology.weights import metropolis_hastings_matrix

__all__ = [
    "exponential",
    "exponential_two",
    "fully_connected",
    "mesh_grid_2d",
    "ring",
    "star",
    "symmetric_exponential",
]

_RING_OFFSETS = {"bidirectional": (0, 1, -1), "left": (0, -1), "right": (0, 1)}
_RING_STYLES = tuple(_RING_OFFSETS)


def _is_power_of(value: int, base: int) -> bool:
    """Return whether ``value >= 1`` is ``base ** t`` for some integer ``t >= 0``."""
    # Exact integer division; BlueFog's float logarithm misjudges large powers.
    while value % base == 0:
        value //= base
    return value == 1


def _circulant(first_row: Sequence[bool], name: str) -> Topology:
    """Return the circulant with row ``i`` equal to the normalised mask rolled by ``i``."""
    row = np.asarray(first_row, dtype=np.float64)
    row /= row.sum()
    return Topology(np.stack([np.roll(row, i) for i in range(len(row))]), name=name)


def exponential(size: int, base: int = 2) -> Topology:
    """Return the exponential graph: rank ``i`` sends to ``i + base**t (mod size)``.

    With ``x[0] = 1``, ``x[k] = 1`` when ``k`` is an integer power of ``base`` (``base**0 = 1``
    included) and ``x[k] = 0`` otherwise, ``x`` is normalised to sum 1 and row ``i`` of
    ``W`` is ``x`` rolled by ``i``: ``W[i, j] = x[(j - i) mod size]``. Every weight, self
    included, equals ``1 / (d + 1)`` with ``d`` the number of powers of ``base`` below
    ``size``; ``W`` is a doubly stochastic circulant. This is BlueFog's default topology.

    Args:
        size: Number of ranks, at least 1.
        base: Integer base, at least 2.

    Returns:
        The topology, named ``"exponential(<size>, base=<base>)"``.

    Raises:
        TypeError: ``size`` or ``base`` is not an int.
        ValueError: ``size < 1`` or ``base < 2``.

    Example:
        >>> exponential(8).in_neighbors(0)
        (4, 6, 7)
    """
    size = check_int(size, "size", minimum=1)
    base = check_int(base, "base", minimum=2)
    mask = [k == 0 or _is_power_of(k, base) for k in range(size)]
    return _circulant(mask, f"exponential({size}, base={base})")


def exponential_two(size: int) -> Topology:
    """Return ``exponential(size, base=2)``: rank ``i`` sends to ``i + 2**t (mod size)``.

    Args:
        size: Number of ranks, at least 1.

    Returns:
        The topology, named ``"exponential_two(<size>)"``.

    Raises:
        TypeError: ``size`` is not an int.
        ValueError: ``size < 1``.
    """
    topology = exponential(size, 2)
    return Topology(topology.weights, name=f"exponential_two({topology.size})")


def symmetric_exponential(size: int, base: int = 4) -> Topology:
    """Return the exponential graph mirrored so that every link goes both ways.

    Offset ``k`` counts as the circular distance ``min(k, size - k)`` (BlueFog uses ``k``
    when ``k <= size // 2``, else ``size - k``); ``x[k] = 1`` when that distance is a power
    of ``base`` and ``x[0] = 1``. As in ``exponential``, ``x`` is normalised and
    ``W[i, j] = x[(j - i) mod size]``, giving uniform weights.

    Args:
        size: Number of ranks, at least 1.
        base: Integer base, at least 2.

    Returns:
        The topology, named ``"symmetric_exponential(<size>, base=<base>)"``.

    Raises:
        TypeError: ``size`` or ``base`` is not an int.
        ValueError: ``size < 1`` or ``base < 2``.
    """
    size = check_int(size, "size", minimum=1)
    base = check_int(base, "base", minimum=2)
    mask = [k == 0 or _is_power_of(k if k <= size // 2 else size - k, base) for k in range(size)]
    return _circulant(mask, f"symmetric_exponential({size}, base={base})")


def _grid_shape(size: int, shape: Sequence[int] | None) -> tuple[int, int]:
    if shape is None:
        nrow = next(r for r in range(math.isqrt(size), 0, -1) if size % r == 0)
        return nrow, size // nrow
    if isinstance(shape, str | bytes) or not isinstance(shape, Sequence) or len(shape) != 2:
        raise TypeError(f"shape must be a pair (nrow, ncol) or None; got {shape!r}")
    nrow = check_int(shape[0], "shape[0]", minimum=1)
    ncol = check_int(shape[1], "shape[1]", minimum=1)
    if nrow * ncol != size:
        raise ValueError(f"shape {nrow}x{ncol} = {nrow * ncol} does not match size {size}")
    return nrow, ncol


def mesh_grid_2d(size: int, shape: Sequence[int] | None = None) -> Topology:
    """Return a 2-D grid with Metropolis-Hastings weights.

    Rank ``i`` sits at row ``i // ncol``, column ``i % ncol`` and is linked both ways to its
    up to four grid neighbours. With ``deg`` counting the rank itself,
    ``W[i, j] = 1 / max(deg_i, deg_j)`` on each link and ``W[i, i] = 1 - sum_{j != i} W[i, j]``
    (see ``metropolis_hastings_weights``), so ``W`` is symmetric and doubly stochastic.

    Args:
        size: Number of ranks, at least 1.
        shape: ``(nrow, ncol)`` with ``nrow * ncol == size``. By default ``nrow`` is the
            largest divisor of ``size`` not above ``sqrt(size)``, so a prime size gives a
            ``1 x size`` line.

    Returns:
        The topology, named ``"mesh_grid_2d(<size>, shape=(<nrow>, <ncol>))"``.

    Raises:
        TypeError: ``size`` is not an int, or ``shape`` is not a pair of ints.
        ValueError: ``size < 1``, or ``shape`` does not multiply to ``size``.
    """
    size = check_int(size, "size", minimum=1)
    nrow, ncol = _grid_shape(size, shape)
    adj = np.zeros((size, size), dtype=bool)
    for i in range(size):
        if (i + 1) % ncol:
            adj[i, i + 1] = adj[i + 1, i] = True
        if i + ncol < size:
            adj[i, i + ncol] = adj[i + ncol, i] = True
    weights = metropolis_hastings_matrix(adj)
    return Topology(weights, name=f"mesh_grid_2d({size}, shape=({nrow}, {ncol}))")


def star(size: int, center: int = 0) -> Topology:
    """Return the star graph: every rank exchanges with ``center`` only.

    ``W[c, i] = W[i, c] = 1 / size`` for the centre ``c``, ``W[i, i] = 1 - 1 / size`` for
    every leaf and ``W[c, c] = 1 / size``. The matrix is symmetric and doubly stochastic.

    Args:
        size: Number of ranks, at least 1.
        center: The hub rank, in ``[0, size)``.

    Returns:
        The topology, named ``"star(<size>, center=<center>)"``.

    Raises:
        TypeError: ``size`` or ``center`` is not an int.
        ValueError: ``size < 1`` or ``center`` is outside ``[0, size)``.
    """
    size = check_int(size, "size", minimum=1)
    center = check_rank(center, size, "center")
    weights = np.diag(np.full(size, 1.0 - 1.0 / size))
    weights[center, :] = 1.0 / size
    weights[:, center] = 1.0 / size
    return Topology(weights, name=f"star({size}, center={center})")


def ring(size: int, style: str = "bidirectional") -> Topology:
    """Return a ring.

    For ``size >= 3``:

    * ``"bidirectional"`` (BlueFog ``connect_style=0``): ``i`` exchanges with ``i - 1`` and
      ``i + 1``; the self, left and right weights are each ``1/3``.
    * ``"left"`` (style 1): ``i`` sends to ``i - 1`` and receives from ``i + 1``; the self
      and neighbour weights are ``1/2``.
    * ``"right"`` (style 2): ``i`` sends to ``i + 1`` and receives from ``i - 1``, weights
      ``1/2``.

    Whatever the style, one rank gives ``[[1]]`` and two ranks give all entries ``1/2``.
    Every variant is a doubly stochastic circulant.

    Args:
        size: Number of ranks, at least 1.
        style: ``"bidirectional"``, ``"left"`` or ``"right"``.

    Returns:
        The topology, named ``"ring(<size>, style='<style>')"``.

    Raises:
        TypeError: ``size`` is not an int.
        ValueError: ``size < 1`` or ``style`` is not one of the three names.
    """
    size = check_int(size, "size", minimum=1)
    if not isinstance(style, str) or style not in _RING_STYLES:
        raise ValueError(
            f"style must be one of {_RING_STYLES} (BlueFog's connect_style 0, 1, 2); got {style!r}"
        )
    # Offsets taken mod size also give BlueFog's special cases: [[1]] and the all-1/2 pair.
    mask = np.zeros(size, dtype=bool)
    mask[np.array(_RING_OFFSETS[style]) % size] = True
    return _circulant(mask, f"ring({size}, style={style!r})")


def fully_connected(size: int) -> Topology:
    """Return the complete graph: every entry of ``W`` is ``1 / size``.

    One averaging step reaches exact consensus (spectral gap 1).

    Args:
        size: Number of ranks, at least 1.

    Returns:
        The topology, named ``"fully_connected(<size>)"``.

    Raises:
        TypeError: ``size`` is not an int.
        ValueError: ``size < 1``.
    """
    size = check_int(size, "size", minimum=1)
    return Topology(np.full((size, size), 1.0 / size), name=f"fully_connected({size})")
