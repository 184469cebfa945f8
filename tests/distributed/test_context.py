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


def _nccl_device_check(labels):
    """The init-time NCCL check over the host group, with each rank's device label given."""
    import torch

    from gossamer import context

    saved = context._device_label
    context._device_label = lambda index: labels[gossamer.rank()]
    try:
        context._check_nccl_devices(context.layout(), torch.device("cuda", 0), context.host_group())
    except ValueError as err:
        return str(err)
    finally:
        context._device_label = saved
    return None


def test_nccl_check_raises_on_every_rank_that_shares_a_gpu():
    # Every rank learns every rank's device, so all raise alike (none is left waiting).
    shared = run_distributed(_nccl_device_check, 3, args=(["cuda:0 (GPU-a)"] * 3,))
    assert all("ranks [0, 1, 2] of machine 0 would share cuda:0 (GPU-a)" in e for e in shared)
    distinct = ["cuda:0 (GPU-a)", "cuda:1 (GPU-b)", "cuda:0 (GPU-c)"]
    assert run_distributed(_nccl_device_check, 3, args=(distinct,)) == [None] * 3
