"""D-Cliques and peer clumping against properties checked independently of the code."""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np
import pytest
import torch

from gossamer.data import label_histograms, shards
from gossamer.topology import DCliques, PeerClumping, d_cliques, peer_clumping

INTERS = ["ring", "fractal", "small_world", "fully_connected"]


def shard_histograms(num_ranks: int, classes_per_rank: int = 2, seed: int = 0) -> np.ndarray:
    """Label counts of ``num_ranks`` ranks holding 2 of 10 balanced classes each."""
    labels = np.repeat(np.arange(10), 120)
    return label_histograms(shards(labels, num_ranks, classes_per_rank, seed), labels)


def clique_tv(histograms: np.ndarray, members) -> float:
    """TV distance between a clique's mean label mix and the mean over all ranks."""
    mixes = histograms / histograms.sum(axis=1, keepdims=True)
    clique = mixes[list(members)].mean(axis=0)
    return 0.5 * float(np.abs(clique - mixes.mean(axis=0)).sum())


def edges_of(weights: np.ndarray) -> set[tuple[int, int]]:
    n = len(weights)
    return {(i, j) for i in range(n) for j in range(i + 1, n) if weights[i, j] > 0}


def is_connected(weights: np.ndarray) -> bool:
    seen, todo = {0}, deque([0])
    while todo:
        i = todo.popleft()
        for j in np.flatnonzero(weights[i]):
            if int(j) not in seen:
                seen.add(int(j))
                todo.append(int(j))
    return len(seen) == len(weights)


def reference_metropolis(weights: np.ndarray) -> np.ndarray:
    """W[i, j] = 1 / (1 + max(d_i, d_j)) on edges, the rest on the diagonal."""
    n = len(weights)
    adjacent = (weights > 0) & ~np.eye(n, dtype=bool)
    degree = adjacent.sum(axis=1)
    out = np.zeros((n, n))
    for i, j in itertools.permutations(range(n), 2):
        if adjacent[i, j]:
            out[i, j] = 1.0 / (1 + max(degree[i], degree[j]))
    for i in range(n):
        out[i, i] = 1.0 - out[i].sum()
    return out


def check_weights(weights: np.ndarray) -> None:
    np.testing.assert_allclose(weights.sum(axis=0), 1.0, atol=1e-12)
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, atol=1e-12)
    np.testing.assert_allclose(weights, weights.T, atol=0)
    np.testing.assert_allclose(weights, reference_metropolis(weights), atol=1e-12)
    assert is_connected(weights)


# --- D-Cliques -------------------------------------------------------------------------------


