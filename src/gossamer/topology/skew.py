"""Peer clumping: cluster ranks by proxy statistics, then give every rank mixed neighbours."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from gossamer.topology.topology import Topology, as_finite_matrix, check_int, check_rank
from gossamer.topology.weights import metropolis_hastings_matrix

__all__ = ["PeerClumping", "peer_clumping"]

_RESTARTS = 8


@dataclass(frozen=True)
class PeerClumping:
    """Result of :func:`peer_clumping`: the weighted graph and each rank's cluster.

    Attributes:
        topology: The regular graph with doubly stochastic weights.
        clusters: ``clusters[r]`` is rank ``r``'s cluster ("clump") id, numbered
            ``0, 1, ...`` in order of each cluster's smallest rank.
    """

    topology: Topology
    clusters: tuple[int, ...]

    def cluster_of(self, rank: int) -> tuple[int, ...]:
        """Return the ranks in ``rank``'s cluster (``rank`` included), sorted.

        Raises:
            TypeError: ``rank`` is not an int.
            ValueError: ``rank`` is outside ``[0, size)``.
        """
        rank = check_rank(rank, self.topology.size)
        return tuple(r for r, c in enumerate(self.clusters) if c == self.clusters[rank])


def _as_features(features: Any) -> np.ndarray:
    return as_finite_matrix(features, "features", "ranks x d")


def _kmeans(points: np.ndarray, k: int, rng: np.random.Generator, iterations: int) -> np.ndarray:
    """Lloyd's k-means from k-means++ seeds, best of a few restarts; labels per point."""
    best_labels, best_inertia = np.zeros(len(points), dtype=np.int64), np.inf
    for _ in range(_RESTARTS):
        centers = [points[rng.integers(len(points))]]
        for _ in range(1, k):
            dist2 = ((points[:, None, :] - np.array(centers)[None]) ** 2).sum(-1).min(axis=1)
            # Identical points leave no mass to sample by: fall back to a uniform draw.
            weights = dist2 / dist2.sum() if dist2.sum() > 0 else None
            centers.append(points[rng.choice(len(points), p=weights)])
        centers = np.array(centers)
        for _ in range(iterations):
            labels = ((points[:, None, :] - centers[None]) ** 2).sum(-1).argmin(axis=1)
            moved = np.array(
                [
                    points[labels == j].mean(axis=0) if np.any(labels == j) else centers[j]
                    for j in range(k)
                ]
            )
            if np.allclose(moved, centers, rtol=0, atol=1e-12):
                break
            centers = moved
        labels = ((points[:, None, :] - centers[None]) ** 2).sum(-1).argmin(axis=1)
        inertia = ((points - centers[labels]) ** 2).sum()
        if inertia < best_inertia - 1e-12:
            best_labels, best_inertia = labels, inertia
    # Canonical ids: in order of each cluster's smallest member.
    _, first = np.unique(best_labels, return_index=True)
    renumber = {int(best_labels[i]): new for new, i in enumerate(sorted(first))}
    return np.array([renumber[int(c)] for c in best_labels], dtype=np.int64)


