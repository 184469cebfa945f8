import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.testing import run_distributed
from oracle import assert_all_close, machine_input


def _env(k):
    return {"GOSSAMER_NODES_PER_MACHINE": str(k)}


def _uniform():
    gossamer.set_machine_topology(topo.exponential_two(gossamer.machine_size()))
    try:
        return gossamer.hierarchical_neighbor_allreduce(machine_input())
    finally:
        gossamer.set_machine_topology(None)


@pytest.mark.parametrize(("world_size", "k"), [(4, 2), (4, 1), (4, 4), (2, 1), (3, 1), (2, 2)])
def test_uniform_machine_topology(world_size, k):
    got = run_distributed(_uniform, world_size, env=_env(k))
    machines = world_size // k
    graph = topo.exponential_two(machines)
    expected = []
    for r in range(world_size):
        m = r // k
        srcs = graph.in_neighbors(m)
        expected.append(torch.full((3, 2), (m + sum(srcs)) / (len(srcs) + 1), dtype=torch.float64))
    assert_all_close(got, expected, torch.float64)


def _weighted_machine_topology(W):
    gossamer.set_machine_topology(topo.Topology(W))
    try:
        return gossamer.hierarchical_neighbor_allreduce(machine_input())
    finally:
        gossamer.set_machine_topology(None)


def test_weighted_machine_topology():
    W = [[0.3, 0.6], [0.7, 0.4]]  # column j: machine j's receive weights
    got = run_distributed(_weighted_machine_topology, 4, args=(W,), env=_env(2))
    expected = [0.3 * 0 + 0.7 * 1, 0.3 * 0 + 0.7 * 1, 0.6 * 0 + 0.4 * 1, 0.6 * 0 + 0.4 * 1]
    assert_all_close(
        got, [torch.full((3, 2), e, dtype=torch.float64) for e in expected], torch.float64
    )


def _dynamic_move(src_w, dst_w):
    m, M = gossamer.machine_rank(), gossamer.machine_size()
    return gossamer.hierarchical_neighbor_allreduce(
        machine_input(),
        self_weight=0.0,
        src_machine_weights={(m + 1) % M: src_w},
        dst_machine_weights={(m - 1) % M: dst_w},
    )


@pytest.mark.parametrize(("src_w", "dst_w"), [(1.0, 1.0), (0.5, 2.0)])
@pytest.mark.parametrize(("world_size", "k"), [(4, 2), (4, 1)])
def test_dynamic_move_needs_no_machine_topology(src_w, dst_w, world_size, k):
    got = run_distributed(_dynamic_move, world_size, args=(src_w, dst_w), env=_env(k))
    machines = world_size // k
    expected = [
        torch.full((3, 2), float((r // k + 1) % machines), dtype=torch.float64)
        for r in range(world_size)
    ]
    assert_all_close(got, expected, torch.float64)


def _local_allreduce():
    x = torch.tensor([float(gossamer.rank())])
    inplace = x.clone()
    handle = gossamer.local_allreduce_(inplace, average=False, async_op=True)
    assert handle.wait() is inplace
    out = gossamer.local_allreduce(x).item(), gossamer.local_allreduce(x, average=False).item()
    return (*out, inplace.item(), x.item())


@pytest.mark.parametrize(("world_size", "k"), [(4, 2), (4, 4), (3, 1)])
def test_local_allreduce(world_size, k):
    got = run_distributed(_local_allreduce, world_size, env=_env(k))
    for r, (avg, total, inplace, x) in enumerate(got):
        first = r - r % k
        assert avg == first + (k - 1) / 2
        assert total == inplace == sum(range(first, first + k))
        assert x == r  # out of place leaves the input


def _errors():
    x = torch.zeros(2)
    with pytest.raises(gossamer.TopologyError, match="no machine topology"):
        gossamer.hierarchical_neighbor_allreduce(x)
    with pytest.raises(ValueError, match="given together"):
        gossamer.hierarchical_neighbor_allreduce(x, self_weight=0.5, src_machine_weights={})
    with pytest.raises(ValueError, match=r"src_machine_weights key must be a machine in \[0, 2\)"):
        gossamer.hierarchical_neighbor_allreduce(
            x, self_weight=0.5, src_machine_weights={5: 0.5}, dst_machine_weights=[]
        )
    me = gossamer.machine_rank()
    with pytest.raises(ValueError, match=rf"must not contain this machine \({me}\)"):
        gossamer.hierarchical_neighbor_allreduce(
            x, self_weight=0.5, src_machine_weights={me: 0.5}, dst_machine_weights=[]
        )
    with pytest.raises(ValueError, match="dst_machine_weights must not contain this machine"):
        gossamer.hierarchical_neighbor_allreduce(
            x, self_weight=0.5, src_machine_weights={}, dst_machine_weights=[me]
        )
    with pytest.raises(gossamer.TopologyError, match="2 machines"):
        gossamer.set_machine_topology(topo.ring(3))
    return True


def test_bad_arguments():
    assert all(run_distributed(_errors, 4, env=_env(2)))


def _uneven():
    with pytest.raises(gossamer.TopologyError, match="same number of ranks"):
        gossamer.hierarchical_neighbor_allreduce(
            torch.zeros(2), self_weight=1.0, src_machine_weights={}, dst_machine_weights=[]
        )
    return True


def test_uneven_machines_are_refused():
    assert all(run_distributed(_uneven, 3, env=_env(2)))


def _half_near_the_top(dtype):
    # Values whose machine sum overflows float16 (max 65504) while every average fits.
    m, M = gossamer.machine_rank(), gossamer.machine_size()
    x = torch.full((3,), 30000.0 + 1000.0 * gossamer.rank(), dtype=dtype)
    gossamer.set_machine_topology(topo.fully_connected(M))
    try:
        uniform = gossamer.hierarchical_neighbor_allreduce(x)
    finally:
        gossamer.set_machine_topology(None)
    other = {(m + 1) % M: 0.75} if M > 1 else {}
    weighted = gossamer.hierarchical_neighbor_allreduce(
        x, self_weight=0.25 if M > 1 else 1.0, src_machine_weights=other,
        dst_machine_weights=list(other),
    )  # fmt: skip
    return uniform, weighted


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("world_size", "k"), [(4, 2), (3, 3)])
def test_half_types_average_where_the_machine_sum_would_overflow(dtype, world_size, k):
    got = run_distributed(_half_near_the_top, world_size, args=(dtype,), env=_env(k))
    machines = world_size // k
    means = [30000.0 + 1000.0 * (m * k + (k - 1) / 2) for m in range(machines)]
    for r, (uniform, weighted) in enumerate(got):
        m = r // k
        want_w = means[m] if machines == 1 else 0.25 * means[m] + 0.75 * means[(m + 1) % machines]
        for value, want in ((uniform, sum(means) / machines), (weighted, want_w)):
            assert value.dtype == dtype and torch.isfinite(value).all()
            torch.testing.assert_close(
                value.double(), torch.full((3,), want).double(), rtol=4e-3, atol=0
            )
