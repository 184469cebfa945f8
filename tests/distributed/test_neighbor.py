import math
import threading
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist

import gossamer
from gossamer import topology as topo
from gossamer import transport
from gossamer.errors import CommunicationTimeout, PeerError
from gossamer.testing import run_distributed
from gossamer.transport import HEADER_LEN
from oracle import assert_all_close, data, mix

SIZES = [1, 2, 3, 4]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _static(graph, dtype, async_op):
    x = data(gossamer.rank(), dtype=dtype)
    before = x.clone()
    y = gossamer.neighbor_allreduce(x, topology=graph, async_op=async_op)
    if async_op:
        y = y.wait()
    assert torch.equal(x, before), "input modified"
    return y


def _graphs(n):
    return {
        "exponential_two": topo.exponential_two(n),
        "ring": topo.ring(n),
        "ring_right": topo.ring(n, style="right"),
        "star": topo.star(n),
        "mesh": topo.mesh_grid_2d(n),
        "full": topo.fully_connected(n),
        "symmetric_exp": topo.symmetric_exponential(n, base=2),
    }


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize(
    "name", ["exponential_two", "ring", "ring_right", "star", "mesh", "full", "symmetric_exp"]
)
def test_static_topologies_against_full_weight_matrix(world_size, name):
    graph = _graphs(world_size)[name]
    got = run_distributed(_static, world_size, args=(graph, torch.float64, False))
    expected = mix(graph.weights, [data(r, dtype=torch.float64) for r in range(world_size)])
    assert_all_close(got, expected, torch.float64)


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("async_op", [False, True])
def test_static_default_weights_every_dtype(world_size, dtype, async_op):
    graph = topo.exponential_two(world_size)
    got = run_distributed(_static, world_size, args=(graph, dtype, async_op))
    expected = mix(graph.weights, [data(r, dtype=dtype) for r in range(world_size)])
    assert_all_close(got, expected, dtype)


def _default_topology():
    x = data(gossamer.rank(), dtype=torch.float64)
    first = gossamer.neighbor_allreduce(x)  # exponential_two until set_topology
    gossamer.set_topology(topo.ring(gossamer.size(), style="left"))
    try:
        second = gossamer.neighbor_allreduce(x)
        assert gossamer.get_topology() == topo.ring(gossamer.size(), style="left")
    finally:
        gossamer.set_topology(topo.exponential_two(gossamer.size()))
    return first, second


@pytest.mark.parametrize("world_size", [3, 4])
def test_default_topology_is_exponential_two_and_can_be_set(world_size):
    got = run_distributed(_default_topology, world_size)
    xs = [data(r, dtype=torch.float64) for r in range(world_size)]
    assert_all_close(
        [g[0] for g in got], mix(topo.exponential_two(world_size).weights, xs), torch.float64
    )
    assert_all_close(
        [g[1] for g in got], mix(topo.ring(world_size, style="left").weights, xs), torch.float64
    )


def _weighted_graph(n):
    # Column-stochastic but not symmetric: weights differ per edge.
    rng = np.random.default_rng(n)
    W = (topo.exponential_two(n).weights > 0) * rng.uniform(0.5, 2.0, (n, n))
    return topo.Topology(W / W.sum(axis=0, keepdims=True))


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_weighted_topology_uses_its_weights(world_size):
    graph = _weighted_graph(world_size)
    got = run_distributed(_static, world_size, args=(graph, torch.float64, False))
    expected = mix(graph.weights, [data(r, dtype=torch.float64) for r in range(world_size)])
    assert_all_close(got, expected, torch.float64)


def _explicit_subset():
    r, n = gossamer.rank(), gossamer.size()
    graph = topo.exponential_two(n)
    sources = graph.in_neighbors(r)
    src = {sources[0]: 0.7} if sources else {}  # a subset: matched by rank, not position
    return gossamer.neighbor_allreduce(
        data(r, dtype=torch.float64), self_weight=0.3, src_weights=src, topology=graph
    )


