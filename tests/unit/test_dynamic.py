"""Dynamic schedules: per-rank consistency and agreement with BlueFog's rules."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np
import pytest

from gossamer.topology import (
    Step,
    Topology,
    exponential,
    exponential_two,
    inner_outer_exponential_two,
    inner_outer_ring,
    machine_exponential_two,
    mesh_grid_2d,
    one_peer_exponential,
    ring,
    star,
    symmetric_exponential,
)

LAYOUTS = [(8, 2), (8, 4), (12, 3), (16, 4), (12, 4), (15, 5), (6, 3), (24, 6), (32, 4)]
INNER_OUTER_LAYOUTS = [(w, n) for w, n in LAYOUTS if n > 2] + [(3, 3), (4, 4), (5, 5)]


def num_steps(size: int) -> int:
    return 2 * math.ceil(math.log2(size)) + 3 if size > 1 else 3


def take(schedule: Iterator[Step], count: int) -> list[Step]:
    return list(itertools.islice(schedule, count))


def assert_consistent(schedules: dict[int, list[Step]]) -> None:
    """i sends to j at step k exactly when j receives from i at step k.

    ``schedules`` maps a node (a rank, or a machine) to its first steps.
    """
    steps = len(next(iter(schedules.values())))
    for k in range(steps):
        sent = {(i, j) for i, s in schedules.items() for j in s[k].send_ranks}
        received = {(i, j) for j, s in schedules.items() for i in s[k].recv_ranks}
        assert sent == received, f"step {k}"
        for node, step_list in schedules.items():
            step = step_list[k]
            assert node not in step.send_ranks and node not in step.recv_ranks
            assert list(step.recv_ranks) == sorted(step.recv_ranks)
            assert step.self_weight + sum(step.src_weights.values()) == pytest.approx(1.0)


# --- Step ---------------------------------------------------------------------------------


def test_step_uniform_weights():
    step = Step.uniform([4], [1, 3])
    assert step.send_ranks == (4,) and step.recv_ranks == (1, 3)
    assert step.self_weight == pytest.approx(1 / 3)
    assert dict(step.src_weights) == {1: pytest.approx(1 / 3), 3: pytest.approx(1 / 3)}
    assert dict(step.dst_weights) == {4: 1.0}
    idle = Step.uniform([], [])
    assert idle.self_weight == 1.0 and not idle.src_weights and not idle.dst_weights


def test_step_is_an_immutable_hashable_value():
    step = Step((1,), (2,), 0.5, {2: 0.5}, {1: 1.0})
    assert step == Step.uniform([1], [2])
    assert hash(step) == hash(Step.uniform((1,), (2,)))
    with pytest.raises(TypeError):
        step.src_weights[2] = 1.0  # type: ignore[index]
    with pytest.raises(AttributeError):
        step.self_weight = 1.0  # type: ignore[misc]


def test_step_copies_its_inputs():
    weights = {2: 0.5}
    step = Step([1], [2], 0.5, weights, {1: 1.0})
    weights[2] = 0.0
    assert step.src_weights[2] == 0.5
    assert step.send_ranks == (1,)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (((1,), (2,), 0.5, {3: 0.5}, {1: 1.0}), ValueError, "src_weights"),
        (((1,), (2,), 0.5, {2: 0.5}, {}), ValueError, "dst_weights"),
        (((1,), (2,), 0.5, [(2, 0.5)], {1: 1.0}), TypeError, "src_weights"),
        (((-1,), (), 1.0, {}, {-1: 1.0}), ValueError, "send_ranks"),
        (((1, 1), (), 1.0, {}, {1: 1.0}), ValueError, "send_ranks"),
        (((), (True,), 0.5, {True: 0.5}, {}), TypeError, "recv_ranks"),
        (((), (2,), float("nan"), {2: 0.5}, {}), ValueError, "self_weight"),
        (((), (2,), 0.5, {2: float("inf")}, {}), ValueError, "src_weights"),
    ],
)
def test_step_validation(args, error, match):
    with pytest.raises(error, match=match):
        Step(*args)


# --- one peer -------------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(2, 17))
def test_one_peer_on_exponential_two_shifts_by_powers_of_two(size):
    hops = math.ceil(math.log2(size))
    count = num_steps(size)
    schedules = {
        r: take(one_peer_exponential(exponential_two(size), r), count) for r in range(size)
    }
    assert_consistent(schedules)
    for r, steps in schedules.items():
        for k, step in enumerate(steps):
            shift = 2 ** (k % hops)
            assert step.send_ranks == ((r + shift) % size,)
            assert step.recv_ranks == ((r - shift) % size,)
            assert step.self_weight == 0.5 and dict(step.src_weights) == {(r - shift) % size: 0.5}
            assert dict(step.dst_weights) == {(r + shift) % size: 1.0}


TOPOLOGIES = {
    "exponential_base3": lambda n: exponential(n, 3),
    "symmetric_exponential": symmetric_exponential,
    "mesh_grid_2d": mesh_grid_2d,
    "star": star,
    "ring_left": lambda n: ring(n, "left"),
    "ring": ring,
}


@pytest.mark.parametrize("size", [2, 3, 5, 6, 9, 16])
@pytest.mark.parametrize("name", TOPOLOGIES)
def test_one_peer_is_consistent_on_any_topology(name, size):
    topo = TOPOLOGIES[name](size)
    count = num_steps(size)
    schedules = {r: take(one_peer_exponential(topo, r), count) for r in range(size)}
    assert_consistent(schedules)
    for r, steps in schedules.items():
        peers = sorted(topo.out_neighbors(r), key=lambda d, r=r: (d - r) % size)
        for k, step in enumerate(steps):
            assert step.send_ranks == (peers[k % len(peers)],)


def test_one_peer_on_star_gathers_every_leaf_at_the_centre():
    steps = take(one_peer_exponential(star(5), 0), 4)
    assert [s.send_ranks for s in steps] == [(1,), (2,), (3,), (4,)]
    assert all(s.recv_ranks == (1, 2, 3, 4) for s in steps)
    assert steps[0].self_weight == pytest.approx(0.2)
    leaf = take(one_peer_exponential(star(5), 3), 4)
    assert [s.recv_ranks for s in leaf] == [(), (), (0,), ()]


def test_one_peer_rank_without_out_neighbors_sends_nothing():
    # Rank 1 has no out-neighbours; rank 0's only out-neighbour is 1.
    topo = Topology([[0.5, 0.5], [0.0, 1.0]])
    sink = take(one_peer_exponential(topo, 1), 3)
    assert all(s.send_ranks == () and s.recv_ranks == (0,) for s in sink)
    source = take(one_peer_exponential(topo, 0), 3)
    assert all(s.send_ranks == (1,) and s.recv_ranks == () for s in source)
    single = next(one_peer_exponential(exponential_two(1), 0))
    assert single == Step.uniform((), ())


def test_one_peer_validates_eagerly():
    with pytest.raises(TypeError, match="topology"):
        one_peer_exponential(np.eye(4), 0)
    with pytest.raises(ValueError, match=r"rank.*8"):
        one_peer_exponential(exponential_two(8), 8)
    with pytest.raises(TypeError, match="rank"):
        one_peer_exponential(exponential_two(8), True)
    with pytest.raises(TypeError, match="rank"):
        one_peer_exponential(exponential_two(8), 0.0)


# --- machine exponential two ----------------------------------------------------------------


@pytest.mark.parametrize(("world_size", "local_size"), [*LAYOUTS, (4, 1), (2, 1), (9, 3)])
def test_machine_exponential_two(world_size, local_size):
    machines = world_size // local_size
    period = int(math.log2(machines - 1)) + 1
    count = num_steps(machines)
    per_machine: dict[int, list[Step]] = {}
    for rank in range(world_size):
        steps = take(machine_exponential_two(world_size, local_size, rank), count)
        machine = rank // local_size
        # Every rank of a machine sees the same machine-level schedule.
        assert per_machine.setdefault(machine, steps) == steps
        for k, step in enumerate(steps):
            dist = 2 ** (k % period)
            assert step.send_ranks == ((machine + dist) % machines,)
            assert step.recv_ranks == ((machine - dist) % machines,)
    assert_consistent(per_machine)


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((8, 8, 0), ValueError, "two machines"),
        ((4, 8, 0), ValueError, "multiple"),
        ((8, 3, 0), ValueError, "world_size.*local_size"),
        ((8, 2, 8), ValueError, "rank"),
        ((8, 2, -1), ValueError, "rank"),
        ((0, 1, 0), ValueError, "world_size"),
        ((8, 0, 0), ValueError, "local_size"),
        ((True, 1, 0), TypeError, "world_size"),
        ((8, 2.0, 0), TypeError, "local_size"),
        ((8, 2, "0"), TypeError, "rank"),
    ],
)
def test_machine_exponential_two_rejects_bad_arguments(args, error, match):
    with pytest.raises(error, match=match):
        machine_exponential_two(*args)


# --- inner / outer --------------------------------------------------------------------------


def expected_inner_outer(world_size, local_size, rank, step, outer, inner):
    """Independent model: outside rank hops machines; the rest walk a ring without it."""
    machines = world_size // local_size
    machine, local = divmod(rank, local_size)
    outside = step % local_size
    if local == outside:
        if machines == 1:
            return (), ()
        dist = outer(step, machines)
        send = ((machine + dist) % machines) * local_size + local
        recv = ((machine - dist) % machines) * local_size + local
        return (send,), (recv,)
    members = [x for x in range(local_size) if x != outside]
    position = members.index(local)
    dist = inner(step, local_size)
    send = members[(position + dist) % len(members)]
    recv = members[(position - dist) % len(members)]
    return (machine * local_size + send,), (machine * local_size + recv,)


def ring_dist(_step, _count):
    return 1


def outer_exp2(step, machines):
    return 2 ** (step % (int(math.log2(machines - 1)) + 1))


def inner_exp2(step, local_size):
    return 2 ** (step % (int(math.log2(local_size - 2)) + 1))


SCHEMES = {
    "inner_outer_ring": (inner_outer_ring, ring_dist, ring_dist),
    "inner_outer_exponential_two": (inner_outer_exponential_two, outer_exp2, inner_exp2),
}


@pytest.mark.parametrize(("world_size", "local_size"), INNER_OUTER_LAYOUTS)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_inner_outer_schedules(scheme, world_size, local_size):
    function, outer, inner = SCHEMES[scheme]
    count = num_steps(world_size)
    schedules = {r: take(function(world_size, local_size, r), count) for r in range(world_size)}
    assert_consistent(schedules)
    for rank, steps in schedules.items():
        for k, step in enumerate(steps):
            send, recv = expected_inner_outer(world_size, local_size, rank, k, outer, inner)
            assert (step.send_ranks, step.recv_ranks) == (send, recv), (rank, k)
            if send:
                assert step.self_weight == 0.5 and dict(step.dst_weights) == {send[0]: 1.0}


def test_inner_outer_ring_literal_8_4():
    # Machine 0 holds ranks 0..3. Step 1: local rank 1 goes out, so 0 -> 2 skips it.
    steps = [take(inner_outer_ring(8, 4, r), 2) for r in range(8)]
    assert [s[0].send_ranks[0] for s in steps] == [4, 2, 3, 1, 0, 6, 7, 5]
    assert [s[1].send_ranks[0] for s in steps] == [2, 5, 3, 0, 6, 1, 7, 4]


def test_inner_outer_exponential_two_literal_16_4_rank_1_always_hops_two_machines():
    # BlueFog's own note: with 16 machines of 4, local rank 1 only ever goes 2 machines out.
    steps = take(inner_outer_exponential_two(64, 4, 1), 40)
    outside = [s.send_ranks[0] for k, s in enumerate(steps) if k % 4 == 1]
    assert set(outside) == {1 + 2 * 4}


def test_inner_outer_single_machine_outside_rank_idles():
    for function in (inner_outer_ring, inner_outer_exponential_two):
        steps = take(function(4, 4, 2), 4)
        assert steps[2] == Step.uniform((), ())
        assert steps[0].send_ranks == (3,)


@pytest.mark.parametrize("function", [inner_outer_ring, inner_outer_exponential_two])
@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        ((8, 2, 0), ValueError, "local_size.*> 2"),
        ((4, 1, 0), ValueError, "local_size"),
        ((9, 4, 0), ValueError, "multiple"),
        ((8, 4, 8), ValueError, "rank"),
        ((0, 4, 0), ValueError, "world_size"),
        ((8.0, 4, 0), TypeError, "world_size"),
        ((8, None, 0), TypeError, "local_size"),
        ((8, 4, False), TypeError, "rank"),
    ],
)
def test_inner_outer_rejects_bad_arguments(function, args, error, match):
    with pytest.raises(error, match=match):
        function(*args)
