r"""A topology among the survivors: the dead ranks' edges removed, the weights re-normalised.

:meth:`Topology.without` is the entry point; this module holds its math. Ranks keep their
numbers: the result has the original size, every dead rank is isolated (self weight 1, no
edges) and the survivors' block is re-weighted by one of these rules, applied to the
survivors' sub-matrix :math:`S` (rows and columns of the surviving ranks, dead edges gone):

- ``"metropolis_hastings"``: :math:`S_{ij} = 1 / (1 + \max(d_i, d_j))` on every edge of the
  surviving undirected graph, :math:`S_{ii} = 1 - \sum_{j \ne i} S_{ij}`, with :math:`d_i`
  the degree among survivors. Symmetric and doubly stochastic.
- ``"sinkhorn"``: :math:`S = D_1 S^0 D_2` with positive diagonal :math:`D_1, D_2` chosen by
  alternately normalising columns and rows (Sinkhorn-Knopp) until both sum to 1. Keeps
  every surviving edge of a directed graph; it converges when :math:`S^0` has total support,
  which holds for a strongly connected graph with self weights (Sinkhorn and Knopp, 1967).
- ``"receive"``: :math:`S_{ij} = S^0_{ij} / \sum_k S^0_{kj}`: each survivor's receive
  weights sum to 1 (column stochastic): convex combinations, consensus.
- ``"send"``: :math:`S_{ij} = S^0_{ij} / \sum_k S^0_{ik}`: each survivor's send weights sum
  to 1 (row stochastic): mass is conserved, which is what push-sum needs.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from gossamer.errors import TopologyError
from gossamer.topology.topology import Topology, check_int
from gossamer.topology.weights import (
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    metropolis_hastings_matrix,
)

__all__ = ["WEIGHT_RULES", "connected_components", "without"]

#: the re-weighting rules of :meth:`Topology.without`
WEIGHT_RULES = ("auto", "metropolis_hastings", "sinkhorn", "receive", "send")

# Stochasticity of the original is judged to this tolerance (the generators' sums are exact
# to about 1e-15; user matrices typed with a few digits are not).
_STOCHASTIC_ATOL = 1e-9
_SINKHORN_ATOL = 1e-13
_SINKHORN_MAX_ITERATIONS = 100_000


def dead_set(ranks: int | Iterable[int], size: int, name: str = "ranks") -> tuple[int, ...]:
    """Return ``ranks`` (one rank or an iterable of them) as a sorted tuple, or raise.

    Raises:
        TypeError: ``ranks`` is not an int nor an iterable of ints.
        ValueError: a rank outside ``[0, size)``, or a rank given twice.
    """
    if isinstance(ranks, str | bytes) or not isinstance(ranks, int | np.integer | Iterable):
        raise TypeError(f"{name} must be a rank or an iterable of ranks; got {ranks!r}")
    items = [ranks] if isinstance(ranks, int | np.integer) else list(ranks)
    checked = [check_int(r, f"{name} entries") for r in items]
    bad = [r for r in checked if not 0 <= r < size]
    if bad:
        raise ValueError(f"{name} must be ranks in [0, {size}) for size {size}; got {bad}")
    if len(set(checked)) != len(checked):
        raise ValueError(f"{name} must not repeat a rank; got {checked}")
    return tuple(sorted(checked))


def _reach(adj: np.ndarray, start: int) -> np.ndarray:
    """Boolean mask of the nodes reachable from ``start`` along ``adj`` (start included)."""
    seen = np.zeros(len(adj), dtype=bool)
    seen[start] = True
    frontier = seen.copy()
    while frontier.any():
        frontier = adj[frontier].any(axis=0) & ~seen
        seen |= frontier
    return seen


def connected_components(adjacency: Topology | np.ndarray) -> list[list[int]]:
    """Return the strongly connected components of a graph.

    For an undirected (symmetric) graph these are its connected components. A component is
    the set of nodes that both reach and are reached from its smallest node.

    Args:
        adjacency: A ``Topology`` (its edges are used) or a square boolean matrix with
            ``adjacency[i, j]`` set for the edge ``i -> j``; the diagonal is ignored.

    Returns:
        The components, each sorted ascending, ordered by their smallest node.

    Raises:
        ValueError: ``adjacency`` is not a square matrix.

    Example:
        >>> connected_components([[0, 1, 0], [1, 0, 0], [0, 0, 0]])
        [[0, 1], [2]]
    """
    if isinstance(adjacency, Topology):
        adj = adjacency.adjacency
    else:
        adj = np.array(adjacency, dtype=bool)
        if adj.ndim != 2 or adj.shape[0] != adj.shape[1]:
            raise ValueError(f"adjacency must be a square matrix; got shape {adj.shape}")
        np.fill_diagonal(adj, False)
    left = np.ones(len(adj), dtype=bool)
    found = []
    while left.any():
        first = int(np.flatnonzero(left)[0])
        members = _reach(adj, first) & _reach(adj.T, first)
        found.append([int(i) for i in np.flatnonzero(members)])
        left &= ~members
    return found


def _check_rule(rule: object) -> str:
    if not isinstance(rule, str):
        raise TypeError(f"rule must be a str, one of {WEIGHT_RULES}; got {rule!r}")
    if rule not in WEIGHT_RULES:
        raise ValueError(f"rule must be one of {WEIGHT_RULES}; got {rule!r}")
    return rule


def _resolve_rule(topology: Topology, rule: str) -> str:
    """The rule ``"auto"`` stands for: the one that keeps the original's stochasticity."""
    if rule != "auto":
        return rule
    weights = topology.weights
    if is_doubly_stochastic(weights, _STOCHASTIC_ATOL):
        adj = topology.adjacency
        return "metropolis_hastings" if np.array_equal(adj, adj.T) else "sinkhorn"
    if is_column_stochastic(weights, _STOCHASTIC_ATOL):
        return "receive"
    if is_row_stochastic(weights, _STOCHASTIC_ATOL):
        return "send"
    raise TopologyError(
        f"rule='auto' needs a row or column stochastic topology; {topology!r} is neither: "
        f"pass rule= one of {WEIGHT_RULES[1:]}"
    )