@pytest.mark.parametrize("world_size", [1, 3, 4])
def test_explicit_src_weights_are_matched_by_rank(world_size):
    got = run_distributed(_explicit_subset, world_size)
    graph = topo.exponential_two(world_size)
    W = np.zeros((world_size, world_size))
    for i in range(world_size):
        W[i, i] = 0.3
        if graph.in_neighbors(i):
            W[graph.in_neighbors(i)[0], i] = 0.7
    expected = mix(W, [data(r, dtype=torch.float64) for r in range(world_size)])
    assert_all_close(got, expected, torch.float64)


def _sum_then_divide():
    tiny = torch.full((5,), 2.0**-256, dtype=torch.float64) * (gossamer.rank() + 1)
    y = gossamer.neighbor_allreduce(tiny)
    expected = tiny + sum(
        torch.full((5,), 2.0**-256, dtype=torch.float64) * (s + 1)
        for s in gossamer.get_topology().in_neighbors(gossamer.rank())
    )
    expected = expected / (len(gossamer.get_topology().in_neighbors(gossamer.rank())) + 1)
    return bool(torch.equal(y, expected))


@pytest.mark.parametrize("world_size", [3, 4])
def test_uniform_weights_sum_then_divide_bit_exact(world_size):
    assert run_distributed(_sum_then_divide, world_size) == [True] * world_size


def _dynamic_one_peer(steps):
    r, n = gossamer.rank(), gossamer.size()
    schedule = topo.one_peer_exponential(topo.exponential_two(n), r)
    x = data(r, dtype=torch.float64)
    out = []
    for _ in range(steps):
        step = next(schedule)
        x = gossamer.neighbor_allreduce(
            x,
            self_weight=step.self_weight,
            src_weights=dict(step.src_weights),
            dst_weights=dict(step.dst_weights),
        )
        out.append(x)
    return out


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dynamic_one_peer_schedule(world_size):
    steps = 2 * max(1, math.ceil(math.log2(world_size)))
    got = run_distributed(_dynamic_one_peer, world_size, args=(steps,))
    xs = [data(r, dtype=torch.float64) for r in range(world_size)]
    schedules = [
        topo.one_peer_exponential(topo.exponential_two(world_size), r) for r in range(world_size)
    ]
    for k in range(steps):
        W = np.zeros((world_size, world_size))
        for i, sched in enumerate(schedules):
            step = next(sched)
            W[i, i] = step.self_weight
            for s, w in step.src_weights.items():
                W[s, i] = w
        xs = mix(W, xs)
        assert_all_close([g[k] for g in got], xs, torch.float64)


