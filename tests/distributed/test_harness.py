import os
import socket
import time

import pytest
import torch
import torch.distributed as dist

import gossamer
from gossamer.testing import RankError, RankPool, free_port, run_distributed


def _whoami():
    return gossamer.rank(), gossamer.size(), os.getpid()


def _allreduce_rank():
    t = torch.tensor([float(gossamer.rank())])
    dist.all_reduce(t)
    return t.item()


def _fail_on(bad_rank):
    if gossamer.rank() == bad_rank:
        raise ValueError(f"deliberate failure on rank {bad_rank}")
    return gossamer.rank()


def _fail_then_collective(bad_rank):
    if gossamer.rank() == bad_rank:
        raise KeyError("gone before the barrier")
    dist.barrier()


def _sleep_on_rank0(seconds):
    if gossamer.rank() == 0:
        time.sleep(seconds)


def _die_on_last():
    if gossamer.rank() == gossamer.size() - 1:
        os._exit(7)


def _unpicklable_result():
    return lambda: None


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_rank_runs_and_results_come_back_in_rank_order(world_size):
    results = run_distributed(_whoami, world_size)
    assert [r[:2] for r in results] == [(r, world_size) for r in range(world_size)]
    assert len({pid for *_, pid in results}) == world_size


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_ranks_share_a_real_process_group(world_size):
    expected = float(sum(range(world_size)))
    assert run_distributed(_allreduce_rank, world_size) == [expected] * world_size


def test_pool_is_reused_between_calls():
    first = run_distributed(_whoami, 2)
    start = time.perf_counter()
    second = run_distributed(_whoami, 2)
    elapsed = time.perf_counter() - start
    assert first == second  # same processes: no new start-up
    print(f"one pooled call took {elapsed * 1e3:.2f} ms")


def test_child_traceback_is_raised_in_parent_and_pool_recovers():
    with pytest.raises(RankError, match="rank 1 raised") as info:
        run_distributed(_fail_on, 3, args=(1,))
    assert "ValueError: deliberate failure on rank 1" in str(info.value)
    assert "_fail_on" in str(info.value)  # the child's traceback, not just the message
    assert run_distributed(_fail_on, 3, args=(99,)) == [0, 1, 2]


def test_ranks_stuck_waiting_for_a_failed_rank_are_reported_not_hung():
    start = time.perf_counter()
    with pytest.raises(RankError) as info:
        run_distributed(_fail_then_collective, 3, args=(0,))
    assert "KeyError" in str(info.value)
    assert time.perf_counter() - start < 30


def test_deadline_names_the_late_rank():
    with pytest.raises(RankError, match=r"ranks \[0\] did not finish within 1 s"):
        run_distributed(_sleep_on_rank0, 2, args=(60,), timeout=1)


def test_a_dead_rank_is_reported_with_its_exit_code():
    with pytest.raises(RankError, match=r"rank 2 died \(exit code 7\)"):
        run_distributed(_die_on_last, 3)


def test_unpicklable_function_and_result_give_clear_errors():
    with pytest.raises(TypeError, match="picklable"):
        run_distributed(lambda: 1, 1)
    with pytest.raises(RankError, match="not picklable"):
        run_distributed(_unpicklable_result, 1)


def _env_and_machines():
    return os.environ.get("GOSSAMER_NODES_PER_MACHINE"), gossamer.machine_size(), os.getpid()


def test_call_environment_is_applied_then_undone_in_the_same_processes():
    before = run_distributed(_env_and_machines, 4)
    during = run_distributed(_env_and_machines, 4, env={"GOSSAMER_NODES_PER_MACHINE": "2"})
    after = run_distributed(_env_and_machines, 4)
    assert [r[:2] for r in before] == [(None, 1)] * 4
    assert [r[:2] for r in during] == [("2", 2)] * 4
    assert after == before
    assert {r[2] for r in during} == {r[2] for r in before}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_bad_world_size_is_rejected(bad):
    with pytest.raises(ValueError, match="world_size"):
        RankPool(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -3, float("nan"), "1"])
def test_bad_timeout_is_rejected(bad):
    with pytest.raises(ValueError, match="timeout"):
        run_distributed(_whoami, 1, timeout=bad)


def test_free_port_is_free_and_below_the_ephemeral_range():
    with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
        low = int(ports.read().split()[0])
    found = {free_port() for _ in range(20)}
    assert all(10_000 <= port < low for port in found) and len(found) > 1
    port = found.pop()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # raises if the port was taken


def _unseeded_draws():
    import numpy as np

    return torch.rand(2).tolist(), np.random.rand(2).tolist()


@pytest.mark.parametrize("world_size", [2, 3])
def test_fresh_ranks_draw_their_own_random_numbers(world_size):
    pool = RankPool(world_size)  # fresh processes, not ones earlier tests seeded
    try:
        draws = pool.run(_unseeded_draws, (), {}, {}, 60)
    finally:
        pool.close()
    for which in range(2):
        assert len({tuple(d[which]) for d in draws}) == world_size
