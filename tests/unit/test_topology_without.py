"""Topology.without: dead ranks isolated, survivors re-weighted; skip_dead on schedules.

References are independent of the code under test: hand-computed matrices, a
Metropolis-Hastings rule written out with loops from networkx degrees, networkx's own
connectivity, and mixing simulated step by step from the full per-step matrices.
"""

import itertools
from functools import partial

import networkx as nx
import numpy as np
import pytest

from gossamer.errors import TopologyError
from gossamer.topology import (
    Step,
    Topology,
    connected_components,
    exponential_two,
    fully_connected,
    is_column_stochastic,
    is_doubly_stochastic,
    is_row_stochastic,
    mesh_grid_2d,
    one_peer_exponential,
    ring,
    skip_dead,
    spectral_gap,
    star,
)

GRAPHS = {
    "ring": ring,
    "exponential_two": exponential_two,
    "mesh": mesh_grid_2d,
    "fully_connected": fully_connected,
}
CASES = [
    (graph, size, dead)
    for graph in GRAPHS
    for size, dead in [(4, [1]), (6, [0]), (8, [2, 5]), (9, [4]), (12, [0, 7])]
]


def _alive(size, dead):
    return [r for r in range(size) if r not in dead]


def _survivor_graph(topology, dead):
    """networkx digraph of the surviving edges (the reference for connectivity)."""
    graph = topology.to_networkx()
    graph.remove_edges_from(nx.selfloop_edges(graph))
    graph.remove_nodes_from(dead)
    return graph


def _reference_mh(topology, dead, ring_too=False):
    """Metropolis-Hastings written out with loops over the surviving undirected graph."""
    graph = _survivor_graph(topology, dead).to_undirected()
    if ring_too:
        alive = _alive(topology.size, dead)
        graph.add_edges_from(zip(alive, alive[1:] + alive[:1], strict=True))
    W = np.eye(topology.size)
    for i in graph.nodes:
        W[i, i] = 1.0
        for j in graph.neighbors(i):
            W[i, j] = 1.0 / (1 + max(graph.degree(i), graph.degree(j)))
            W[i, i] -= W[i, j]
    return W


def _connected(topology, dead):
    graph = _survivor_graph(topology, dead)
    return nx.is_strongly_connected(graph)


@pytest.mark.parametrize(("graph", "size", "dead"), CASES)
def test_survivors_stay_doubly_stochastic_and_dead_ranks_are_isolated(graph, size, dead):
    original = GRAPHS[graph](size)
    if not _connected(original, dead):
        with pytest.raises(TopologyError, match="not connected; components"):
            original.without(dead)
        result = original.without(dead, connect=True)
    else:
        result = original.without(dead)
    W = result.weights
    assert result.size == size
    assert is_doubly_stochastic(result, atol=1e-11)
    for d in dead:
        expected = np.zeros(size)
        expected[d] = 1.0
        np.testing.assert_array_equal(W[d], expected)
        np.testing.assert_array_equal(W[:, d], expected)
    alive = _alive(size, dead)
    block = W[np.ix_(alive, alive)]
    assert spectral_gap(block) > 1e-6
    if _connected(original, dead):
        # Exactly the surviving edges: none added, none lost.
        np.testing.assert_array_equal(block > 0, original.weights[np.ix_(alive, alive)] > 0)


@pytest.mark.parametrize(("graph", "size", "dead"), [c for c in CASES if c[0] != "exponential_two"])
def test_undirected_graphs_get_metropolis_hastings(graph, size, dead):
    original = GRAPHS[graph](size)
    split = not _connected(original, dead)  # then the ring through the survivors is added
    np.testing.assert_allclose(
        original.without(dead, connect=split).weights,
        _reference_mh(original, dead, ring_too=split),
        atol=1e-15,
    )