def _dst_weighting():
    r, n = gossamer.rank(), gossamer.size()
    # send to r+1 scaled by 0.5, receive from r-1 with weight 1.0, self 0.5 -> 0.5 (x_r + x_{r-1})
    return gossamer.neighbor_allreduce(
        data(r, dtype=torch.float64),
        self_weight=0.5,
        src_weights={(r - 1) % n: 1.0},
        dst_weights={(r + 1) % n: 0.5},
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sender_side_dst_weights(world_size):
    got = run_distributed(_dst_weighting, world_size)
    xs = [data(r, dtype=torch.float64) for r in range(world_size)]
    expected = [0.5 * (xs[r] + xs[(r - 1) % world_size]) for r in range(world_size)]
    assert_all_close(got, expected, torch.float64)


def _outside_topology():
    # receive from r+1, send to r-1: not edges of the default exponential_two graph
    r, n = gossamer.rank(), gossamer.size()
    return gossamer.neighbor_allreduce(
        data(r, dtype=torch.float64),
        self_weight=0.0,
        src_weights={(r + 1) % n: 1.0},
        dst_weights=[(r - 1) % n],
        check_topology=True,
    )


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_dynamic_peers_may_lie_outside_the_topology(world_size):
    got = run_distributed(_outside_topology, world_size)
    expected = [data((r + 1) % world_size, dtype=torch.float64) for r in range(world_size)]
    assert_all_close(got, expected, torch.float64)


def _no_sources():
    x = data(gossamer.rank(), dtype=torch.float32)
    before = x.clone()
    y = gossamer.neighbor_allreduce(x, self_weight=0.25, src_weights={}, dst_weights=[])
    assert torch.equal(x, before) and y is not x
    return y


@pytest.mark.parametrize("world_size", [1, 2])
def test_no_sources_gives_self_weight_times_x(world_size):
    got = run_distributed(_no_sources, world_size)
    assert_all_close(got, [0.25 * data(r).double() for r in range(world_size)], torch.float32)


def _allgather_static(graph):
    r = gossamer.rank()
    return gossamer.neighbor_allgather(data(r, shape=(r + 1, 2)), topology=graph)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("name", ["exponential_two", "ring_right", "star", "full"])
def test_neighbor_allgather_static(world_size, name):
    graph = _graphs(world_size)[name]
    got = run_distributed(_allgather_static, world_size, args=(graph,))
    for r, y in enumerate(got):
        srcs = graph.in_neighbors(r)
        expected = (
            torch.cat([data(s, shape=(s + 1, 2)) for s in srcs]) if srcs else torch.empty((0, 2))
        )
        assert torch.equal(y, expected)


MANY_DIMS = (1, 2, 1, 1, 1, 1, 1, 1, 1, 1, 3, 2)  # past the ten dims a call header spells out


def _many_dims(graph):
    x = data(gossamer.rank(), shape=MANY_DIMS, dtype=torch.float64)
    return gossamer.neighbor_allreduce(x, topology=graph), gossamer.neighbor_allgather(x)


@pytest.mark.parametrize("world_size", [2, 3])
def test_tensors_of_more_dims_than_the_header_spells_out(world_size):
    graph = topo.exponential_two(world_size)
    inputs = [data(r, shape=MANY_DIMS, dtype=torch.float64) for r in range(world_size)]
    expected = mix(graph.weights, inputs)
    for r, (mixed, gathered) in enumerate(run_distributed(_many_dims, world_size, args=(graph,))):
        assert mixed.shape == MANY_DIMS and torch.allclose(mixed, expected[r])
        assert torch.equal(gathered, torch.cat([inputs[s] for s in graph.in_neighbors(r)]))


def _two_threads(rounds):
    # Bagua's asynchronous averaging exchanges on a thread and a gloo group of its own.
    r, peer = gossamer.rank(), 1 - gossamer.rank()
    group = dist.new_group([0, 1], backend="gloo")
    got = []

    def background():
        mine = torch.full((1000,), 100.0 + r)
        for _ in range(rounds):
            got.append(transport.exchange("pair_gossip", mine, {peer: mine}, [peer], group)[peer])

    thread = threading.Thread(target=background)
    thread.start()
    x = torch.full((1000,), float(r))
    mixed = [gossamer.neighbor_allreduce(x, topology=topo.ring(2)) for _ in range(rounds)]
    thread.join()
    return [float(t.min()) for t in got] + [float(t.max()) for t in got], mixed


def test_a_thread_of_its_own_on_a_group_of_its_own_shares_no_buffers():
    for r, (values, mixed) in enumerate(run_distributed(_two_threads, 2, args=(100,))):
        assert set(values) == {100.0 + 1 - r} and all(torch.all(y == 0.5) for y in mixed)


def _allgather_dynamic(seed):
    r, n = gossamer.rank(), gossamer.size()
    others = [s for s in range(n) if s != r]
    order = list(np.random.default_rng(seed + r).permutation(others))
    y = gossamer.neighbor_allgather(
        torch.full((2,), r, dtype=torch.int64), src_ranks=[int(s) for s in order], dst_ranks=others
    )
    return [int(s) for s in order], y


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_neighbor_allgather_dynamic_follows_src_order(world_size):
    for order, y in run_distributed(_allgather_dynamic, world_size, args=(7,)):
        assert y.tolist() == [s for s in order for _ in range(2)]


def _pair_gossip(weighted):
    r = gossamer.rank()
    x = data(r, dtype=torch.float64)
    if weighted:
        return gossamer.pair_gossip(x, r ^ 1, self_weight=0.25, pair_weight=0.75)
    return gossamer.pair_gossip(x, r ^ 1)


@pytest.mark.parametrize("weighted", [False, True])
def test_pair_gossip(weighted):
    got = run_distributed(_pair_gossip, 4, args=(weighted,))
    xs = [data(r, dtype=torch.float64) for r in range(4)]
    a, b = (0.25, 0.75) if weighted else (0.5, 0.5)
    assert_all_close(got, [a * xs[r] + b * xs[r ^ 1] for r in range(4)], torch.float64)


def _several_async_in_flight():
    x = data(gossamer.rank(), dtype=torch.float64)
    handles = [gossamer.neighbor_allreduce(x * k, async_op=True) for k in range(5)]
    return [h.wait() for h in handles]


def test_several_async_operations_in_flight():
    got = run_distributed(_several_async_in_flight, 4)
    xs = [data(r, dtype=torch.float64) for r in range(4)]
    base = mix(topo.exponential_two(4).weights, xs)
    for k in range(5):
        assert_all_close([g[k] for g in got], [k * b for b in base], torch.float64)


def _bad_arguments():
    r, n = gossamer.rank(), gossamer.size()
    x = torch.zeros(3)
    other, prev = (r + 1) % n, (r - 1) % n
    nar = gossamer.neighbor_allreduce
    cases = [
        (ValueError, "given together", lambda: nar(x, self_weight=0.5)),
        (ValueError, "given together", lambda: nar(x, src_weights={other: 0.5})),
        (ValueError, "needs self_weight", lambda: nar(x, dst_weights=[other])),
        (
            TypeError,
            "src_weights must be a mapping",
            lambda: nar(x, self_weight=0.5, src_weights=[other]),
        ),
        (
            ValueError,
            "in-neighbours",
            lambda: nar(
                x, self_weight=0.5, src_weights={(r + 3) % n: 0.5}, topology=topo.ring(n, "left")
            ),
        ),
        (
            ValueError,
            r"src_weights key must be a rank in \[0, 4\)",
            lambda: nar(x, self_weight=0.5, src_weights={9: 0.5}, dst_weights=[other]),
        ),
        (
            ValueError,
            "must not repeat",
            lambda: nar(x, self_weight=0.5, src_weights={other: 0.5}, dst_weights=[other, other]),
        ),
        (
            ValueError,
            "must not contain this rank",
            lambda: nar(x, self_weight=0.5, src_weights={r: 0.5}, dst_weights=[other]),
        ),
        # Valid peer lists, matching across ranks: the rejecting ranks take part with them.
        (
            TypeError,
            "self_weight must be a real number",
            lambda: nar(x, self_weight="half", src_weights={prev: 0.5}, dst_weights=[other]),
        ),
        (
            ValueError,
            "finite",
            lambda: nar(x, self_weight=0.5, src_weights={prev: float("nan")}, dst_weights=[other]),
        ),
        (TypeError, "int64 is not supported", lambda: nar(torch.zeros(3, dtype=torch.int64))),
        (TypeError, "topology must be", lambda: nar(x, topology="ring")),
        (gossamer.TopologyError, "has 3 ranks", lambda: nar(x, topology=topo.ring(3))),
        (ValueError, "given together", lambda: gossamer.neighbor_allgather(x, src_ranks=[other])),
        (ValueError, "target must be another rank", lambda: gossamer.pair_gossip(x, r)),
        (TypeError, "check_topology must be a bool", lambda: nar(x, check_topology="yes")),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    return True


def test_bad_arguments_are_rejected():
    assert all(run_distributed(_bad_arguments, 4))


def _mismatched_shape():
    r = gossamer.rank()
    x = torch.zeros(3 if r != 2 else 4)
    with pytest.raises(PeerError) as info:
        gossamer.neighbor_allreduce(x, topology=topo.fully_connected(gossamer.size()))
    return str(info.value)


def test_mismatched_shapes_raise_and_show_both():
    for r, message in enumerate(run_distributed(_mismatched_shape, 3)):
        assert "float32[3]" in message and "float32[4]" in message
        if r != 2:
            assert "rank 2 called neighbor_allreduce of float32[4]" in message


def _mismatched_op():
    r = gossamer.rank()
    x = torch.zeros(2, 3)
    with pytest.raises(PeerError, match="neighbor_allgather"):
        if r == 0:
            gossamer.neighbor_allgather(x, topology=topo.fully_connected(2))
        else:
            gossamer.neighbor_allreduce(x, topology=topo.fully_connected(2))
    return gossamer.neighbor_allreduce(torch.ones(1)).item()


def test_different_operations_raise_not_hang():
    assert run_distributed(_mismatched_op, 2) == [1.0, 1.0]


def _topology_check():
    r, n = gossamer.rank(), gossamer.size()
    # rank 0 sends to 1 but rank 1 expects rank 2: a mismatch every rank must report
    src = {(r - 1) % n: 0.5} if r != 1 else {2: 0.5}
    with pytest.raises(ValueError, match="do not match"):
        gossamer.neighbor_allreduce(
            torch.zeros(2),
            self_weight=0.5,
            src_weights=src,
            dst_weights=[(r + 1) % n],
            check_topology=True,
        )
    return True


def test_topology_check_raises_on_every_rank():
    assert run_distributed(_topology_check, 3) == [True] * 3


def _unmatched_receive_times_out():
    r = gossamer.rank()
    short = dist.new_group(list(range(gossamer.size())), timeout=timedelta(seconds=2))
    # rank 0 waits for rank 1, which sends nothing: no hang, a timeout that names rank 1
    if r == 0:
        with pytest.raises(CommunicationTimeout, match=r"neighbor_allreduce.*rank 1"):
            gossamer.neighbor_allreduce(
                torch.zeros(2), self_weight=0.5, src_weights={1: 0.5}, dst_weights=[], group=short
            )
    return True


def test_unmatched_receive_times_out_naming_the_peer():
    assert run_distributed(_unmatched_receive_times_out, 2, timeout=60) == [True, True]


def _group_ranks():
    # a group of the odd ranks: topology ranks are group ranks
    n = gossamer.size()
    odd = dist.new_group([r for r in range(n) if r % 2 == 1])
    if gossamer.rank() % 2 == 0:
        return None
    x = torch.tensor([float(gossamer.rank())])
    return gossamer.neighbor_allreduce(x, topology=topo.fully_connected(n // 2), group=odd)


def test_neighbor_allreduce_on_a_subgroup():
    got = run_distributed(_group_ranks, 4)
    assert got[0] is None and got[2] is None
    assert got[1].item() == got[3].item() == 2.0


# Sizes around the chunking of messages between machines (256 KiB pieces, at most 32 per
# message): one piece, a few uneven pieces, and more data than 32 pieces of 256 KiB. With
# one rank per (fake) machine every exchange is chunked; on one machine none is.
LARGE = [(65_536,), (300_001,), (513, 6_000)]
MACHINES = {"one machine": None, "a machine per rank": {"GOSSAMER_NODES_PER_MACHINE": "1"}}


def _large(shape):
    x = data(gossamer.rank(), shape=shape)
    y = gossamer.neighbor_allreduce(x, topology=topo.exponential_two(gossamer.size()))
    first = 1000 * (gossamer.rank() + 1)  # ragged: every sender's message differs in size
    gathered = gossamer.neighbor_allgather(data(gossamer.rank(), shape=(first, 70)))
    return y, gathered


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("shape", LARGE)
@pytest.mark.parametrize("machines", sorted(MACHINES))
def test_large_messages_travel_in_chunks_and_arrive_whole(world_size, shape, machines):
    graph = topo.exponential_two(world_size)
    got = run_distributed(_large, world_size, args=(shape,), env=MACHINES[machines])
    expected = mix(graph.weights, [data(r, shape=shape) for r in range(world_size)])
    assert_all_close([y for y, _ in got], expected, torch.float32)
    for r, (_, gathered) in enumerate(got):
        srcs = graph.in_neighbors(r)
        assert torch.equal(gathered, torch.cat([data(s, shape=(1000 * (s + 1), 70)) for s in srcs]))


def _mismatched_size(sizes):
    r, n = gossamer.rank(), gossamer.size()
    with pytest.raises(PeerError):
        gossamer.neighbor_allreduce(
            torch.zeros(sizes[r == n - 1]), topology=topo.fully_connected(n)
        )
    return True


def _same_size_calls(sizes):
    graph = topo.fully_connected(gossamer.size())
    return [
        gossamer.neighbor_allreduce(data(gossamer.rank(), shape=(size,), seed=k), topology=graph)
        for k in range(2)
        for size in sizes
    ]


@pytest.mark.parametrize("world_size", [2, 3])
# (5, 300_001): the last rank waits for a large payload from lower ranks, which travels on
# the world group in both layouts, whole on one machine and in pieces across machines.
@pytest.mark.parametrize("sizes", [(3, 4), (300_001, 5), (5, 300_001)])
@pytest.mark.parametrize(
    "before, after",
    [
        ("one machine", "one machine"),
        ("one machine", "a machine per rank"),
        ("a machine per rank", "one machine"),
        ("a machine per rank", "a machine per rank"),
    ],
)
def test_calls_after_a_mismatched_size_get_their_own_data(world_size, sizes, before, after):
    # The mismatch leaves receives posted for the other size (gloo cannot withdraw them);
    # the calls after it, in the same runtime or after a re-init on the same process group
    # (a change of layout), must each still receive their own data, for both sizes.
    assert all(run_distributed(_mismatched_size, world_size, args=(sizes,), env=MACHINES[before]))
    got = run_distributed(_same_size_calls, world_size, args=(sizes,), env=MACHINES[after])
    graph = topo.fully_connected(world_size)
    for k, (seed, size) in enumerate((s, z) for s in range(2) for z in sizes):
        inputs = [data(r, shape=(size,), seed=seed) for r in range(world_size)]
        assert_all_close([g[k] for g in got], mix(graph.weights, inputs), torch.float32)


def _large_mismatch():
    x = torch.zeros(400_000 if gossamer.rank() != 1 else 500_000)
    with pytest.raises(PeerError) as info:
        gossamer.neighbor_allreduce(x, topology=topo.fully_connected(gossamer.size()))
    return str(info.value)


@pytest.mark.parametrize("machines", sorted(MACHINES))
def test_large_mismatched_shapes_raise_not_abort(machines):
    for message in run_distributed(_large_mismatch, 3, env=MACHINES[machines]):
        assert "float32[400000]" in message and "float32[500000]" in message


def _first_messages(numel):
    from gossamer.transport import Header, p2p

    x = data(gossamer.rank(), shape=(numel,))
    peer = 1 - gossamer.rank()
    firsts, rests = p2p._firsts(Header.of("neighbor_allreduce", x), {peer: x}, None)
    (dst, first), *more = firsts[p2p._HEADER_TAG] + firsts[p2p._STICKY_TAG]
    head = Header.decode(first[: HEADER_LEN * 8].view(torch.int64))
    inline = first[HEADER_LEN * 8 :]
    same = torch.equal(inline, x.view(torch.uint8))
    return dst == peer and not more, head.inline, same, [t.nbytes for _, t in rests]


@pytest.mark.parametrize("machines", sorted(MACHINES))
def test_a_small_payload_travels_in_its_headers_message(machines):
    # One gloo message per destination instead of two: the header's receive is sized to
    # hold it. Up to one 256 KiB piece in all (the largest message sent whole between
    # machines), on one machine as between machines.
    small, large, env = 1000, 70_000, MACHINES[machines]
    for ok, inline, same, rests in run_distributed(_first_messages, 2, args=(small,), env=env):
        assert ok and inline == 4 * small and same and rests == []
    for ok, inline, _, rests in run_distributed(_first_messages, 2, args=(large,), env=env):
        assert ok and inline == 0 and rests == [4 * large]


REPEATS = [(300_000,)] * 3 + [(600, 500)] * 2 + [(1000,), (300_000,), (300_000,)]


def _repeated_calls(shapes):
    from gossamer import profiling

    graph = topo.fully_connected(gossamer.size())
    out, sent = [], []
    for k, shape in enumerate(shapes):
        profiling.reset_bytes_sent()
        out.append(
            gossamer.neighbor_allreduce(data(gossamer.rank(), shape, seed=k), topology=graph)
        )
        sent.append(profiling.bytes_sent())
    return out, sent


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("machines", sorted(MACHINES))
def test_a_repeated_call_on_one_machine_sends_its_payload_alone(machines, world_size):
    # Between two ranks of one machine, a large call that repeats the edge's last header
    # sends no header: one gloo message instead of two. A changed call sends its header
    # first (on the same tag), a small one carries its payload, and the results are those
    # of the full weight matrix in every case.
    got = run_distributed(_repeated_calls, world_size, args=(REPEATS,), env=MACHINES[machines])
    graph = topo.fully_connected(world_size)
    peers, head = world_size - 1, HEADER_LEN * 8
    sticky = machines == "one machine"
    repeat = [False, True, True, False, True, False, False, True]
    for k, shape in enumerate(REPEATS):
        inputs = [data(r, shape, seed=k) for r in range(world_size)]
        assert_all_close([out[k] for out, _ in got], mix(graph.weights, inputs), torch.float32)
        payload = 4 * math.prod(shape)
        want = peers * (payload + (0 if sticky and repeat[k] else head))
        assert all(sent[k] == want for _, sent in got), (k, [sent[k] for _, sent in got], want)


def _mismatch_after_repeats(odd_shape):
    graph = topo.fully_connected(gossamer.size())
    x = torch.ones(300_000)
    for _ in range(2):
        gossamer.neighbor_allreduce(x, topology=graph)
    odd = torch.ones(odd_shape) if gossamer.rank() == 1 else x
    with pytest.raises(PeerError) as info:
        gossamer.neighbor_allreduce(odd, topology=graph)
    after = [gossamer.neighbor_allreduce(k * x, topology=graph) for k in (2.0, 3.0)]
    return str(info.value), after


@pytest.mark.parametrize("odd_shape", [(600, 500), (400_000,)], ids=["same bytes", "larger"])
def test_a_call_that_changes_after_repeats_is_a_mismatch_on_every_rank(odd_shape):
    # Rank 1 changes its call on edges that carried payloads alone: it receives the others'
    # repeated payloads (their header is the edge's last one), and they receive its new
    # header. Every rank raises naming both calls; the next calls are correct.
    odd = f"float32{list(odd_shape)}".replace(" ", "")
    for message, after in run_distributed(_mismatch_after_repeats, 3, args=(odd_shape,)):
        assert "float32[300000]" in message and odd in message.replace(" ", "")
        for k, y in zip((2.0, 3.0), after, strict=True):
            torch.testing.assert_close(y, torch.full((300_000,), k))


def _plain_then_surviving():
    from gossamer import transport

    r, n = gossamer.rank(), gossamer.size()
    x = torch.full((300_000,), float(r))
    nxt, prv = (r + 1) % n, (r - 1) % n
    calls = [transport.exchange] * 2 + [transport.exchange_surviving] * 2 + [transport.exchange]
    got = []
    for call in calls:

        def body(call=call):
            received = call("neighbor_allreduce", x, {nxt: x}, [prv])
            received = received.received if isinstance(received, transport.Survived) else received
            return received[prv].clone()

        got.append(transport.run("probe", body, False))
    return got


def test_the_elastic_exchange_shares_the_edges_with_the_plain_one():
    for r, got in enumerate(run_distributed(_plain_then_surviving, 3)):
        for y in got:
            torch.testing.assert_close(y, torch.full((300_000,), float((r - 1) % 3)))


def _world_and_subgroup_calls():
    from gossamer import profiling

    n, r = gossamer.size(), gossamer.rank()
    odd = dist.new_group([k for k in range(n) if k % 2 == 1])
    world, pair = [], []
    for k in range(3):
        world.append(gossamer.neighbor_allreduce(data(r, (300_000,), seed=k)))
        if r % 2 == 1:
            profiling.reset_bytes_sent()
            x = data(r, (200_000,), seed=k)
            y = gossamer.neighbor_allreduce(x, topology=topo.fully_connected(n // 2), group=odd)
            pair.append((y, profiling.bytes_sent()))
    return world, pair


def test_the_edges_of_a_subgroup_are_its_own():
    # Ranks 1 and 3 alternate a world call and a call on their own group, of other shapes:
    # each edge remembers its group's last header, so both repeat without headers.
    got = run_distributed(_world_and_subgroup_calls, 4)
    graph = topo.exponential_two(4)
    for k in range(3):
        inputs = [data(r, (300_000,), seed=k) for r in range(4)]
        assert_all_close([w[k] for w, _ in got], mix(graph.weights, inputs), torch.float32)
        mean = (data(1, (200_000,), seed=k).double() + data(3, (200_000,), seed=k).double()) / 2
        for r in (1, 3):
            y, sent = got[r][1][k]
            assert_all_close([y], [mean], torch.float32)
            assert sent == 800_000 + (HEADER_LEN * 8 if k == 0 else 0)
