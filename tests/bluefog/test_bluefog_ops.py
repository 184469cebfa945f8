"""bf collectives and neighbour operations against references computed here from the full W."""

from functools import partial

import networkx as nx
import numpy as np
import pytest
import torch

import gossamer.bluefog as bf
import oracle
from gossamer.testing import run_distributed
from oracle import assert_close, machine_input, mix, uniform

F64 = torch.float64
# float64, so that every reference holds to 1e-12
data = partial(oracle.data, shape=(3, 4), dtype=F64)
GRAPHS = {
    "exponential": bf.ExponentialGraph,
    "ring": bf.RingGraph,
    "ring_left": lambda n: bf.RingGraph(n, connect_style=1),
    "star": bf.StarGraph,
    "mesh": bf.MeshGrid2DGraph,
    "full": bf.FullyConnectedGraph,
    "symmetric_exponential": lambda n: bf.SymmetricExponentialGraph(n, base=2),
}


# ---------------------------------------------------------------- static neighbor_allreduce
def _static_all_graphs():
    bf.init()
    x = data(bf.rank())
    out = {}
    try:
        for name, make in GRAPHS.items():
            for weighted in (False, True):
                # An equivalent graph would keep is_weighted (BlueFog): set another first.
                bf.set_topology(nx.empty_graph(bf.size(), create_using=nx.DiGraph))
                assert bf.set_topology(make(bf.size()), is_weighted=weighted)
                assert bf.is_topo_weighted() is weighted
                before = x.clone()
                y = bf.neighbor_allreduce(x)
                h = bf.neighbor_allreduce_nonblocking(x, name=f"{name}.{weighted}")
                out[name, weighted] = (y, bf.synchronize(h))
                assert torch.equal(x, before), "input modified"
    finally:
        bf.set_topology()
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_static_default_weights_against_full_weight_matrix(world_size):
    got = run_distributed(_static_all_graphs, world_size)
    xs = [data(r) for r in range(world_size)]
    for name, make in GRAPHS.items():
        W = nx.to_numpy_array(make(world_size))
        for weighted in (False, True):
            expected = mix(W if weighted else uniform(W), xs)
            for rank, out in enumerate(got):
                blocking, nonblocking = out[name, weighted]
                assert_close(blocking, expected[rank])
                assert torch.equal(blocking, nonblocking)


def _average_is_sum_then_divide():
    bf.init()
    try:
        bf.set_topology(bf.MeshGrid2DGraph(bf.size()))  # unweighted: uniform, not M-H
        x = torch.full((5,), 1.0 + bf.rank() / 7, dtype=F64) * 2.0**-256
        return bf.neighbor_allreduce(x), bf.in_neighbor_ranks()
    finally:
        bf.set_topology()


def test_uniform_average_is_bit_exact_sum_then_divide():
    got = run_distributed(_average_is_sum_then_divide, 4)
    xs = [torch.full((5,), 1.0 + r / 7, dtype=F64) * 2.0**-256 for r in range(4)]
    for rank, (y, sources) in enumerate(got):
        expected = xs[rank].clone()
        for s in sources:
            expected += xs[s]
        assert torch.equal(y, expected / (len(sources) + 1))


# ---------------------------------------------------------------- explicit and dynamic weights
def _explicit_weights():
    bf.init()
    r, n = bf.rank(), bf.size()
    x = data(r)
    out = {}
    # static, a subset of the in-neighbours: matched by rank, the others ignored
    first = bf.in_neighbor_ranks()[0]
    out["subset"] = bf.neighbor_allreduce(x, self_weight=0.25, src_weights={first: 0.75})
    # static, numpy weights and an int self weight are accepted
    srcs = {np.int64(s): np.float32(0.5) for s in bf.in_neighbor_ranks()}
    out["numpy"] = bf.neighbor_allreduce(x, self_weight=1, src_weights=srcs)
    out["numpy_self"] = bf.neighbor_allreduce(x, self_weight=np.float32(1.0), src_weights=srcs)
    # dynamic: receive from rank+1, send to rank-1 (outside the exponential graph)
    out["move"] = bf.neighbor_allreduce(
        x, self_weight=0.0, src_weights={(r + 1) % n: 1.0}, dst_weights=[(r - 1) % n]
    )
    # sender-side scaling: self 0.5, src 1.0, dst 0.5 -> 0.5 * (x_i + sum x_j)
    srcs = {s: 1.0 for s in bf.in_neighbor_ranks()}
    dsts = {d: 0.5 for d in bf.out_neighbor_ranks()}
    h = bf.neighbor_allreduce_nonblocking(x, self_weight=0.5, src_weights=srcs, dst_weights=dsts)
    out["dst_weighted"] = bf.wait(h)
    # dynamic with no sources: self_weight * x, and x is left alone
    before = x.clone()
    out["alone"] = bf.neighbor_allreduce(x, self_weight=0.5, src_weights={}, dst_weights=[])
    assert torch.equal(x, before)
    # one-peer dynamic schedule of the default graph
    send, recv = next(bf.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), r))
    share = 1 / (len(recv) + 1)
    out["one_peer"] = bf.neighbor_allreduce(
        x,
        self_weight=share,
        src_weights=dict.fromkeys(recv, share),
        dst_weights=send,
        enable_topo_check=False,
    )
    return out