def test_hand_computed_ring_of_four_without_rank_three():
    # The path 0 - 1 - 2: degrees 1, 2, 1; every edge 1/(1+2).
    third = 1 / 3
    expected = [
        [2 * third, third, 0, 0],
        [third, third, third, 0],
        [0, third, 2 * third, 0],
        [0, 0, 0, 1],
    ]
    result = ring(4).without([3])
    np.testing.assert_allclose(result.weights, expected, atol=1e-15)
    assert result.name == "ring(4, style='bidirectional').without([3])"
    assert ring(4).without(3) == result


def test_hand_computed_fully_connected_becomes_fully_connected_among_survivors():
    # Fully connected 5 without {1, 3}: the complete graph on {0, 2, 4}, all weights 1/3.
    W = fully_connected(5).without([3, 1]).weights
    alive = [0, 2, 4]
    np.testing.assert_allclose(W[np.ix_(alive, alive)], np.full((3, 3), 1 / 3), atol=1e-15)


def test_hand_computed_star_without_a_leaf():
    # Star of 4 (hub 0) without leaf 3: hub degree 2, leaves 1; edges 1/3, hub keeps 1/3.
    W = star(4).without([3]).weights
    np.testing.assert_allclose(W[0, :3], [1 / 3, 1 / 3, 1 / 3], atol=1e-15)
    np.testing.assert_allclose(W[1, :3], [1 / 3, 2 / 3, 0], atol=1e-15)


def test_directed_graphs_keep_their_edges_under_sinkhorn():
    original = exponential_two(8)
    dead = [1, 5]
    result = original.without(dead)
    alive = _alive(8, dead)
    S0 = original.weights[np.ix_(alive, alive)]
    S = result.weights[np.ix_(alive, alive)]
    np.testing.assert_array_equal(S > 0, S0 > 0)
    assert is_doubly_stochastic(result, atol=1e-11)
    # S = D1 S0 D2: the ratio S / S0 is a_i * b_j on the support, so every rectangle of
    # support entries has equal cross products.
    ratio = np.where(S0 > 0, S / np.where(S0 > 0, S0, 1), np.nan)
    for i, k in itertools.combinations(range(len(alive)), 2):
        for j, m in itertools.combinations(range(len(alive)), 2):
            corners = [ratio[i, j], ratio[k, m], ratio[i, m], ratio[k, j]]
            if not np.any(np.isnan(corners)):
                assert corners[0] * corners[1] == pytest.approx(corners[2] * corners[3], rel=1e-9)


def test_receive_and_send_rules_hand_computed():
    # Directed ring 0 -> 1 -> 2 -> 3 -> 0 with self weights 1/2, rank 3 dead: the path
    # 0 -> 1 -> 2 is not strongly connected, so the ring is added: 0 <-> 1 <-> 2 <-> 0.
    W = np.zeros((4, 4))
    for i in range(4):
        W[i, i] = W[i, (i + 1) % 4] = 0.5
    topo = Topology(W, name="directed ring")
    with pytest.raises(TopologyError, match=r"components: \[\[0\], \[1\], \[2\]\]"):
        topo.without([3], rule="receive")
    recv = topo.without([3], rule="receive", connect=True).weights
    # Survivors' block before normalising: 1/2 on the diagonal and on every ring edge.
    np.testing.assert_allclose(recv[:3, :3], np.full((3, 3), 1 / 3), atol=1e-15)
    # A user matrix that is only column stochastic: receive weights renormalised.
    C = np.array([[0.5, 0.5, 0.2], [0.25, 0.5, 0.3], [0.25, 0.0, 0.5]])
    got = Topology(C).without([2]).weights
    np.testing.assert_allclose(got[:2, :2], [[2 / 3, 0.5], [1 / 3, 0.5]], atol=1e-15)
    assert is_column_stochastic(got)
    got = Topology(C.T).without([2]).weights
    np.testing.assert_allclose(got[:2, :2], [[2 / 3, 1 / 3], [0.5, 0.5]], atol=1e-15)
    assert is_row_stochastic(got)