def _interleave(clusters: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Order ranks around a circle so that every cluster is spread evenly over it."""
    keys = np.empty(len(clusters))
    for c in np.unique(clusters):
        members = np.flatnonzero(clusters == c)
        # Member m of a cluster of s sits at (m + 1/2) / s: evenly spaced, so two members
        # of one cluster are about n / s places apart.
        keys[rng.permutation(members)] = (np.arange(len(members)) + 0.5) / len(members)
    return np.lexsort((clusters, keys))


def peer_clumping(
    features: Any,
    degree: int,
    seed: int = 0,
    *,
    num_clusters: int | None = None,
    iterations: int = 100,
) -> PeerClumping:
    """Build a locally heterogeneous regular graph from per-rank proxy statistics.

    Follows the idea of Abebe and Jannesari, *Addressing Data Heterogeneity in
    Decentralized Learning via Topological Pre-processing* (arXiv:2212.08743): ranks are
    first clustered into "clumps" of similar data, judged from a proxy that shares no
    labels (e.g. each rank's model outputs averaged over one public proxy batch, after a
    few local steps), and the training graph then links every rank to ranks of other
    clumps, since locally heterogeneous neighbourhoods converge faster than homogeneous
    ones under skew. What is implemented here (the paper's exact procedure is not
    reproduced):

    1. **Clumps**: k-means on the rows of ``features`` (k-means++ seeding, Lloyd
       iterations, best of 8 restarts by inertia), ``num_clusters`` clusters.
    2. **Order**: the ranks are placed on a circle so that each cluster is spread evenly:
       member ``m`` of a cluster of size ``s`` gets the key ``(m + 1/2) / s`` and the ranks
       are sorted by key. With ``K`` equal clusters this is the round robin
       ``c_0, c_1, ..., c_{K-1}, c_0, ...``.
    3. **Graph**: each rank is linked to the ``degree // 2`` ranks on each side of it on
       the circle, plus the opposite rank when ``degree`` is odd: a ``degree``-regular
       circulant in that order. For an even ``degree`` a closed neighbourhood is
       ``degree + 1`` consecutive ranks, so with ``K = degree + 1`` equal clusters every
       neighbourhood holds one rank of every cluster (the opposite rank added for an odd
       degree may repeat a cluster).
    4. **Weights**: Metropolis-Hastings, here uniform ``1 / (degree + 1)``: symmetric and
       doubly stochastic.

    The circulant keeps the degree (hence the communication cost) fixed but mixes like a
    ring: its spectral gap shrinks as ``size`` grows at fixed ``degree``.

    Args:
        features: ``(num_ranks, d)`` finite numbers, one row per rank (array or tensor),
            the same on every rank (e.g. gathered with :func:`gossamer.allgather`).
        degree: Neighbours per rank (self excluded), ``1 <= degree <= num_ranks - 1``;
            at least 2 for more than 2 ranks (1 would disconnect the graph); even when
            ``num_ranks`` is odd. A single rank takes ``degree=0``.
        seed: Seed of k-means and of the order inside each cluster, ``>= 0``.
        num_clusters: Clusters, ``1 <= num_clusters <= num_ranks``; ``None`` means
            ``min(degree + 1, num_ranks)``.
        iterations: Most Lloyd iterations per restart, ``>= 1``.

    Returns:
        ``PeerClumping(topology, clusters)``; the topology is named
        ``"peer_clumping(<n>, degree=<d>, num_clusters=<k>, seed=<s>)"``.

    Raises:
        TypeError: ``features`` is not numeric, or an int argument is not an int.
        ValueError: ``features`` is not 2-D or not finite, or an int is out of range.

    Example:
        >>> feats = [[0.0], [0.1], [5.0], [5.1]]
        >>> result = peer_clumping(feats, degree=2, num_clusters=2)
        >>> result.clusters
        (0, 0, 1, 1)
        >>> result.topology.in_neighbors(0)  # both of the other clump
        (2, 3)
    """
    points = _as_features(features)
    size = len(points)
    degree = check_int(degree, "degree", minimum=0)
    if size == 1 and degree != 0:
        raise ValueError(f"degree must be 0 for a single rank; got {degree}")
    if size > 1 and not 1 <= degree <= size - 1:
        raise ValueError(f"degree must be in [1, {size - 1}] for {size} ranks; got {degree}")
    if size > 2 and degree < 2:
        raise ValueError(f"degree must be >= 2 for {size} ranks (1 disconnects); got {degree}")
    if degree % 2 and size % 2:
        raise ValueError(
            f"degree must be even when the number of ranks ({size}) is odd; got {degree}"
        )
    seed = check_int(seed, "seed", minimum=0)
    if num_clusters is None:
        num_clusters = min(degree + 1, size)
    num_clusters = check_int(num_clusters, "num_clusters", minimum=1)
    if num_clusters > size:
        raise ValueError(
            f"num_clusters must be <= the number of ranks ({size}); got {num_clusters}"
        )
    iterations = check_int(iterations, "iterations", minimum=1)

    rng = np.random.default_rng(seed)
    clusters = _kmeans(points, num_clusters, rng, iterations)
    order = _interleave(clusters, rng)
    offsets = list(range(1, degree // 2 + 1)) + ([size // 2] if degree % 2 else [])
    adj = np.zeros((size, size), dtype=bool)
    for position, rank in enumerate(order):
        for offset in offsets:
            other = order[(position + offset) % size]
            adj[rank, other] = adj[other, rank] = True
    name = f"peer_clumping({size}, degree={degree}, num_clusters={num_clusters}, seed={seed})"
    return PeerClumping(
        topology=Topology(metropolis_hastings_matrix(adj), name=name),
        clusters=tuple(int(c) for c in clusters),
    )
