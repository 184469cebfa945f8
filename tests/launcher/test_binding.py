"""A single-machine job listens on 127.0.0.1 only: the store, gloo, everything it opens."""

import os
import socket
import subprocess
import sys
import textwrap

import pytest

from gossamer.launcher import cli

JOB = textwrap.dedent("""
    import os, sys, time
    import gossamer
    gossamer.init()
    gossamer.barrier()  # every gloo connection is up
    e = os.environ
    print("ready", gossamer.rank(), e["MASTER_ADDR"], e["MASTER_PORT"],
          e.get("GLOO_SOCKET_IFNAME"), flush=True)
    while not os.path.exists(sys.argv[1]):  # the test has looked
        time.sleep(0.05)
    gossamer.barrier()
    gossamer.shutdown()
""")

LOOPBACK_V4 = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it
LOOPBACK_V6 = {"00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}


def _tree(root):
    """``root`` and all its descendants."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as stat:
                    parents[int(entry)] = int(stat.read().rpartition(")")[2].split()[1])
            except OSError:
                pass
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree |= more
        grew = bool(more)
    return tree


def _socket_inodes(pids):
    inodes = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    return inodes


def _listening(inodes):
    """``(address hex, port)`` of every listening TCP socket among ``inodes``."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as rows:
            next(rows)
            for row in rows:
                fields = row.split()
                address, port = fields[1].split(":")
                if fields[3] == "0A" and int(fields[9]) in inodes:  # 0A: LISTEN
                    found.append((address, int(port, 16)))
    return found


def test_a_single_machine_job_listens_on_loopback_only(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    go = tmp_path / "go"
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    proc = subprocess.Popen(
        [sys.executable, "-m", "gossamer.launcher", "run", "-np", "2", "job.py", str(go)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env=env,
    )
    try:
        ready = [proc.stdout.readline().split() for _ in range(2)]
        assert all(r and r[0] == "ready" for r in ready), proc.stderr.read()
        # Looked at from outside while every rank waits: all sockets of the job's processes.
        listening = _listening(_socket_inodes(_tree(proc.pid)))
        go.touch()
        assert proc.wait(timeout=180) == 0, proc.stderr.read()
    finally:
        go.touch()
        proc.kill()
    _, _, master_addr, master_port, ifname = ready[0]
    assert master_addr == "127.0.0.1"
    assert ifname == "lo"
    ports = {port for _, port in listening}
    assert int(master_port) in ports  # the store was found, so the check below means something
    assert len(listening) >= 3  # the store and a gloo listener per rank
    exposed = [(a, p) for a, p in listening if a != LOOPBACK_V4 and a not in LOOPBACK_V6]
    assert not exposed, f"listening beyond loopback: {exposed}"


@pytest.mark.parametrize("preset", [None, "eth-user"])
def test_gloo_and_nccl_are_pinned_to_loopback_unless_the_user_chose(monkeypatch, preset):
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if preset is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, preset)
    cli._pin_to_loopback()
    expected = preset or "lo"
    if "lo" not in {name for _, name in socket.if_nameindex()}:
        pytest.skip("no interface named lo here")
    assert os.environ["GLOO_SOCKET_IFNAME"] == expected
    assert os.environ["NCCL_SOCKET_IFNAME"] == expected


def test_the_loopback_rendezvous_store_serves_on_127_0_0_1_only():
    from gossamer.launcher.loopback import LoopbackRendezvous

    handler = LoopbackRendezvous("job", timeout=60)
    info = handler.next_rendezvous()
    info.store.set("key", "value")
    assert info.bootstrap_store_info.master_addr == "127.0.0.1"
    assert info.bootstrap_store_info.master_port == handler.port
    listening = _listening(_socket_inodes([os.getpid()]))
    assert ("0100007F", handler.port) in listening
    assert not [p for a, p in listening if p == handler.port and a != LOOPBACK_V4]
    # A client reaches it on loopback, with the job's keys under the run id.
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", handler.port, is_master=False, timeout=_seconds(60))
    assert client.get("job/key") == b"value"
    assert handler.shutdown()


def _seconds(n):
    from datetime import timedelta

    return timedelta(seconds=n)