def test_explicit_and_dynamic_weights():
    n = 4
    got = run_distributed(_explicit_weights, n)
    xs = [data(r) for r in range(n)]
    W = nx.to_numpy_array(bf.ExponentialGraph(n))
    for r, out in enumerate(got):
        ins = [i for i in range(n) if i != r and W[i, r]]
        assert_close(out["subset"], 0.25 * xs[r] + 0.75 * xs[ins[0]])
        assert_close(out["numpy"], xs[r] + 0.5 * sum(xs[i] for i in ins), rtol=1e-6, atol=1e-6)
        assert torch.equal(out["numpy_self"], out["numpy"])  # a numpy self weight too
        assert_close(out["move"], xs[(r + 1) % n])
        assert_close(out["dst_weighted"], 0.5 * (xs[r] + sum(xs[i] for i in ins)))
        assert_close(out["alone"], 0.5 * xs[r])
        # step 0 of one-peer exponential-2: everyone sends to rank+1
        assert_close(out["one_peer"], (xs[r] + xs[(r - 1) % n]) / 2)


def _argument_errors():
    bf.init()
    x = data(bf.rank())
    others = [s for s in range(bf.size()) if s != bf.rank()]
    cases = {
        "self_alone": dict(self_weight=0.5),
        "src_alone": dict(src_weights={others[0]: 0.5}),
        "dst_without_weights": dict(dst_weights=others),
        "list_src": dict(self_weight=0.5, src_weights=others),
        "str_self": dict(self_weight="half", src_weights={others[0]: 0.5}),
        "not_in_neighbor": dict(self_weight=0.5, src_weights={(bf.rank() + 1) % 4: 0.5}),
        "out_of_range": dict(self_weight=0.5, src_weights={9: 0.5}),
        "repeated_dst": dict(self_weight=0.5, src_weights={}, dst_weights=[others[0]] * 2),
        "removed_neighbor_weights": dict(neighbor_weights={others[0]: 0.5}),
        "removed_send_neighbors": dict(send_neighbors=others),
    }
    out = {}
    for name, kwargs in cases.items():
        try:
            bf.neighbor_allreduce(x, **kwargs)
            out[name] = None
        except (ValueError, TypeError) as err:
            out[name] = (type(err).__name__, str(err))
    for name, call in {
        "int_tensor": lambda: bf.neighbor_allreduce(torch.ones(3, dtype=torch.int32)),
        "int_average": lambda: bf.allreduce(torch.ones(3, dtype=torch.int64)),
        "gather_half_dynamic": lambda: bf.neighbor_allgather(x, src_ranks=others),
        "removed_machine": lambda: bf.hierarchical_neighbor_allreduce(x, send_neighbor_machines=[]),
        "no_machine_topology": lambda: bf.hierarchical_neighbor_allreduce(x),
        "unknown_poll": lambda: bf.poll(10**9),
        "unknown_synchronize": lambda: bf.synchronize(10**9),
    }.items():
        try:
            call()
            out[name] = None
        except (ValueError, TypeError, RuntimeError) as err:
            out[name] = (type(err).__name__, str(err))
    # a topology check that fails raises on every rank: everyone sends to rank+1, but
    # claims to receive from rank+2 (rank-1 would be right)
    n, r = bf.size(), bf.rank()
    try:
        bf.neighbor_allreduce(
            x, self_weight=0.5, src_weights={(r + 2) % n: 0.5}, dst_weights=[(r + 1) % n]
        )
        out["topo_check"] = None
    except ValueError as err:
        out["topo_check"] = ("ValueError", str(err))
    return out


