import pytest
import torch
import torch.distributed as dist

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


def _reverse_group_size():
    group = gossamer.context.reverse_group()
    return None if group is None else group.size()


@pytest.mark.parametrize(("world_size", "k", "expected"), [(2, 2, None), (2, 1, 2), (4, 2, 4)])
def test_reverse_group_spans_the_world_only_across_machines(world_size, k, expected):
    env = {"GOSSAMER_NODES_PER_MACHINE": str(k)}
    assert run_distributed(_reverse_group_size, world_size, env=env) == [expected] * world_size


def _swap(numel):
    # Both directions of every pair at once (r <-> r + size/2), large enough to be chunked.
    size, rank = gossamer.size(), gossamer.rank()
    peer = (rank + size // 2) % size
    x = torch.arange(numel, dtype=torch.float32) + rank
    got = gossamer.neighbor_allreduce(
        x, self_weight=0.25, src_weights={peer: 0.75}, dst_weights={peer: 1.0}
    )
    return got


@pytest.mark.parametrize("world_size", [2, 4])
def test_pair_swap_across_machines_matches_the_weighted_average(world_size):
    numel = 700_001
    env = {"GOSSAMER_NODES_PER_MACHINE": "1"}
    got = run_distributed(_swap, world_size, args=(numel,), env=env)
    base = torch.arange(numel, dtype=torch.float32)
    for rank, y in enumerate(got):
        peer = (rank + world_size // 2) % world_size
        torch.testing.assert_close(y, 0.25 * (base + rank) + 0.75 * (base + peer))


def _nccl_device_check(labels):
    """The init-time NCCL check over the host group, with each rank's device label given."""
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


def _init_with_a_store_on_rank_0_only(store_file):
    store = dist.FileStore(store_file, 1) if gossamer.rank() == 0 else None
    gossamer.shutdown()  # the harness's runtime; it inits again at the next call
    try:
        gossamer.init(store=store, timeout=10)
    except ValueError as err:
        return str(err)
    finally:
        gossamer.shutdown()
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_store_given_on_some_ranks_only_is_refused_on_every_rank(tmp_path, world_size):
    env = {"GOSSAMER_TEST_RUN": tmp_path.name}  # a re-init at the next call
    store_file = str(tmp_path / "store")
    got = run_distributed(
        _init_with_a_store_on_rank_0_only, world_size, args=(store_file,), env=env
    )
    without = list(range(1, world_size))
    want = (
        f"init(store=...) must be given a store on every rank or on none; ranks {without} gave none"
    )
    assert got == [want] * world_size
