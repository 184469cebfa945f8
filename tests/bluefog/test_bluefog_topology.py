"""BlueFog's CamelCase topology helpers, checked against BlueFog's definitions written out here."""

import itertools
import math

import networkx as nx
import numpy as np
import pytest

import gossamer.bluefog as bf
from gossamer.testing import run_distributed

SIZES = range(1, 10)


# ---------------------------------------------------------------- BlueFog's formulas, verbatim
def _circulant(x):
    x = np.asarray(x, dtype=float)
    x /= x.sum()
    return np.stack([np.roll(x, i) for i in range(len(x))])


def _is_power(k, base):
    return k >= 1 and base ** round(math.log(k, base)) == k


def ref_exponential(n, base=2):
    return _circulant([1.0 if k == 0 or _is_power(k, base) else 0.0 for k in range(n)])


def ref_symmetric_exponential(n, base=4):
    x = [0.0] * n
    x[0] = 1.0
    for k in range(1, n):
        index = k if k <= n // 2 else n - k
        x[k] = 1.0 if _is_power(index, base) else 0.0
    return _circulant(x)


def ref_mesh(n):
    nrow = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
    ncol = n // nrow
    adj = np.eye(n)
    for i in range(n):
        r, c = divmod(i, ncol)
        for rr, cc in ((r + 1, c), (r - 1, c), (r, c + 1), (r, c - 1)):
            if 0 <= rr < nrow and 0 <= cc < ncol:
                adj[i, rr * ncol + cc] = 1
    deg = adj.sum(axis=1)  # counts the node itself, as BlueFog
    W = np.zeros((n, n))
    for i, j in itertools.product(range(n), repeat=2):
        if i != j and adj[i, j]:
            W[i, j] = 1 / max(deg[i], deg[j])
    W[np.diag_indices(n)] = 1 - W.sum(axis=1)
    return W


def ref_star(n, c=0):
    W = np.zeros((n, n))
    for i in range(n):
        W[i, i] = 1 - 1 / n
    W[c, :] = W[:, c] = 1 / n
    return W


def ref_ring(n, style=0):
    if n == 1:
        return np.ones((1, 1))
    if n == 2:
        return np.full((2, 2), 0.5)
    x = np.zeros(n)
    x[0] = 1
    if style in (0, 1):
        x[-1] = 1
    if style in (0, 2):
        x[1] = 1
    return _circulant(x)