@pytest.mark.parametrize("inter", INTERS)
@pytest.mark.parametrize("num_ranks", [20, 50, 100])
def test_d_cliques_on_two_classes_per_rank(num_ranks, inter):
    histograms = shard_histograms(num_ranks)
    result = d_cliques(histograms, clique_size=10, inter=inter, seed=1)
    assert isinstance(result, DCliques)
    weights = result.topology.weights
    # The cliques partition the ranks into ceil(n / 10) near-equal groups.
    assert sorted(itertools.chain(*result.cliques)) == list(range(num_ranks))
    assert len(result.cliques) == -(-num_ranks // 10)
    assert all(len(c) == 10 for c in result.cliques)
    # 10 ranks x 2 classes can hold every class twice: the paper's balanced cliques.
    assert max(clique_tv(histograms, c) for c in result.cliques) <= 0.1
    for clique in result.cliques:
        assert all(weights[i, j] > 0 for i, j in itertools.combinations(clique, 2))
        assert result.clique_of(clique[-1]) == clique
    check_weights(weights)


@pytest.mark.parametrize(("num_ranks", "clique_size"), [(30, 10), (64, 8), (37, 5)])
def test_greedy_swap_beats_random_cliques(num_ranks, clique_size):
    histograms = shard_histograms(num_ranks)
    greedy = d_cliques(histograms, clique_size, seed=0)
    greedy_tv = np.mean([clique_tv(histograms, c) for c in greedy.cliques])
    random_tvs = []
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(num_ranks)
        cliques = np.array_split(order, len(greedy.cliques))
        random_tvs.append(np.mean([clique_tv(histograms, c) for c in cliques]))
    assert greedy_tv < 0.6 * np.mean(random_tvs)
    # steps=0 is the random starting point, and the swaps only ever lower the skew.
    start = d_cliques(histograms, clique_size, seed=0, steps=0)
    assert greedy_tv < np.mean([clique_tv(histograms, c) for c in start.cliques])
    assert max(len(c) for c in greedy.cliques) <= clique_size
    assert max(len(c) for c in greedy.cliques) - min(len(c) for c in greedy.cliques) <= 1


def inter_clique_edges(result: DCliques) -> list[tuple[int, int]]:
    """Pairs of clique numbers joined by each inter-clique edge."""
    where = {r: k for k, clique in enumerate(result.cliques) for r in clique}
    return [
        tuple(sorted((where[i], where[j])))
        for i, j in edges_of(result.topology.weights)
        if where[i] != where[j]
    ]


@pytest.mark.parametrize("num_cliques", [3, 6, 11])
def test_ring_of_cliques_has_one_edge_between_consecutive_cliques(num_cliques):
    result = d_cliques(shard_histograms(4 * num_cliques), 4, "ring", seed=2)
    pairs = inter_clique_edges(result)
    assert len(pairs) == num_cliques
    graph_of_cliques = np.zeros((num_cliques, num_cliques))
    for a, b in pairs:
        graph_of_cliques[a, b] = graph_of_cliques[b, a] = 1
    assert (graph_of_cliques.sum(axis=1) == 2).all()  # a cycle through all cliques
    assert is_connected(graph_of_cliques)
    # The two edges of a clique leave from two different members.
    weights = result.topology.weights
    for clique in result.cliques:
        outside = [
            sum(weights[r, j] > 0 for j in range(len(weights)) if j not in clique) for r in clique
        ]
        assert max(outside) == 1


def test_fully_connected_and_fractal_inter_clique_edge_counts():
    histograms = shard_histograms(30)
    full = d_cliques(histograms, 3, "fully_connected", seed=0)
    assert sorted(inter_clique_edges(full)) == list(itertools.combinations(range(10), 2))
    # Fractal, 10 cliques of 3: groups of 3 cliques -> 3+3+3+0 edges, then 4 groups -> 3+0,
    # then 2 -> 1: 13 edges in all.
    fractal = d_cliques(histograms, 3, "fractal", seed=0)
    assert len(inter_clique_edges(fractal)) == 13
    check_weights(fractal.topology.weights)
    ring = d_cliques(histograms, 3, "ring", seed=0)
    small = d_cliques(histograms, 3, "small_world", seed=0)
    assert len(inter_clique_edges(ring)) < len(inter_clique_edges(small))


@pytest.mark.parametrize("inter", INTERS)
def test_two_cliques_are_joined_by_one_edge_at_most(inter):
    result = d_cliques(shard_histograms(64), 2, inter, seed=1)  # 32 cliques
    pairs = inter_clique_edges(result)
    assert len(pairs) == len(set(pairs))


def test_small_world_links_the_pairs_at_its_ring_distances():
    # 32 cliques on a ring, each linked at distances 2^s + e (s < 5, e in {0, 1}), both
    # ways: ring distances {1, 2, 3, 4, 5, 8, 9, 15, 16} (17 is 15 the other way round).
    distances = {min(d % 32, -d % 32) for s in range(5) for d in (2**s, 2**s + 1)}
    expected = {
        (a, b)
        for a, b in itertools.combinations(range(32), 2)
        if b - a in distances or 32 - (b - a) in distances
    }
    result = d_cliques(shard_histograms(64), 2, "small_world", seed=1)
    assert len(inter_clique_edges(result)) == len(expected) == 32 * 8 + 16
    assert is_connected(result.topology.weights)


def test_d_cliques_edge_cases_and_determinism():
    histograms = shard_histograms(20)
    first = d_cliques(histograms, 10, "small_world", seed=4)
    assert first == d_cliques(histograms.tolist(), 10, "small_world", seed=4)
    assert first.cliques != d_cliques(histograms, 10, "small_world", seed=5).cliques
    single = d_cliques(histograms[:7], 10)
    assert single.cliques == (tuple(range(7)),)
    np.testing.assert_allclose(single.topology.weights, np.full((7, 7), 1 / 7))
    alone = d_cliques(histograms[:5], 1, "ring")  # cliques of one: a ring of ranks
    assert len(edges_of(alone.topology.weights)) == 5
    assert d_cliques([[3, 1]], 4).topology.size == 1
    assert first.topology.name == "d_cliques(20, clique_size=10, inter='small_world', seed=4)"


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"clique_size": 0}, ValueError, "clique_size must be >= 1; got 0"),
        ({"clique_size": 2.5}, TypeError, "clique_size must be an int; got 2.5"),
        ({"inter": "star"}, ValueError, "inter must be one of .*; got 'star'"),
        ({"steps": -1}, ValueError, "steps must be >= 0; got -1"),
        ({"seed": -2}, ValueError, "seed must be >= 0; got -2"),
        ({"label_histograms": [1, 2]}, ValueError, r"must be 2-D .*got shape \(2,\)"),
        ({"label_histograms": [[1, -1]]}, ValueError, "must be finite and >= 0"),
        ({"label_histograms": [[1, 0], [0, 0]]}, ValueError, "row 1 is all zero"),
        ({"label_histograms": "counts"}, TypeError, "label_histograms must be a 2-D array"),
        ({"label_histograms": [[1 + 2j, 0], [0, 1]]}, TypeError, "must hold real numbers"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_d_cliques_errors_name_argument_and_value(kwargs, error, match):
    arguments = {"label_histograms": [[1, 0], [0, 1]], "clique_size": 2, **kwargs}
    with pytest.raises(error, match=match):
        d_cliques(**arguments)


# --- peer clumping ---------------------------------------------------------------------------


def blobs(group_sizes: list[int], seed: int = 0, dim: int = 6) -> tuple[np.ndarray, np.ndarray]:
    """Well separated Gaussian blobs, rows shuffled; returns (features, true group)."""
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(len(group_sizes), dim)) * 10
    groups = rng.permutation(np.repeat(np.arange(len(group_sizes)), group_sizes))
    return centers[groups] + rng.normal(size=(len(groups), dim)) * 0.1, groups