def test_argument_errors():
    for out in run_distributed(_argument_errors, 4):
        for name in ("self_alone", "src_alone", "dst_without_weights", "list_src", "str_self"):
            assert out[name][0] == "ValueError", name
        assert out["not_in_neighbor"][0] == out["out_of_range"][0] == "ValueError"
        assert "in-neighbours" in out["not_in_neighbor"][1]
        assert out["repeated_dst"][0] == "ValueError"
        assert out["removed_neighbor_weights"] == (
            "TypeError",
            "neighbor_allreduce() no longer takes the argument 'neighbor_weights'. "
            "Use src_weights instead.",
        )
        assert "Use dst_weights instead" in out["removed_send_neighbors"][1]
        assert out["int_tensor"][0] == out["int_average"][0] == "ValueError"
        assert out["gather_half_dynamic"][0] == "ValueError"
        assert "Use dst_machine_weights instead" in out["removed_machine"][1]
        assert out["no_machine_topology"][0] == "RuntimeError"
        assert out["unknown_poll"][0] == "ValueError"
        assert out["unknown_synchronize"] == ("ValueError", "Cannot find handle to synchronize")
        assert out["topo_check"][0] == "ValueError" and "do not match" in out["topo_check"][1]


# ---------------------------------------------------------------- collectives
def _collectives():
    bf.init()
    r, n = bf.rank(), bf.size()
    x = data(r)
    out = {
        "avg": bf.allreduce(x),
        "sum_int": bf.allreduce(torch.full((3,), r + 1, dtype=torch.int32), average=False),
        "bcast": bf.broadcast(x, root_rank=n - 1),
        "gather": bf.allgather(torch.full((r + 1, 2), float(r))),
        "local": bf.allreduce(x, is_hierarchical_local=True),
    }
    inplace = x.clone()
    assert bf.allreduce_(inplace) is inplace
    out["avg_"] = inplace
    handles = {
        "nb_avg": bf.allreduce_nonblocking(x, name="a"),
        "nb_bcast": bf.broadcast_nonblocking(x, 0),
        "nb_gather": bf.allgather_nonblocking(x[:1]),
    }
    in_place = {"nb_avg_": x.clone(), "nb_bcast_": x.clone(), "nb_local_": x.clone()}
    handles["nb_avg_"] = bf.allreduce_nonblocking_(in_place["nb_avg_"])
    handles["nb_bcast_"] = bf.broadcast_nonblocking_(in_place["nb_bcast_"], root_rank=0)
    handles["nb_local_"] = bf.allreduce_nonblocking_(
        in_place["nb_local_"], is_hierarchical_local=True
    )
    bcast_ = x.clone()
    assert bf.broadcast_(bcast_, 0) is bcast_
    out["bcast_"] = bcast_
    bf.barrier()
    for name, handle in handles.items():
        while not bf.poll(handle):
            pass
        if name in in_place:  # BlueFog writes the tensor by the time poll says done
            out[name + "_polled"] = in_place[name].clone()
        out[name] = bf.synchronize(handle)
        if name in in_place:
            assert out[name] is in_place[name]
    return out


