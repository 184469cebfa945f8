"""Single-process checks of the transport's pieces: payload bytes, headers, liveness, errors."""

import concurrent.futures
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import gossamer
from gossamer.errors import CommunicationTimeout, PeerError, RankLostError
from gossamer.transport import DTYPES, Header, as_bytes, from_bytes, get_liveness
from gossamer.transport.failures import translate
from gossamer.transport.liveness import Liveness
from gossamer.transport.rejection import rejected_header


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (3, 2)], ids=str)
def test_payload_bytes_view_back_to_the_tensor(dtype, shape):
    x = torch.arange(1, torch.Size(shape).numel() + 1).reshape(shape).to(dtype)
    data = as_bytes(x)
    assert data.dtype == torch.uint8 and data.numel() == x.numel() * dtype.itemsize
    assert data.data_ptr() == x.data_ptr()  # a view: no copy
    back = from_bytes(data.clone(), dtype, shape)
    assert back.dtype == dtype and back.shape == x.shape
    assert torch.equal(as_bytes(back), data)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_header_round_trip_for_every_dtype(dtype):
    head = Header("neighbor_allreduce", dtype, (2, 3), seq=4, aux=5, value=0.25, inline=24)
    assert Header.decode(head.encode()) == head
    assert head.matches(Header("neighbor_allreduce", dtype, (2, 3), aux=5))  # inline aside


def test_rejected_header_carries_the_operation_the_rank_and_the_reason_length():
    head = Header.decode(rejected_header("allreduce", "rank 2 rejected: é", origin=2).encode())
    assert head.op == "rejected" and head.dtype == torch.uint8 and head.slot == 2
    assert head.numel == len("rank 2 rejected: é".encode())


@pytest.fixture
def alive(monkeypatch):
    monkeypatch.setenv("GOSSAMER_DEAD_AFTER", "0.3")
    live = Liveness(dist.HashStore(), rank=0, size=4, store_host=None)
    yield live
    live.close()


def test_a_rank_whose_counter_stops_is_lost_and_a_silent_one_is_not(alive):
    store = alive._store
    store.set("gossamer/alive/1", "1")
    store.set("gossamer/alive/2", "1")  # rank 3 never wrote: not started, not lost
    assert alive.check() == set()
    time.sleep(0.2)
    store.set("gossamer/alive/1", "2")
    assert alive.check() == set()
    time.sleep(0.2)
    store.set("gossamer/alive/1", "3")
    assert alive.check() == {2}
    assert alive.lost == {2}


def test_a_rank_with_a_tombstone_is_lost_at_once(alive):
    store = alive._store
    for rank in (1, 2, 3):
        store.set(f"gossamer/alive/{rank}", "1")
    store.set("gossamer/dead/2", "1")  # what the launcher's agent writes
    assert alive.check() == {2}  # no wait for the counter to go stale


def _identity(pid: int, boot: str | None = None) -> str:
    """What a rank writes under ``gossamer/process/<rank>``, read here from ``/proc``."""
    boot = boot or Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    stat = Path(f"/proc/{pid}/stat").read_text()
    start = stat[stat.rindex(")") + 2 :].split()[19]  # proc(5) field 22
    return f"{boot} {os.readlink('/proc/self/ns/pid')} {pid} {start}"


needs_proc = pytest.mark.skipif(not Path("/proc/self/ns/pid").exists(), reason="Linux's /proc")


@needs_proc
def test_ranks_of_this_machine_are_judged_by_their_process_others_by_their_counter(alive):
    store = alive._store
    ended = subprocess.Popen(["sleep", "30"])
    stopped = subprocess.Popen(["sleep", "30"])
    try:
        idents = {1: _identity(os.getpid()), 2: _identity(ended.pid)}
        idents[3] = _identity(os.getpid(), boot="another-machine")
        idents[4] = _identity(stopped.pid)
        ended.kill()
        ended.wait()  # reaped: no such process any more
        os.kill(stopped.pid, signal.SIGSTOP)
        live = Liveness(store, rank=0, size=5, store_host=None)
        for rank, ident in idents.items():
            store.set(f"gossamer/process/{rank}", ident)
            store.set(f"gossamer/alive/{rank}", "1")
        # the ended process is lost at the first read, before any counter could go stale
        assert live.check() == {2}
        time.sleep(0.4)  # every counter stands still for longer than GOSSAMER_DEAD_AFTER
        # rank 1 runs here (starved, say): not lost; ranks 3 (another machine) and 4 (a
        # stopped process) are judged by their counters
        assert live.check() == {2, 3, 4}
        live.close()
    finally:
        for proc in (ended, stopped):
            proc.kill()
            proc.wait()