def neighbourhood_clusters(result: PeerClumping, rank: int) -> set[int]:
    members = {rank, *result.topology.in_neighbors(rank)}
    return {result.clusters[r] for r in members}


def same_partition(a, b) -> bool:
    return all(
        (a[i] == a[j]) == (b[i] == b[j]) for i, j in itertools.combinations(range(len(a)), 2)
    )


@pytest.mark.parametrize(
    ("num_clusters", "per_cluster", "degree"), [(3, 4, 2), (5, 4, 4), (4, 6, 3), (7, 5, 6)]
)
def test_peer_clumping_on_equal_clusters_mixes_every_neighbourhood(
    num_clusters, per_cluster, degree
):
    features, groups = blobs([per_cluster] * num_clusters, seed=num_clusters)
    result = peer_clumping(features, degree, seed=0, num_clusters=num_clusters)
    assert same_partition(result.clusters, groups)
    size = num_clusters * per_cluster
    for rank in range(size):
        assert len(result.topology.in_neighbors(rank)) == degree
        expected = min(num_clusters, degree + 1 - degree % 2)  # odd: the opposite may repeat
        assert len(neighbourhood_clusters(result, rank)) >= expected
        assert set(result.cluster_of(rank)) == set(np.flatnonzero(groups == groups[rank]))
    check_weights(result.topology.weights)
    np.testing.assert_allclose(
        result.topology.weights[result.topology.weights > 0].min(), 1 / (degree + 1)
    )


