"""Weight rules that turn a graph into a mixing matrix, and checks on mixing matrices."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from gossamer.errors import TopologyError
from gossamer.topology.topology import Topology, as_weight_matrix

__all__ = [
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_equivalent",
    "is_regular",
    "is_row_stochastic",
    "metropolis_hastings_weights",
    "mixing_rate",
    "spectral_gap",
    "uniform_weights",
]


def _as_adjacency(adjacency: Topology | Any) -> np.ndarray:
    """Return a boolean edge matrix without diagonal from a Topology or a 0/1 matrix."""
    if isinstance(adjacency, Topology):
        return adjacency.adjacency
    arr = as_weight_matrix(adjacency, "adjacency")
    bad = np.argwhere((arr != 0) & (arr != 1))
    if bad.size:
        i, j = (int(x) for x in bad[0])
        raise TopologyError(
            f"adjacency entries must be 0 or 1 (or bool); got {arr[i, j]} at position ({i}, {j})"
        )
    adj = arr != 0
    np.fill_diagonal(adj, False)
    return adj


def _as_matrix(matrix: Topology | Any, name: str) -> np.ndarray:
    """Return the weight matrix of a Topology, or validate an array-like one."""
    if isinstance(matrix, Topology):
        return matrix.weights
    return as_weight_matrix(matrix, name)


def _check_atol(atol: float) -> float:
    if isinstance(atol, bool) or not isinstance(atol, int | float):
        raise TypeError(f"atol must be a float; got {atol!r}")
    if not math.isfinite(atol) or atol < 0:
        raise ValueError(f"atol must be finite and >= 0; got {atol}")
    return float(atol)


def metropolis_hastings_matrix(adj: np.ndarray) -> np.ndarray:
    """Return Metropolis-Hastings weights for a symmetric boolean matrix without diagonal."""
    not_symmetric = np.argwhere(adj != adj.T)
    if not_symmetric.size:
        i, j = (int(x) for x in not_symmetric[0])
        raise TopologyError(
            f"adjacency must be symmetric (undirected); edge {i} -> {j} has no reverse edge"
        )
    degree = adj.sum(axis=1)
    weights = np.where(adj, 1.0 / (1.0 + np.maximum.outer(degree, degree)), 0.0)
    np.fill_diagonal(weights, 1.0 - weights.sum(axis=1))
    return weights


def uniform_weights(adjacency: Topology | Any) -> Topology:
    """Give every rank equal receive weights over itself and its in-neighbours.

    With ``d_j`` the in-degree of ``j`` (self excluded), ``W[i, j] = 1 / (d_j + 1)`` for
    ``i = j`` and every in-neighbour ``i``, else 0. The result is column stochastic; it is
    also row stochastic when the graph is regular.

    Args:
        adjacency: A square 0/1 (or bool) matrix with ``A[i, j]`` set for the edge
            ``i -> j``, or a ``Topology`` whose edges are used. The diagonal is ignored.

    Returns:
        The weighted topology, with self-loops on every rank.

    Raises:
        TypeError: ``adjacency`` cannot be converted to a matrix.
        gossamer.errors.TopologyError: ``adjacency`` is not square or not 0/1.
    """
    adj = _as_adjacency(adjacency)
    in_degree = adj.sum(axis=0)
    weights = (adj | np.eye(len(adj), dtype=bool)) / (in_degree + 1.0)[np.newaxis, :]
    return Topology(weights, name="uniform_weights")


def metropolis_hastings_weights(adjacency: Topology | Any) -> Topology:
    """Weight an undirected graph with the Metropolis-Hastings rule.

    With ``d_i`` the degree of ``i`` **excluding** itself,
    ``W[i, j] = 1 / (1 + max(d_i, d_j))`` for every edge ``i -- j`` and
    ``W[i, i] = 1 - sum_{j != i} W[i, j]``. The matrix is symmetric and doubly stochastic.
    BlueFog's ``MeshGrid2DGraph`` writes the same rule as ``1 / max(deg_i, deg_j)`` with
    degrees that count the node itself; the two agree since
    ``max(d_i + 1, d_j + 1) = 1 + max(d_i, d_j)``.

    Args:
        adjacency: A symmetric 0/1 (or bool) matrix, or a ``Topology`` whose edges are used.
            The diagonal is ignored.

    Returns:
        The weighted topology.

    Raises:
        TypeError: ``adjacency`` cannot be converted to a matrix.
        gossamer.errors.TopologyError: ``adjacency`` is not square, not 0/1 or not symmetric.
    """
    weights = metropolis_hastings_matrix(_as_adjacency(adjacency))
    return Topology(weights, name="metropolis_hastings_weights")


def is_row_stochastic(matrix: Topology | Any, atol: float = 1e-10) -> bool:
    """Return whether every row of the weight matrix sums to 1 (within ``atol``).

    Args:
        matrix: A ``Topology`` or a square, finite, non-negative matrix.
        atol: Absolute tolerance on each row sum.

    Raises:
        TypeError: ``matrix`` cannot be converted or ``atol`` is not a number.
        ValueError: ``atol`` is negative; ``matrix`` is not a valid weight matrix
            (``gossamer.errors.TopologyError``).
    """
    atol = _check_atol(atol)
    return bool(np.all(np.abs(_as_matrix(matrix, "matrix").sum(axis=1) - 1.0) <= atol))


def is_column_stochastic(matrix: Topology | Any, atol: float = 1e-10) -> bool:
    """Return whether every column of the weight matrix sums to 1 (within ``atol``).

    Column stochasticity is what makes every rank's receive weights sum to 1.

    Args:
        matrix: A ``Topology`` or a square, finite, non-negative matrix.
        atol: Absolute tolerance on each column sum.

    Raises:
        TypeError: ``matrix`` cannot be converted or ``atol`` is not a number.
        ValueError: ``atol`` is negative; ``matrix`` is not a valid weight matrix
            (``gossamer.errors.TopologyError``).
    """
    atol = _check_atol(atol)
    return bool(np.all(np.abs(_as_matrix(matrix, "matrix").sum(axis=0) - 1.0) <= atol))


def is_doubly_stochastic(matrix: Topology | Any, atol: float = 1e-10) -> bool:
    """Return whether the weight matrix is both row and column stochastic.

    Averaging with a doubly stochastic matrix preserves the global mean.

    Args:
        matrix: A ``Topology`` or a square, finite, non-negative matrix.
        atol: Absolute tolerance on each row and column sum.

    Raises:
        TypeError: ``matrix`` cannot be converted or ``atol`` is not a number.
        ValueError: ``atol`` is negative; ``matrix`` is not a valid weight matrix
            (``gossamer.errors.TopologyError``).
    """
    return is_row_stochastic(matrix, atol) and is_column_stochastic(matrix, atol)


def mixing_rate(topology: Topology | Any) -> float:
    """Return ``|lambda_2|``, the second largest eigenvalue modulus of the weight matrix.

    For a stochastic ``W`` the largest modulus is 1 and the distance to consensus shrinks
    roughly by ``|lambda_2|`` per averaging step. A single rank has rate 0.

    Args:
        topology: A ``Topology`` or a square, finite, non-negative matrix.

    Raises:
        TypeError: ``topology`` cannot be converted to a matrix.
        gossamer.errors.TopologyError: ``topology`` is not a valid weight matrix.
    """
    weights = _as_matrix(topology, "topology")
    if len(weights) == 1:
        return 0.0
    moduli = np.sort(np.abs(np.linalg.eigvals(weights)))[::-1]
    return float(moduli[1])


def spectral_gap(topology: Topology | Any) -> float:
    """Return ``1 - |lambda_2|``, the spectral gap of the weight matrix.

    A larger gap mixes faster: ``fully_connected`` has gap 1, a disconnected graph gap 0,
    and a bidirectional ring of ``n`` ranks, whose eigenvalues are
    ``(1 + 2 cos(2 pi k / n)) / 3``, a gap that shrinks like ``1 / n^2``.

    Args:
        topology: A ``Topology`` or a square, finite, non-negative matrix.

    Raises:
        TypeError: ``topology`` cannot be converted to a matrix.
        gossamer.errors.TopologyError: ``topology`` is not a valid weight matrix.
    """
    return 1.0 - mixing_rate(topology)


def is_regular(topology: Topology) -> bool:
    """Return whether every rank has the same in-degree plus out-degree (self excluded).

    Raises:
        TypeError: ``topology`` is not a ``Topology``.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
    adj = topology.adjacency
    degree = adj.sum(axis=0) + adj.sum(axis=1)
    return bool(np.all(degree == degree[0]))


def is_equivalent(first: Topology | None, second: Topology | None) -> bool:
    """Return whether two topologies have the same size and exactly equal weights.

    This compares matrices entry by entry; it does not test for graph isomorphism, and
    names are ignored. ``None`` on either side gives ``False``.

    Raises:
        TypeError: An argument is neither a ``Topology`` nor ``None``.
    """
    for arg_name, value in (("first", first), ("second", second)):
        if value is not None and not isinstance(value, Topology):
            raise TypeError(f"{arg_name} must be a Topology or None; got {type(value).__name__}")
    if first is None or second is None:
        return False
    return first == second