@needs_proc
def test_a_rank_whose_pid_now_belongs_to_another_process_is_lost(alive):
    store = alive._store
    boot, namespace, pid, start = _identity(os.getpid()).split(" ")
    store.set("gossamer/process/1", f"{boot} {namespace} {pid} {int(start) - 1}")
    store.set("gossamer/alive/1", "1")
    live = Liveness(store, rank=0, size=2, store_host=None)
    assert live.check() == {1}
    live.close()


def test_ranks_that_left_name_the_ranks_they_had_found_lost_else_themselves(alive):
    store = alive._store
    store.set("gossamer/left/2", "")  # what shutdown() writes, with no rank lost
    assert alive.check_left(peer=1) == set() and alive.lost == set()
    assert alive.check_left() == {2} and alive.lost == {2}
    store.set("gossamer/left/3", "0,1")  # rank 3 had found ranks 0 (this one) and 1 lost
    assert alive.check_left(peer=3) == {1}  # never this rank itself
    assert alive.lost == {1, 2}
    # Now rank 3 brings no news (a survivor that finished after a death): it is the cause.
    assert alive.check_left(peer=3) == {3} and alive.lost == {1, 2, 3}


def test_a_timeout_says_where_the_other_ranks_were_waiting(world_of_one, alive):
    store = alive._store
    store.set("gossamer/alive/1", "7 ")  # beating, in no operation
    store.set("gossamer/alive/2", "5 allreduce")
    store.set("gossamer/alive/3", "9 allreduce")
    assert alive.activities() == {1: "", 2: "allreduce", 3: "allreduce"}
    timeout = RuntimeError("Timed out waiting 5000ms")
    assert str(translate("allreduce", -1, timeout, alive)).endswith(
        "waiting for all ranks (at their last heartbeat: rank 1 in no gossamer operation; "
        "ranks [2, 3] waiting in allreduce)"
    )
    assert str(translate("neighbor_allreduce", 2, timeout, alive)).endswith(
        "waiting for rank 2 (at its last heartbeat: rank 2 waiting in allreduce)"
    )
    alive.report(lambda: "")  # the communication thread, idle
    alive.report(lambda: "window.put")  # the window client, stuck
    alive._beat()
    assert store.get("gossamer/alive/0").endswith(b" window.put")


def test_a_window_operation_in_flight_for_a_while_is_reported(world_of_one):
    from gossamer.windows.registry import Registry

    windows = Registry()
    assert windows.stalled() == ""
    done = concurrent.futures.Future()
    windows.watch("window.get", done)
    assert windows.stalled() == ""  # just started
    what, _, peers = windows._inflight[done]
    windows._inflight[done] = (what, time.monotonic() - 1.0, peers)
    assert windows.stalled() == "window.get"
    done.set_result(None)
    assert windows.stalled() == ""


def test_an_unreachable_store_means_its_host_is_lost():
    live = Liveness(dist.HashStore(), rank=1, size=3, store_host=0)

    class Gone:
        def check(self, keys):
            raise RuntimeError("Connection reset by peer")

    live._store = Gone()
    assert live.check() == {0}
    live.close()


@pytest.fixture
def world_of_one():
    gossamer.init()
    yield
    gossamer.shutdown()


def test_gloo_errors_become_errors_that_name_the_lost_rank(world_of_one, alive):
    reset = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: reset")
    alive.lost.add(3)
    err = translate("allreduce", -1, reset, alive)
    assert isinstance(err, RankLostError) and err.rank == 3 and err.ranks == [3]
    assert str(err).startswith("allreduce: rank 3 was lost")
    err = translate("allreduce", -1, reset, None)
    assert type(err) is PeerError and "a peer closed its connection to rank 0" in str(err)
    err = translate("x", 2, RuntimeError("Timed out waiting 5000ms"), None)
    assert isinstance(err, CommunicationTimeout) and "waiting for rank 2" in str(err)


def test_a_world_of_one_has_no_heartbeat(world_of_one):
    assert get_liveness() is None


def test_init_checks_the_store_argument():
    with pytest.raises(TypeError, match=r"store must be a torch\.distributed\.Store"):
        gossamer.init(store="file:///tmp/x")


def test_a_window_error_is_put_down_to_the_failed_peer_s_death_only(world_of_one, monkeypatch):
    from gossamer.windows import requests

    monkeypatch.setattr(requests, "find_lost", lambda peer=None: {1})  # rank 1 died earlier
    refused = PeerError("connection refused")
    assert requests.named("win_put", refused, peer=2) is refused  # 2 lives: its own error
    err = requests.named("win_put", refused, peer=1)
    assert isinstance(err, RankLostError) and err.ranks == [1]
    assert isinstance(requests.named("win_put", refused), RankLostError)  # peer unknown
