"""Fuzz gossamer.topology: the Topology value, the generators, the weight rules, schedules.

Pure numpy, so it runs in the test process. Valid arguments must give what the reference
below computes from the definitions in the docstrings; bad ones must raise TypeError or
ValueError (TopologyError) naming the argument.
"""

import itertools
import math

import networkx as nx
import numpy as np
from fuzz_cases import (
    FUZZ,
    Arg,
    bad,
    bad_float,
    bad_int,
    call,
    good,
    mostly,
    verdict,
)
from hypothesis import example, given
from hypothesis import strategies as st

from gossamer import topology as T
from gossamer.topology import Step, Topology

SIZES = st.integers(1, 24)


def sizes(maximum=24):
    return mostly(good(st.integers(1, maximum) | st.integers(1, 9).map(np.int64)), bad_int(1))


def is_power(value, base):
    while value % base == 0:
        value //= base
    return value == 1


def circulant(mask):
    row = np.asarray(mask, dtype=float)
    row /= row.sum()
    return np.stack([np.roll(row, i) for i in range(len(row))])


def assert_topology(topo, expected):
    np.testing.assert_allclose(topo.weights, expected, rtol=0, atol=1e-12)
    n = len(expected)
    for r in range(n):
        assert topo.in_neighbors(r) == tuple(i for i in range(n) if i != r and expected[i, r])
        assert topo.out_neighbors(r) == tuple(j for j in range(n) if j != r and expected[r, j])
        self_weight, src = topo.recv_weights(r)
        assert math.isclose(self_weight, expected[r, r], abs_tol=1e-12)
        assert src.keys() == set(topo.in_neighbors(r))


# ---------------------------------------------------------------------- Topology(...)
def square(n, elements):
    return st.lists(st.lists(elements, min_size=n, max_size=n), min_size=n, max_size=n)


WEIGHT = st.floats(0, 10, allow_subnormal=False) | st.just(0.0)


@st.composite
def weight_matrices(draw):
    n = draw(st.integers(1, 5))
    rows = draw(square(n, WEIGHT))
    form = draw(st.sampled_from(["list", "array", "int array"]))
    if form == "array":
        return Arg(np.array(rows))
    if form == "int array":
        return Arg(np.array(rows).round().astype(np.int64))
    return Arg(rows)


@st.composite
def bad_weight_matrices(draw):
    n = draw(st.integers(1, 4))
    rows = [list(r) for r in draw(square(n, WEIGHT))]
    kind = draw(st.sampled_from(["negative", "nan", "inf", "shape", "empty", "ragged", "type"]))
    i, j = draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))
    if kind == "negative":
        rows[i][j] = -draw(st.floats(1e-9, 1e9))
    elif kind == "nan":
        rows[i][j] = math.nan
    elif kind == "inf":
        rows[i][j] = math.inf
    elif kind == "shape":
        return Arg(np.ones((n, n + draw(st.integers(1, 2)))), "not square")
    elif kind == "empty":
        return Arg(draw(st.sampled_from([[], [[]], np.zeros((0, 0))])), "empty")
    elif kind == "ragged":
        rows[i] = rows[i] + [1.0]
        return Arg(rows, "ragged")
    else:
        texts = [[["0.5"]], [[1.0, "0"], [0, 1]], np.array([["1"]])]
        return Arg(
            draw(st.sampled_from([None, "1", 1.0, {0: 1.0}, [[None]], [["a"]], *texts])), "type"
        )
    return Arg(rows, kind)


@FUZZ
# Found by this fuzzer: numpy parsed text entries as numbers, so [["0.5"]] was accepted.
@example(weights=Arg([["0.5"]], "text"), name=Arg(""))
@given(
    weights=mostly(weight_matrices(), bad_weight_matrices(), 3),
    name=mostly(good(st.text(max_size=8)), bad(st.sampled_from([None, 1, b"x"]), "not a str")),
)
def test_topology_value(weights, name):
    topo = verdict(
        call(Topology, weights.value, name=name.value), {"weights": weights, "name": name}
    )
    if topo is None:
        return
    expected = np.array(weights.value, dtype=float)
    assert_topology(topo, expected)
    assert topo == Topology(expected) and hash(topo) == hash(Topology(expected))
    assert not topo.weights.flags.writeable
    assert Topology.from_networkx(topo.to_networkx()) == topo