def test_connect_adds_the_ring_through_the_survivors():
    # ring(6) without {0, 3}: components {1, 2} and {4, 5}; the ring 1-2-4-5-1 joins them.
    with pytest.raises(TopologyError, match=r"components: \[\[1, 2\], \[4, 5\]\].*connect=True"):
        ring(6).without([0, 3])
    result = ring(6).without([0, 3], connect=True)
    alive = [1, 2, 4, 5]
    np.testing.assert_allclose(result.weights[np.ix_(alive, alive)], _cycle(4) / 3, atol=1e-15)


def _cycle(n):
    A = np.eye(n)
    for k in range(n):
        A[k, (k + 1) % n] = A[(k + 1) % n, k] = 1
    return A


def test_nothing_dead_returns_the_same_topology():
    topo = exponential_two(8)
    assert topo.without([]) is topo


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"ranks": [8]}, ValueError, r"ranks must be ranks in \[0, 8\) for size 8; got \[8\]"),
        ({"ranks": [-1, 2]}, ValueError, r"got \[-1\]"),
        ({"ranks": [1, 1]}, ValueError, r"ranks must not repeat a rank; got \[1, 1\]"),
        ({"ranks": ["1"]}, TypeError, "ranks entries must be an int; got '1'"),
        ({"ranks": "1"}, TypeError, "ranks must be a rank or an iterable of ranks; got '1'"),
        ({"ranks": 1.0}, TypeError, "got 1.0"),
        ({"ranks": range(8)}, ValueError, "at least one rank alive; got all 8"),
        ({"ranks": [1], "rule": "uniform"}, ValueError, "rule must be one of .*got 'uniform'"),
        ({"ranks": [1], "rule": 3}, TypeError, "rule must be a str"),
        ({"ranks": [1], "connect": 1}, TypeError, "connect must be a bool; got 1"),
    ],
)
def test_bad_arguments_name_the_argument_and_value(kwargs, error, match):
    ranks = kwargs.pop("ranks")
    with pytest.raises(error, match=match):
        ring(8).without(ranks, **kwargs)


def test_rule_mismatches_are_topology_errors():
    with pytest.raises(TopologyError, match="needs an undirected"):
        exponential_two(8).without([1], rule="metropolis_hastings")
    with pytest.raises(TopologyError, match="neither"):
        Topology(np.ones((3, 3))).without([1])


def test_connected_components_against_networkx():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A = rng.random((9, 9)) < 0.15
        expected = sorted(
            sorted(c) for c in nx.strongly_connected_components(nx.DiGraph(np.where(A, 1, 0)))
        )
        assert connected_components(A) == expected
    with pytest.raises(ValueError, match=r"square matrix; got shape \(2, 3\)"):
        connected_components(np.zeros((2, 3)))


# --- dynamic schedules ---------------------------------------------------------------


def _all_steps(size, dead, mode, count, schedule=None):
    """Step k of every rank, for k < count (dead may be a list that the caller grows)."""
    schedule = schedule or partial(one_peer_exponential, exponential_two(size))
    iters = [skip_dead(schedule, size, r, dead, mode=mode) for r in range(size)]
    return [[next(it) for it in iters] for _ in range(count)]


def _matrix(steps):
    """The step's mixing matrix W[i, j] (j receives from i), from every rank's Step."""
    W = np.zeros((len(steps), len(steps)))
    for j, step in enumerate(steps):
        W[j, j] = step.self_weight
        for i, w in step.src_weights.items():
            W[i, j] = w
    return W


def _check_consistent(steps, dead):
    for i, step in enumerate(steps):
        for d in step.send_ranks:
            assert i in steps[d].recv_ranks, f"rank {i} sends to {d}, which does not receive"
        for s in step.recv_ranks:
            assert i in steps[s].send_ranks, f"rank {i} waits for {s}, which does not send"
        if i in dead:
            assert step == Step((), (), 1.0, {}, {})
        else:
            assert not set(step.send_ranks + step.recv_ranks) & set(dead)