@pytest.mark.parametrize(("world_size", "per_machine"), [(1, 1), (2, 1), (4, 2)])
def test_collectives(world_size, per_machine):
    env = {"GOSSAMER_NODES_PER_MACHINE": str(per_machine)}
    got = run_distributed(_collectives, world_size, env=env)
    xs = [data(r) for r in range(world_size)]
    mean = sum(xs) / world_size
    gathered = torch.cat([torch.full((r + 1, 2), float(r)) for r in range(world_size)])
    for r, out in enumerate(got):
        local = [xs[s] for s in range(world_size) if s // per_machine == r // per_machine]
        for name in ("avg", "avg_", "nb_avg", "nb_avg_"):
            assert_close(out[name], mean)
        for name in ("local", "nb_local_", "nb_local__polled"):
            assert_close(out[name], sum(local) / per_machine)
        assert_close(out["nb_avg__polled"], mean)
        assert torch.equal(out["sum_int"], torch.full((3,), sum(range(1, world_size + 1))))
        assert out["sum_int"].dtype == torch.int32
        assert torch.equal(out["bcast"], xs[-1])
        for name in ("bcast_", "nb_bcast", "nb_bcast_"):
            assert torch.equal(out[name], xs[0])
        assert torch.equal(out["gather"], gathered)
        assert torch.equal(out["nb_gather"], torch.cat([x[:1] for x in xs]))


def _neighbor_allgather():
    bf.init()
    r, n = bf.rank(), bf.size()
    x = torch.full((r + 1, 2), float(r))
    static = bf.neighbor_allgather(x)
    srcs = np.random.default_rng(7).permutation([s for s in range(n) if s != r])
    dynamic = bf.synchronize(
        bf.neighbor_allgather_nonblocking(
            x, src_ranks=srcs, dst_ranks=[d for d in range(n) if d != r]
        )
    )
    return static, dynamic, srcs.tolist()


@pytest.mark.parametrize("world_size", [2, 4])
def test_neighbor_allgather_static_and_dynamic(world_size):
    n = world_size
    W = nx.to_numpy_array(bf.ExponentialGraph(n))

    def block(s):
        return torch.full((s + 1, 2), float(s))

    for r, (static, dynamic, srcs) in enumerate(run_distributed(_neighbor_allgather, n)):
        ins = [i for i in range(n) if i != r and W[i, r]]
        assert torch.equal(static, torch.cat([block(i) for i in ins]))
        assert torch.equal(dynamic, torch.cat([block(s) for s in srcs]))


# ---------------------------------------------------------------- machine level, pairs
def _hierarchical():
    bf.init()
    m, M = bf.machine_rank(), bf.machine_size()
    x = machine_input()
    out = {}
    try:
        bf.set_machine_topology(bf.RingGraph(M, connect_style=2))  # receive from m-1
        out["uniform"] = bf.hierarchical_neighbor_allreduce(x)
        skewed = bf.RingGraph(M, connect_style=2)
        for k in range(M):
            skewed[k][k]["weight"] = 0.25
            skewed[k][(k + 1) % M]["weight"] = 0.75
        bf.set_machine_topology(skewed, is_weighted=True)
        out["weighted"] = bf.synchronize(bf.hierarchical_neighbor_allreduce_nonblocking(x))
        out["move"] = bf.hierarchical_neighbor_allreduce(
            x,
            self_weight=0.0,
            src_machine_weights={(m + 1) % M: 0.5},
            dst_machine_weights={(m - 1) % M: 2.0},
        )
    finally:
        from gossamer import set_machine_topology

        set_machine_topology(None)
    return out


def _full(v):
    """A result of _hierarchical: machine_input's shape, every entry v."""
    return torch.full((3, 2), float(v), dtype=F64)


def test_hierarchical_neighbor_allreduce():
    got = run_distributed(_hierarchical, 4, env={"GOSSAMER_NODES_PER_MACHINE": "1"})
    M = 4
    for r, out in enumerate(got):
        m = r
        assert_close(out["uniform"], _full((m + (m - 1) % M) / 2))
        assert_close(out["weighted"], _full(0.25 * m + 0.75 * ((m - 1) % M)))
        assert_close(out["move"], _full((m + 1) % M))


def test_hierarchical_with_two_ranks_per_machine():
    got = run_distributed(_hierarchical, 4, env={"GOSSAMER_NODES_PER_MACHINE": "2"})
    for r, out in enumerate(got):
        m = r // 2
        assert_close(out["uniform"], _full(0.5))  # (m + other) / 2 over two machines
        assert_close(out["weighted"], _full(0.25 * m + 0.75 * (1 - m)))
        assert_close(out["move"], _full(1 - m))


def _pairs():
    bf.init()
    r = bf.rank()
    x = data(r)
    plain = bf.pair_gossip(x, r ^ 1)
    weighted = bf.synchronize(
        bf.pair_gossip_nonblocking(x, r ^ 1, self_weight=0.25, pair_weight=0.75)
    )
    return plain, weighted


def test_pair_gossip():
    xs = [data(r) for r in range(4)]
    for r, (plain, weighted) in enumerate(run_distributed(_pairs, 4)):
        assert_close(plain, (xs[r] + xs[r ^ 1]) / 2)
        assert_close(weighted, 0.25 * xs[r] + 0.75 * xs[r ^ 1])