@pytest.mark.parametrize("degree", [2, 4])
def test_peer_clumping_on_unequal_clusters_still_mixes(degree):
    features, groups = blobs([10, 4, 3, 3], seed=1)
    result = peer_clumping(torch.tensor(features), degree, seed=3, num_clusters=4)
    assert same_partition(result.clusters, groups)
    assert all(len(neighbourhood_clusters(result, r)) >= 2 for r in range(20))
    check_weights(result.topology.weights)


def test_peer_clumping_on_label_mixes_beats_a_homogeneous_ring():
    # Proxy features: each rank's label mix (what averaged model outputs approximate).
    histograms = shard_histograms(20, seed=2)
    mixes = histograms / histograms.sum(axis=1, keepdims=True)
    result = peer_clumping(mixes, degree=4, seed=0)

    def mean_neighbourhood_tv(neighbourhoods):
        return np.mean([clique_tv(histograms, n) for n in neighbourhoods])

    clumped = [{r, *result.topology.in_neighbors(r)} for r in range(20)]
    # The homogeneous alternative: the same circulant with similar ranks side by side.
    order = np.lexsort((np.arange(20), result.clusters))
    position = {int(r): p for p, r in enumerate(order)}
    ring = [{int(order[(position[r] + o) % 20]) for o in range(-2, 3)} for r in range(20)]
    assert mean_neighbourhood_tv(clumped) < 0.75 * mean_neighbourhood_tv(ring)


def test_peer_clumping_determinism_and_small_sizes():
    features, _ = blobs([5, 5, 5, 5], seed=2)
    first = peer_clumping(features, 3, seed=7)
    assert first == peer_clumping(features.tolist(), 3, seed=7)
    assert first.topology.name == "peer_clumping(20, degree=3, num_clusters=4, seed=7)"
    assert peer_clumping([[1.0]], 0).topology.size == 1
    pair = peer_clumping([[0.0], [1.0]], 1)
    np.testing.assert_allclose(pair.topology.weights, np.full((2, 2), 0.5))
    same = peer_clumping(np.ones((6, 2)), 2)  # identical features: nothing to separate
    check_weights(same.topology.weights)


@pytest.mark.parametrize(
    ("features", "kwargs", "error", "match"),
    [
        (np.zeros((5, 2)), {"degree": 3}, ValueError, r"degree must be even .*\(5\).*got 3"),
        (np.zeros((5, 2)), {"degree": 5}, ValueError, r"degree must be in \[1, 4\].*got 5"),
        (np.zeros((4, 2)), {"degree": 1}, ValueError, "degree must be >= 2 for 4 ranks.*got 1"),
        (np.zeros((1, 2)), {"degree": 1}, ValueError, "degree must be 0 for a single rank"),
        (np.zeros((4, 2)), {"degree": 2.0}, TypeError, "degree must be an int; got 2.0"),
        (np.zeros((4, 2)), {"degree": 2, "num_clusters": 5}, ValueError, r"<= .*\(4\); got 5"),
        (np.zeros((4, 2)), {"degree": 2, "num_clusters": 0}, ValueError, "num_clusters must be"),
        (np.zeros((4, 2)), {"degree": 2, "iterations": 0}, ValueError, "iterations must be"),
        (np.zeros(4), {"degree": 2}, ValueError, r"features must be 2-D .*shape \(4,\)"),
        (np.full((4, 2), np.nan), {"degree": 2}, ValueError, "features must be finite"),
        (None, {"degree": 2}, TypeError, "features must be a 2-D array"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_peer_clumping_errors_name_argument_and_value(features, kwargs, error, match):
    with pytest.raises(error, match=match):
        peer_clumping(features, **kwargs)