def _normalise(sub: np.ndarray, axis: int) -> np.ndarray:
    """Scale columns (``axis=0``) or rows (``axis=1``) to sum 1; an empty one keeps itself."""
    out = sub.copy()
    empty = out.sum(axis=axis) == 0
    # Only a lone survivor with no self weight gets here (others would be disconnected).
    out[empty, empty] = 1.0
    return out / out.sum(axis=axis, keepdims=True)


def _sinkhorn(sub: np.ndarray) -> np.ndarray:
    out = _normalise(sub, 0)
    for _ in range(_SINKHORN_MAX_ITERATIONS):
        out = out / out.sum(axis=1, keepdims=True)
        out = out / out.sum(axis=0, keepdims=True)
        if np.abs(out.sum(axis=1) - 1.0).max() <= _SINKHORN_ATOL:
            return out
    raise TopologyError(
        "rule='sinkhorn' did not converge: the survivors' weights have no doubly stochastic "
        "scaling with the same edges (give every rank a self weight); use rule='receive' or "
        "rule='send'"
    )


def _reweight(sub: np.ndarray, rule: str) -> np.ndarray:
    if rule == "metropolis_hastings":
        adj = sub > 0
        np.fill_diagonal(adj, False)
        return metropolis_hastings_matrix(adj)
    if rule == "sinkhorn":
        return _sinkhorn(sub)
    return _normalise(sub, 0 if rule == "receive" else 1)


def _add_ring(sub: np.ndarray, fill: float) -> np.ndarray:
    """Both directions of the ring through the survivors (in rank order), where missing."""
    out = sub.copy()
    count = len(out)
    for k in range(count):
        nxt = (k + 1) % count
        if nxt != k:
            out[k, nxt] = out[k, nxt] or fill
            out[nxt, k] = out[nxt, k] or fill
    return out


def without(
    topology: Topology,
    ranks: int | Iterable[int],
    *,
    rule: str = "auto",
    connect: bool = False,
) -> Topology:
    """Return ``topology`` with ``ranks`` isolated and the survivors re-weighted.

    See :meth:`Topology.without`, which calls this.
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
    if not isinstance(connect, bool):
        raise TypeError(f"connect must be a bool; got {connect!r}")
    size = topology.size
    dead = dead_set(ranks, size)
    rule = _check_rule(rule)
    if not dead:
        return topology
    rule = _resolve_rule(topology, rule)
    alive = sorted(set(range(size)) - set(dead))
    if not alive:
        raise ValueError(f"ranks must leave at least one rank alive; got all {size} ranks")
    if rule == "metropolis_hastings" and not np.array_equal(
        topology.adjacency, topology.adjacency.T
    ):
        raise TopologyError(
            f"rule='metropolis_hastings' needs an undirected (symmetric) graph; {topology!r} is "
            "directed: use rule='sinkhorn', 'receive' or 'send'"
        )
    sub = topology.weights[np.ix_(alive, alive)].copy()
    adj = sub > 0
    np.fill_diagonal(adj, False)
    parts = connected_components(adj)
    if len(parts) > 1:
        named = [[alive[i] for i in part] for part in parts]
        if not connect:
            raise TopologyError(
                f"the survivors of {topology!r} without ranks {list(dead)} are not connected; "
                f"components: {named}. Pass connect=True to add a ring through the survivors"
            )
        off = topology.weights[~np.eye(size, dtype=bool)]
        positive = off[off > 0]
        sub = _add_ring(sub, float(positive.min()) if positive.size else 1.0)
    weights = np.eye(size)
    weights[np.ix_(alive, alive)] = _reweight(sub, rule)
    label = topology.name or f"topology({size})"
    return Topology(weights, name=f"{label}.without({list(dead)})")
