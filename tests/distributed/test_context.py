import pytest

import gossamer
from gossamer.testing import run_distributed


def _layout():
    gossamer.init()  # idempotent: the harness already initialized
    return (
        gossamer.rank(),
        gossamer.size(),
        gossamer.local_rank(),
        gossamer.local_size(),
        gossamer.machine_rank(),
        gossamer.machine_size(),
        gossamer.is_homogeneous(),
    )


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_one_host_is_one_machine(world_size):
    got = run_distributed(_layout, world_size)
    assert got == [(r, world_size, r, world_size, 0, 1, True) for r in range(world_size)]


@pytest.mark.parametrize(("world_size", "k"), [(4, 2), (4, 1), (3, 3), (4, 4)])
def test_fake_machines_from_nodes_per_machine(world_size, k):
    got = run_distributed(_layout, world_size, env={"GOSSAMER_NODES_PER_MACHINE": str(k)})
    expected = [(r, world_size, r % k, k, r // k, world_size // k, True) for r in range(world_size)]
    assert got == expected


def test_uneven_fake_machines_are_not_homogeneous():
    got = run_distributed(_layout, 3, env={"GOSSAMER_NODES_PER_MACHINE": "2"})
    # machine 0 = ranks {0, 1}, machine 1 = rank {2}
    assert got == [(0, 3, 0, 2, 0, 2, False), (1, 3, 1, 2, 0, 2, False), (2, 3, 0, 1, 1, 2, False)]