CASES = {
    "exponential": (bf.ExponentialGraph, ref_exponential),
    "exponential3": (lambda n: bf.ExponentialGraph(n, base=3), lambda n: ref_exponential(n, 3)),
    "exponential_two": (bf.ExponentialTwoGraph, ref_exponential),
    "symmetric_exponential": (bf.SymmetricExponentialGraph, ref_symmetric_exponential),
    "mesh": (bf.MeshGrid2DGraph, ref_mesh),
    "star": (bf.StarGraph, ref_star),
    "star_center_last": (
        lambda n: bf.StarGraph(n, center_rank=n - 1),
        lambda n: ref_star(n, n - 1),
    ),
    "ring": (bf.RingGraph, ref_ring),
    "ring_left": (lambda n: bf.RingGraph(n, 1), lambda n: ref_ring(n, 1)),
    "ring_right": (lambda n: bf.RingGraph(n, connect_style=2), lambda n: ref_ring(n, 2)),
    "full": (bf.FullyConnectedGraph, lambda n: np.full((n, n), 1 / n)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_graphs_match_bluefogs_definition(name):
    make, reference = CASES[name]
    for n in SIZES:
        graph = make(n)
        assert isinstance(graph, nx.DiGraph)
        assert list(graph.nodes) == list(range(n))
        expected = reference(n)
        np.testing.assert_allclose(nx.to_numpy_array(graph), expected, rtol=0, atol=1e-15)
        assert graph.number_of_edges() == np.count_nonzero(expected)
        assert all(graph.has_edge(i, i) for i in range(n)), "BlueFog graphs have self-loops"


def test_bad_arguments_raise_value_errors():
    with pytest.raises(ValueError, match="connect_style"):
        bf.RingGraph(4, connect_style=3)
    with pytest.raises(ValueError, match="shape"):
        bf.MeshGrid2DGraph(6, shape=(4, 2))
    with pytest.raises(TypeError, match="DiGraph"):
        bf.GetRecvWeights(np.eye(3), 0)


def test_equivalence_and_regularity():
    assert bf.IsTopologyEquivalent(bf.RingGraph(5), bf.RingGraph(5))
    assert bf.IsTopologyEquivalent(bf.ExponentialTwoGraph(8), bf.ExponentialGraph(8))
    assert not bf.IsTopologyEquivalent(bf.RingGraph(5), None)
    assert not bf.IsTopologyEquivalent(None, None)
    assert not bf.IsTopologyEquivalent(bf.RingGraph(5), bf.RingGraph(6))
    assert not bf.IsTopologyEquivalent(bf.RingGraph(5), bf.RingGraph(5, 1))
    reweighted = bf.RingGraph(5)
    reweighted[0][1]["weight"] = 0.5
    assert not bf.IsTopologyEquivalent(bf.RingGraph(5), reweighted)
    assert bf.IsRegularGraph(bf.RingGraph(6))
    assert bf.IsRegularGraph(bf.ExponentialTwoGraph(6))
    assert not bf.IsRegularGraph(bf.StarGraph(4))
    assert not bf.IsRegularGraph(bf.MeshGrid2DGraph(6))


@pytest.mark.parametrize("name", ["mesh", "star", "exponential", "ring_left"])
def test_recv_and_send_weights_read_columns_and_rows(name):
    make, reference = CASES[name]
    n = 6
    W = reference(n)
    for rank in range(n):
        self_weight, src = bf.GetRecvWeights(make(n), rank)
        assert self_weight == pytest.approx(W[rank, rank])
        assert src == pytest.approx({i: W[i, rank] for i in range(n) if i != rank and W[i, rank]})
        self_weight, dst = bf.GetSendWeights(make(n), rank)
        assert dst == pytest.approx({j: W[rank, j] for j in range(n) if j != rank and W[rank, j]})
    graph = nx.DiGraph([(0, 1), (1, 0)])  # no self-loop: self weight 0
    assert bf.GetRecvWeights(graph, 0) == (0.0, {1: 1.0})


def _one_peer_reference(W, rank, steps):
    """BlueFog's GetDynamicOnePeerSendRecvRanks, written from its description."""
    n = len(W)
    succ = [
        sorted((j for j in range(n) if j != r and W[r, j]), key=lambda j: (j - r) % n)
        for r in range(n)
    ]
    out = []
    for k in range(steps):
        picks = [s[k % len(s)] for s in succ]
        out.append(([picks[rank]], [r for r in range(n) if picks[r] == rank]))
    return out


@pytest.mark.parametrize("n", [2, 5, 8])
def test_dynamic_one_peer_schedule(n):
    for rank in range(n):
        for graph, W in (
            (bf.ExponentialTwoGraph(n), ref_exponential(n)),
            (bf.RingGraph(n), ref_ring(n)),
        ):
            gen = bf.GetDynamicOnePeerSendRecvRanks(graph, rank)
            assert [next(gen) for _ in range(7)] == _one_peer_reference(W, rank, 7)


def test_machine_and_inner_outer_schedules():
    gen = bf.GetExp2DynamicSendRecvMachineRanks(16, 2, 0, 0)  # 8 machines, machine 0
    assert [next(gen) for _ in range(4)] == [([1], [7]), ([2], [6]), ([4], [4]), ([1], [7])]
    gen = bf.GetExp2DynamicSendRecvMachineRanks(12, 4, 5, 1)  # 3 machines, machine 1
    assert [next(gen) for _ in range(3)] == [([2], [0]), ([0], [2]), ([2], [0])]
    with pytest.raises(ValueError, match="local_rank"):
        bf.GetExp2DynamicSendRecvMachineRanks(16, 2, 3, 0)
    gen = bf.GetInnerOuterRingDynamicSendRecvRanks(8, 4, 0)
    assert [next(gen)[0] for _ in range(4)] == [[4], [2], [1], [1]]
    gen = bf.GetInnerOuterExpo2DynamicSendRecvRanks(16, 4, 0)
    send, recv = next(gen)  # step 0: local rank 0 is the outside rank, 1 machine ahead
    assert (send, recv) == ([4], [12])
    with pytest.raises(ValueError, match="local_size"):
        bf.GetInnerOuterRingDynamicSendRecvRanks(8, 2, 0)


# ---------------------------------------------------------------- collective inference
def _infer(names):
    out = {}
    for name in names:
        graph = CASES[name][0](bf.size())
        W = nx.to_numpy_array(graph)
        me = bf.rank()
        dsts = [j for j in range(bf.size()) if j != me and W[me, j]]
        srcs = np.random.default_rng(me).permutation(
            [i for i in range(bf.size()) if i != me and W[i, me]]
        )
        out[name] = (
            bf.InferSourceFromDestinationRanks(dsts),
            bf.InferSourceFromDestinationRanks(dsts, construct_adjacency_matrix=True),
            bf.InferDestinationFromSourceRanks(srcs, construct_adjacency_matrix=True),
        )
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_infer_sources_and_destinations(world_size):
    names = ["exponential", "ring", "ring_right", "star", "mesh", "full"]
    got = run_distributed(_infer, world_size, args=(names,))
    for name in names:
        A = CASES[name][1](world_size) > 0  # with self-loops
        W = A / A.sum(axis=0, keepdims=True)  # every column sums to 1
        for rank, per_name in enumerate(got):
            plain, (srcs, W_src), (dsts, W_dst) = per_name[name]
            expected_srcs = [i for i in range(world_size) if i != rank and A[i, rank]]
            assert plain == srcs == expected_srcs
            assert dsts == [j for j in range(world_size) if j != rank and A[rank, j]]
            np.testing.assert_allclose(W_src, W, rtol=0, atol=1e-15)
            np.testing.assert_allclose(W_dst, W, rtol=0, atol=1e-15)


def _infer_bad():
    errors = []
    for bad in ([bf.rank()], [bf.size()], [0, 0] if bf.rank() else [1, 1]):
        try:
            bf.InferSourceFromDestinationRanks(bad)
        except ValueError as err:
            errors.append(str(err))
    return errors


def test_infer_rejects_bad_ranks_before_communicating():
    for errors in run_distributed(_infer_bad, 2):
        assert len(errors) == 3
