"""The emulated cluster for real: namespaces, shaping, cleanup, a 2-host job (root only)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.netbench.cluster import Cluster, parse_rate, preflight
from benchmarks.netbench.runner import run_job

REASON = preflight()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"netbench cluster: {REASON}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _in(cluster, host, *argv, **kwargs):
    return subprocess.run([*cluster.netns_exec(host), *argv], capture_output=True, text=True,
                          **kwargs)  # fmt: skip


# Receive everything on host 0, send 2.5 MB from host 1, report the seconds it took.
_SERVER = (
    "import socket;s=socket.create_server(('0.0.0.0',29600));c,_=s.accept();n=0\n"
    "while (b:=c.recv(1<<16)): n+=len(b)\nprint(n)"
)
_CLIENT = (
    "import socket,time;c=socket.create_connection(('10.77.0.1',29600));t=time.time();"
    "c.sendall(bytes(2_500_000));c.shutdown(socket.SHUT_WR);c.recv(1);print(time.time()-t)"
)


def test_cluster_shapes_both_directions_and_removes_everything():
    before = _namespaces()
    with Cluster(2, parse_rate("20mbit"), prefix="gnbtest") as cluster:
        host0, host1 = cluster.hosts
        assert {"gnbtest-sw", "gnbtest-h0", "gnbtest-h1"} <= _namespaces()
        assert "tbf" in _in(cluster, host1, "tc", "qdisc", "show", "dev", "eth0").stdout
        switch = subprocess.run(["ip", "netns", "exec", "gnbtest-sw", "tc", "qdisc", "show"],
                                capture_output=True, text=True).stdout  # fmt: skip
        assert switch.count("tbf") == 2
        assert "UP" in _in(cluster, host0, "ip", "link", "show", "lo").stdout
        server = subprocess.Popen([*cluster.netns_exec(host0), sys.executable, "-c", _SERVER],
                                  stdout=subprocess.PIPE, text=True)  # fmt: skip
        try:
            time.sleep(0.5)
            sent = _in(cluster, host1, sys.executable, "-c", _CLIENT, timeout=30)
            assert server.communicate(timeout=30)[0].strip() == "2500000"
        finally:
            server.kill()
        # 2.5 MB at 20 Mbit/s is 1 s; the bucket lets a little through at once.
        assert 0.8 < float(sent.stdout) < 3.0
    assert _namespaces() == before


def test_cluster_cleans_up_when_the_body_fails():
    before = _namespaces()
    with pytest.raises(KeyboardInterrupt), Cluster(2, None, prefix="gnbfail"):
        assert "gnbfail-h1" in _namespaces()
        raise KeyboardInterrupt
    assert _namespaces() == before
    # A failure half-way through setup removes what was already made.
    with pytest.raises(RuntimeError), Cluster(2, 0, prefix="gnbhalf"):
        pass
    assert _namespaces() == before


def test_two_host_job(tmp_path):
    with Cluster(2, parse_rate("1gbit"), prefix="gnbjob") as cluster:
        worker = ["--models", "mlp", "--strategies", "compute,ddp,atc/one-peer",
                  "--batch", "8", "--warmup", "1", "--steps", "2", "--reps", "1"]  # fmt: skip
        rows = run_job(cluster, 1, worker, tmp_path, timeout=120)
    by = {r["strategy"]: r for r in rows}
    assert set(by) == {"compute", "ddp", "atc/one-peer"}
    assert all(r["ranks"] == 2 and r["hosts"] == 2 and r["rate"] == 10**9 for r in rows)
    model = by["ddp"]["params_bytes"]
    # Ring allreduce over 2 ranks sends M per rank; one-peer sends M; compute sends nothing.
    assert 0.9 * model < by["ddp"]["tx_bytes_per_step_per_rank"] < 1.3 * model
    assert 0.9 * model < by["atc/one-peer"]["tx_bytes_per_step_per_rank"] < 1.3 * model
    assert by["compute"]["tx_bytes_per_step_per_rank"] < 0.01 * model


def test_hosts_run_the_congestion_control_asked_for():
    # reno is the one algorithm every namespace may choose (the others may need the
    # machine's permission, and then the machine's default is kept and reported).
    with Cluster(2, None, prefix="gnbcc", congestion="reno") as cluster:
        assert cluster.congestion_used == "reno"
        for host in cluster.hosts:
            path = "/proc/sys/net/ipv4/tcp_congestion_control"
            assert _in(cluster, host, "cat", path).stdout.strip() == "reno"