@pytest.mark.parametrize("size", [4, 8, 16])
@pytest.mark.parametrize("mode", ["bridge", "keep"])
def test_survivors_pair_only_with_survivors(size, mode):
    dead = [1] if size == 4 else [1, 2, size - 1]
    for steps in _all_steps(size, dead, mode, 12):
        _check_consistent(steps, dead)
        assert is_column_stochastic(_matrix(steps))


@pytest.mark.parametrize("size", [4, 8, 16])
def test_bridged_permutations_stay_doubly_stochastic_and_reach_the_survivors_mean(size):
    dead = [1] if size == 4 else [1, 2, size - 1]
    alive = _alive(size, dead)
    x = np.random.default_rng(size).normal(size=size)
    mean = x[alive].mean()
    for steps in _all_steps(size, dead, "bridge", 200):
        W = _matrix(steps)
        assert is_doubly_stochastic(W)
        x = W.T @ x
    np.testing.assert_allclose(x[alive], mean, atol=1e-9)


def test_hand_computed_bridge_and_keep_on_exponential_two_of_eight():
    # Step 0 is the shift by 1. Rank 1 is dead: 0's message to 1 goes on to 2 (bridge); with
    # keep, 0 sends nothing and 2 (which would have heard from 1) keeps its value.
    bridge = _all_steps(8, [1], "bridge", 3)
    assert bridge[0][0] == Step.uniform([2], [7])
    assert bridge[0][2] == Step.uniform([3], [0])
    assert bridge[1][7] == Step.uniform([3], [5])  # shift 2: 7 -> 1 -> 3
    keep = _all_steps(8, [1], "keep", 1)[0]
    assert keep[0] == Step.uniform([], [7])
    assert keep[2] == Step([3], [], 1.0, {}, {3: 1.0})


def test_a_dead_set_that_grows_takes_effect_at_the_next_step():
    dead = []
    iters = [
        skip_dead(partial(one_peer_exponential, exponential_two(8)), 8, r, dead) for r in range(8)
    ]
    first = [next(it) for it in iters]
    assert first[0].send_ranks == (1,)
    dead.append(1)
    for _ in range(5):
        _check_consistent([next(it) for it in iters], dead)


def test_bridge_through_several_dead_ranks_and_back_to_the_sender():
    # Ranks 1, 2, 3 dead in a shift by 1 of 5 ranks: 0's message hops 1 -> 2 -> 3 -> 4.
    shift = partial(_shift_schedule, 5)
    steps = _all_steps(5, [1, 2, 3], "bridge", 1, shift)[0]
    assert steps[0] == Step.uniform([4], [4])
    # Only rank 0 alive: its message comes back to itself and is dropped.
    steps = _all_steps(5, [1, 2, 3, 4], "bridge", 1, shift)[0]
    assert steps[0] == Step.uniform([], [])


def _shift_schedule(size, rank):
    while True:
        yield Step.uniform([(rank + 1) % size], [(rank - 1) % size])


def _fan_out(rank):
    while True:
        if rank == 0:
            yield Step.uniform([1, 2], [])
        else:
            yield Step.uniform([], [0])


def test_skip_dead_errors_name_the_argument_and_value():
    sched = partial(one_peer_exponential, exponential_two(4))
    with pytest.raises(ValueError, match=r"mode must be one of \('bridge', 'keep'\); got 'x'"):
        skip_dead(sched, 4, 0, [], mode="x")
    with pytest.raises(ValueError, match=r"dead must be ranks in \[0, 4\) for size 4; got \[4\]"):
        skip_dead(sched, 4, 0, [4])
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        skip_dead(sched, 4, 4, [])
    with pytest.raises(TypeError, match="schedule must be a callable"):
        skip_dead(iter([]), 4, 0, [])
    with pytest.raises(ValueError, match="dead rank 0 sends to \\(1, 2\\) at step 0"):
        next(skip_dead(_fan_out, 3, 1, [0]))
    assert next(skip_dead(_fan_out, 3, 1, [0], mode="keep")) == Step.uniform([], [])