# ---------------------------------------------------------------------- generators
@FUZZ
@given(size=sizes(40), base=mostly(good(st.integers(2, 12)), bad_int(2)))
def test_exponential(size, base):
    topo = verdict(call(T.exponential, size.value, base.value), {"size": size, "base": base})
    if topo is None:
        return
    n, b = int(size.value), base.value
    expected = circulant([k == 0 or is_power(k, b) for k in range(n)])
    assert_topology(topo, expected)
    assert T.is_doubly_stochastic(topo)
    assert set(topo.in_neighbors(0)) == {(-(b**t)) % n for t in range(n) if b**t < n} - {0}


@FUZZ
@given(size=sizes(40))
def test_exponential_two(size):
    topo = verdict(call(T.exponential_two, size.value), {"size": size})
    if topo is not None:
        n = int(size.value)
        # BlueFog's test: in-neighbours of r are (r - 2^i) % n for i < ceil(log2 n).
        expected = {(-(2**i)) % n for i in range(math.ceil(math.log2(n)))} - {0} if n > 1 else set()
        assert set(topo.in_neighbors(0)) == expected
        assert topo == T.exponential(int(size.value), 2)


@FUZZ
@given(size=sizes(40), base=mostly(good(st.integers(2, 8)), bad_int(2)))
def test_symmetric_exponential(size, base):
    topo = verdict(
        call(T.symmetric_exponential, size.value, base.value), {"size": size, "base": base}
    )
    if topo is None:
        return
    n, b = int(size.value), base.value
    mask = [k == 0 or is_power(k if k <= n // 2 else n - k, b) for k in range(n)]
    assert_topology(topo, circulant(mask))
    assert np.array_equal(topo.adjacency, topo.adjacency.T)


def metropolis_hastings(adj):
    deg = adj.sum(axis=1)
    n = len(adj)
    w = np.zeros((n, n))
    for i, j in itertools.product(range(n), repeat=2):
        if i != j and adj[i, j]:
            w[i, j] = 1.0 / (1 + max(deg[i], deg[j]))
    np.fill_diagonal(w, 1.0 - w.sum(axis=1))
    return w


@st.composite
def grid_args(draw):
    size = draw(sizes(30))
    if size.bad is not None or draw(st.booleans()):
        return size, draw(mostly(good(st.none()), bad(st.just((1, 1, 1)), "not a pair")))
    n = int(size.value)
    divisors = [r for r in range(1, n + 1) if n % r == 0]
    r = draw(st.sampled_from(divisors))
    shape = draw(
        mostly(
            good(st.sampled_from([(r, n // r), [r, n // r]])),
            st.one_of(
                bad(st.just((r, n // r + 1)), "product differs from size"),
                bad(st.just((float(r), n // r)), "not ints"),
                bad(st.just((0, n)), "below 1"),
                bad(st.sampled_from(["ab", (r,), r]), "not a pair"),
            ),
            4,
        )
    )
    return size, shape


@FUZZ
@given(args=grid_args())
def test_mesh_grid_2d(args):
    size, shape = args
    topo = verdict(call(T.mesh_grid_2d, size.value, shape.value), {"size": size, "shape": shape})
    if topo is None:
        return
    n = int(size.value)
    if shape.value is None:
        nrow = max(r for r in range(1, math.isqrt(n) + 1) if n % r == 0)
        ncol = n // nrow
    else:
        nrow, ncol = shape.value
    adj = np.zeros((n, n), dtype=bool)
    for i, j in itertools.product(range(n), repeat=2):
        (ri, ci), (rj, cj) = divmod(i, ncol), divmod(j, ncol)
        adj[i, j] = abs(ri - rj) + abs(ci - cj) == 1
    assert nrow * ncol == n
    assert_topology(topo, metropolis_hastings(adj))


@st.composite
def star_args(draw):
    size = draw(sizes(30))
    hi = int(size.value) - 1 if size.bad is None else 0
    center = draw(mostly(good(st.integers(0, hi)), bad_int(0, hi)))
    return size, center


@FUZZ
@given(args=star_args())
def test_star(args):
    size, center = args
    topo = verdict(call(T.star, size.value, center.value), {"size": size, "center": center})
    if topo is None:
        return
    n, c = int(size.value), center.value
    expected = np.diag(np.full(n, 1 - 1 / n))
    expected[c, :] = expected[:, c] = 1 / n
    assert_topology(topo, expected)
    assert T.is_doubly_stochastic(topo)


@FUZZ
@given(
    size=sizes(30),
    style=mostly(
        good(st.sampled_from(["bidirectional", "left", "right"])),
        bad(st.sampled_from(["up", "", 0, 1, None, "LEFT"]), "unknown style"),
    ),
)
def test_ring(size, style):
    topo = verdict(call(T.ring, size.value, style.value), {"size": size, "style": style})
    if topo is None:
        return
    n = int(size.value)
    offsets = {"bidirectional": (0, 1, -1), "left": (0, -1), "right": (0, 1)}[style.value]
    mask = np.zeros(n, dtype=bool)
    for o in offsets:
        mask[o % n] = True
    assert_topology(topo, circulant(mask))


@FUZZ
@given(size=sizes(30))
def test_fully_connected(size):
    topo = verdict(call(T.fully_connected, size.value), {"size": size})
    if topo is not None:
        n = int(size.value)
        assert_topology(topo, np.full((n, n), 1 / n))
        assert math.isclose(T.spectral_gap(topo), 1.0, abs_tol=1e-9)


# ---------------------------------------------------------------------- weight rules
@st.composite
def adjacencies(draw, symmetric=False):
    n = draw(st.integers(1, 6))
    adj = np.array(draw(square(n, st.booleans())), dtype=bool).reshape(n, n)
    if symmetric:
        adj = adj | adj.T
    form = draw(st.sampled_from(["bool", "int", "float list", "topology"]))
    if form == "topology":
        value = Topology(np.where(adj, 0.5, 0.0) + np.eye(n))
    elif form == "int":
        value = adj.astype(np.int64)
    elif form == "float list":
        value = adj.astype(float).tolist()
    else:
        value = adj
    np.fill_diagonal(adj, False)
    return Arg(value), adj


@st.composite
def bad_adjacencies(draw, symmetric=False):
    n = draw(st.integers(2, 5))
    adj = np.zeros((n, n))
    kind = draw(st.sampled_from(["not 0/1", "not square", "type"] + ["asymmetric"] * symmetric))
    if kind == "not 0/1":
        adj[draw(st.integers(0, n - 1)), draw(st.integers(0, n - 1))] = draw(
            st.sampled_from([0.5, 2.0, -1.0, math.nan])
        )
    elif kind == "asymmetric":
        adj[0, 1] = 1
    elif kind == "not square":
        adj = np.zeros((n, n + 1))
    else:
        return Arg(draw(st.sampled_from([None, "01", 3, [[1, 0], [1]]])), kind), None
    return Arg(adj, kind), None


@FUZZ
@given(case=mostly(adjacencies(), bad_adjacencies(), 4))
def test_uniform_weights(case):
    adjacency, adj = case
    topo = verdict(call(T.uniform_weights, adjacency.value), {"adjacency": adjacency})
    if topo is None:
        return
    expected = (adj | np.eye(len(adj), dtype=bool)) / (adj.sum(axis=0) + 1.0)
    assert_topology(topo, expected)
    assert T.is_column_stochastic(topo)


@FUZZ
@given(case=mostly(adjacencies(symmetric=True), bad_adjacencies(symmetric=True), 4))
def test_metropolis_hastings_weights(case):
    adjacency, adj = case
    topo = verdict(call(T.metropolis_hastings_weights, adjacency.value), {"adjacency": adjacency})
    if topo is None:
        return
    assert_topology(topo, metropolis_hastings(adj))
    assert T.is_doubly_stochastic(topo)


@FUZZ
@given(
    matrix=mostly(weight_matrices(), bad_weight_matrices(), 4),
    atol=mostly(
        good(st.floats(0, 1) | st.just(1e-10) | st.integers(0, 1)),
        st.one_of(bad_float(), bad(st.floats(max_value=-1e-9), "negative")),
    ),
    check=st.sampled_from(["row", "column", "doubly"]),
)
def test_stochasticity_checks(matrix, atol, check):
    fn = {
        "row": T.is_row_stochastic,
        "column": T.is_column_stochastic,
        "doubly": T.is_doubly_stochastic,
    }[check]
    got = verdict(call(fn, matrix.value, atol.value), {"matrix": matrix, "atol": atol})
    if got is None:
        return
    w = np.array(matrix.value, dtype=float)
    rows = bool(np.all(np.abs(w.sum(axis=1) - 1) <= atol.value))
    cols = bool(np.all(np.abs(w.sum(axis=0) - 1) <= atol.value))
    assert got is {"row": rows, "column": cols, "doubly": rows and cols}[check]


@FUZZ
@given(topology=mostly(weight_matrices(), bad_weight_matrices(), 4))
def test_mixing_rate_and_spectral_gap(topology):
    rate = verdict(call(T.mixing_rate, topology.value), {"topology": topology})
    if rate is None:
        return
    w = np.array(topology.value, dtype=float)
    moduli = sorted(np.abs(np.linalg.eigvals(w)), reverse=True)
    expected = 0.0 if len(w) == 1 else moduli[1]
    assert math.isclose(rate, expected, rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(T.spectral_gap(topology.value), 1 - expected, rel_tol=1e-9, abs_tol=1e-9)
    links = (w > 0) & ~np.eye(len(w), dtype=bool)  # self-loops are not links
    assert T.is_regular(Topology(w)) == (len(set(links.sum(0) + links.sum(1))) == 1)


@FUZZ
@given(
    first=mostly(good(st.integers(1, 4).map(T.ring) | st.none()), bad(st.just(np.eye(2)), "type")),
    second=mostly(good(st.integers(1, 4).map(T.ring) | st.none()), bad(st.just("ring"), "type")),
)
def test_is_equivalent(first, second):
    args = {"first": first, "second": second}
    got = verdict(call(T.is_equivalent, first.value, second.value), args)
    if first.bad is None and second.bad is None:
        a, b = first.value, second.value
        assert got is (a is not None and b is not None and a.size == b.size)


# ---------------------------------------------------------------------- Step and schedules
@st.composite
def steps(draw):
    send = draw(st.lists(st.integers(0, 9), unique=True, max_size=4))
    recv = draw(st.lists(st.integers(0, 9), unique=True, max_size=4))
    args = {
        "send_ranks": Arg(send),
        "recv_ranks": Arg(recv),
        "self_weight": draw(mostly(good(st.floats(-2, 2) | st.integers(0, 2)), bad_float(), 8)),
        "src_weights": Arg({r: draw(st.floats(-2, 2)) for r in recv}),
        "dst_weights": Arg({r: draw(st.floats(0, 2)) for r in send}),
    }
    defect = draw(st.integers(0, 9))
    if defect == 1:
        args["send_ranks"] = Arg(send + send[:1] if send else [-1], "repeated or negative")
    elif defect == 2:
        args["recv_ranks"] = Arg([*recv, "1"], "not an int")
    elif defect == 3:
        args["src_weights"] = Arg({**args["src_weights"].value, 99: 0.5}, "keys not recv_ranks")
    elif defect == 4:
        key = draw(st.sampled_from(send)) if send else 5
        args["dst_weights"] = Arg({key: draw(st.sampled_from([math.nan, "x", None]))}, "value")
    elif defect == 5:
        args["dst_weights"] = Arg(list(send), "not a mapping")
    elif defect == 6:
        args["recv_ranks"] = Arg(draw(st.sampled_from([3, None, 2.5])), "not iterable")
    return args


def step_args(bad_name, value, why, **valid):
    args = {
        "send_ranks": Arg([]),
        "recv_ranks": Arg([1]),
        "self_weight": Arg(0.5),
        "src_weights": Arg({1: 0.5}),
        "dst_weights": Arg({}),
        **{k: Arg(v) for k, v in valid.items()},
    }
    args[bad_name] = Arg(value, why)
    return args


@FUZZ
@given(args=steps())
# Found by this fuzzer: the messages named no argument (float(), sorted(), iter() errors).
@example(args=step_args("self_weight", None, "not a real number"))
@example(args=step_args("src_weights", {1: "x"}, "not a real number"))
@example(args=step_args("src_weights", {1: 0.5, "a": 0.5}, "keys not recv_ranks"))
@example(args=step_args("recv_ranks", 3, "not iterable", src_weights={}))
@example(args=step_args("self_weight", True, "a bool"))
def test_step(args):
    step = verdict(call(Step, **{k: a.value for k, a in args.items()}), args)
    if step is None:
        return
    assert step.send_ranks == tuple(args["send_ranks"].value)
    assert step.recv_ranks == tuple(args["recv_ranks"].value)
    assert step.self_weight == float(args["self_weight"].value)
    assert dict(step.src_weights) == args["src_weights"].value
    assert hash(step) == hash(Step(**{k: a.value for k, a in args.items()}))


def consistent(schedules, n, count):
    """At every step, i sends to j exactly when j receives from i."""
    for _ in range(count):
        now = [next(s) for s in schedules]
        sends = {(i, j) for i in range(n) for j in now[i].send_ranks}
        recvs = {(i, j) for j in range(n) for i in now[j].recv_ranks}
        assert sends == recvs
        for step in now:
            assert math.isclose(step.self_weight + sum(step.src_weights.values()), 1.0)


@FUZZ
@given(
    topology=mostly(
        good(
            st.sampled_from([T.exponential_two, T.ring, T.star, T.mesh_grid_2d]).flatmap(
                lambda gen: st.integers(1, 12).map(gen)
            )
        ),
        bad(st.sampled_from([None, np.eye(3), nx.complete_graph(3)]), "not a Topology"),
    ),
    rank=st.integers(-2, 14),
)
def test_one_peer_exponential(topology, rank):
    size = topology.value.size if topology.bad is None else 1
    rank_arg = Arg(rank, None if 0 <= rank < size else "out of range")
    schedule = verdict(
        call(T.one_peer_exponential, topology.value, rank),
        {"topology": topology, "rank": rank_arg},
    )
    if schedule is None:
        return
    first = next(schedule)
    peers = topology.value.out_neighbors(rank)
    assert first.send_ranks == ((min(peers, key=lambda d: (d - rank) % size),) if peers else ())
    consistent([T.one_peer_exponential(topology.value, r) for r in range(size)], size, 6)


@FUZZ
@given(
    kind=st.sampled_from(["inner_outer_ring", "inner_outer_exponential_two", "machine"]),
    world=st.integers(-1, 24) | st.sampled_from([2.0, None]),
    local=st.integers(0, 8) | st.just("4"),
    rank=st.integers(-1, 24),
)
def test_hierarchical_schedules(kind, world, local, rank):
    def is_int(v):
        return isinstance(v, int) and not isinstance(v, bool)

    bad = {}
    if not is_int(world) or world < 1:
        bad["world_size"] = "not an int >= 1"
    if not is_int(local) or local < 1:
        bad["local_size"] = "not an int >= 1"
    if not bad:
        if world % local:
            bad["world_size"] = "not a multiple of local_size"
        elif not 0 <= rank < world:
            bad["rank"] = "out of range"
        elif kind != "machine" and local <= 2:
            bad["local_size"] = "<= 2"
        elif kind == "machine" and world // local < 2:
            bad["world_size"] = "one machine"
    fn = {
        "inner_outer_ring": T.inner_outer_ring,
        "inner_outer_exponential_two": T.inner_outer_exponential_two,
        "machine": T.machine_exponential_two,
    }[kind]
    args = {"world_size": Arg(world), "local_size": Arg(local), "rank": Arg(rank)}
    # The defects depend on the other arguments: the message may name either of the pair.
    names = {"world_size": ("local_size",), "local_size": ("world_size",)}
    schedule = verdict(call(fn, world, local, rank), args, names=names, extra_bad=bad)
    if schedule is None:
        return
    if kind == "machine":
        machines = world // local
        consistent([fn(world, local, m * local) for m in range(machines)], machines, 5)
    else:
        consistent([fn(world, local, r) for r in range(world)], world, 2 * local)
