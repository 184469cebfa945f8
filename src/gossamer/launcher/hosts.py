"""``-H host1:4,host2:4``: parsing, placement of ranks, and one agent started per host."""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid

from gossamer.launcher.output import Forwarder
from gossamer.launcher.signals import Interrupted, Interruption, interrupted_message

__all__ = [
    "AGENT_FLAG",
    "is_local_host",
    "parse_hosts",
    "place",
    "rendezvous_endpoint",
    "run_hosts",
    "watch_parent",
]

_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")
# Hidden option of the agents that run_hosts starts (see watch_parent).
AGENT_FLAG = "--hosts-agent"
_DEFAULT_RDZV_PORT = 29400
# Variables forwarded to ranks started over ssh (local ranks inherit the whole environment).
_FORWARDED_PREFIXES = ("GOSSAMER_", "PYTHONPATH", "OMP_NUM_THREADS", "GLOO_", "NCCL_")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """Parse ``"h1:4,h2:4"`` into ``[("h1", 4), ("h2", 4)]``; a host without ``:N`` has 1 slot.

    Raises:
        ValueError: naming ``-H/--hosts`` and the bad entry.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"-H/--hosts must list hosts like 'host1:4,host2:4'; got {text!r}")
    hosts: list[tuple[str, int]] = []
    for entry in text.split(","):
        name, sep, slots = entry.strip().rpartition(":")
        if not sep:
            name, slots = slots, "1"
        if not name or not _HOST.match(name) or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H/--hosts entry {entry!r} is not 'host:slots' with slots >= 1")
        if any(name == seen for seen, _ in hosts):
            raise ValueError(f"-H/--hosts lists host {name!r} twice")
        hosts.append((name, int(slots)))
    return hosts


def place(num_proc: int, hosts: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Fill hosts in order with ``num_proc`` ranks; hosts left empty are dropped.

    Raises:
        ValueError: when ``num_proc`` exceeds the slots.
    """
    total = sum(slots for _, slots in hosts)
    if num_proc > total:
        raise ValueError(f"-np {num_proc} is more than the {total} slots that -H/--hosts gives")
    placed, left = [], num_proc
    for name, slots in hosts:
        take = min(slots, left)
        if take:
            placed.append((name, take))
        left -= take
    return placed


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine (so no ssh is needed to start ranks there)."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    return _is_loopback(name)


def rendezvous_endpoint(hosts: list[tuple[str, int]]) -> str:
    """``host:port`` of the c10d rendezvous of a ``-H`` job (served by the first host).

    All hosts on this machine: loopback. This machine first among remote hosts: a name the
    others can reach, not ``localhost``. A remote first host: port 29400 there.
    """
    first = hosts[0][0]
    if not is_local_host(first):
        return f"{first}:{_DEFAULT_RDZV_PORT}"
    if all(is_local_host(name) for name, _ in hosts):
        return f"127.0.0.1:{_free_port()}"
    reachable = socket.getfqdn() if first == "localhost" or _is_loopback(first) else first
    return f"{reachable}:{_free_port()}"


def run_hosts(
    hosts: list[tuple[str, int]],
    command: list[str],
    interruption: Interruption,
    *,
    agent_options: list[str],
    rdzv_id: str | None = None,
    ssh_port: int | None = None,
) -> int:
    """Start one agent per host (locally, or over ssh) around one c10d rendezvous.

    Each agent forwards its ranks' lines (tagged with global ranks when asked); this
    process forwards the agents' lines, whole, so that agents never share a pipe.

    Args:
        hosts (list[tuple[str, int]]): hosts and the ranks each runs, in rank order.
        command (list[str]): the program and its arguments.
        interruption (Interruption): the launcher's installed signal handlers.
        agent_options (list[str]): options every agent gets (``--tag-output`` ...).
        rdzv_id (str, optional): the job id; a random one by default.
        ssh_port (int, optional): ssh port for remote hosts.

    Returns:
        0, the first failed agent's exit code, or 128 + signal when interrupted.
    """
    endpoint = rendezvous_endpoint(hosts)
    job = rdzv_id or uuid.uuid4().hex[:12]
    forwarder = Forwarder()
    agents: list[tuple[subprocess.Popen, int]] = []
    # A repeated Ctrl-C: the agents escalate on their second signal (SIGKILL their ranks).
    interruption.on_repeat = lambda: _signal_all(agents, signal.SIGTERM)
    try:
        for host, count in hosts:
            argv = [
                sys.executable,
                "-m",
                "gossamer.launcher",
                "run",
                AGENT_FLAG,
                f"--nnodes={len(hosts)}",
                f"--nproc-per-node={count}",
                f"--rdzv-endpoint={endpoint}",
                f"--rdzv-id={job}",
                *agent_options,
                *command,
            ]
            if not is_local_host(host):
                argv = _over_ssh(host, argv, ssh_port)
            agents.append((_start(argv, forwarder), count))
        code = _wait_all(agents, [host for host, _ in hosts])
    except Interrupted as err:
        running = [(proc, count) for proc, count in agents if proc.poll() is None]
        _signal_all(running, signal.SIGTERM)
        for proc, _ in agents:
            proc.wait()
        forwarder.close()
        print(interrupted_message(sum(count for _, count in running)), file=sys.stderr)
        return 128 + (interruption.signum or err.signum)
    finally:
        interruption.disarm()
        forwarder.close()
        for proc, _ in agents:
            if proc.stdin is not None:
                proc.stdin.close()
    return code


def _start(argv: list[str], forwarder: Forwarder) -> subprocess.Popen:
    out_read, out_write = os.pipe()
    err_read, err_write = os.pipe()
    try:
        # stdin stays open and empty: an agent that reads end-of-file there knows that this
        # process is gone and stops its ranks (over ssh too, which forwards stdin).
        proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=out_write, stderr=err_write)
    finally:
        os.close(out_write)
        os.close(err_write)
    forwarder.add(out_read, dest=1)
    forwarder.add(err_read, dest=2)
    return proc


def _signal_all(agents: list[tuple[subprocess.Popen, int]], sig: int) -> None:
    for proc, _ in agents:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(sig)


def _wait_all(agents: list[tuple[subprocess.Popen, int]], hosts: list[str]) -> int:
    """Wait for every agent; once one fails, name its host, stop the others, return its code.

    Agents are polled, not waited for in turn: an agent that ssh could not start exits at
    once while the first one waits in the rendezvous for it.
    """
    code = 0
    running = dict(enumerate(proc for proc, _ in agents))
    while running:
        for i, proc in list(running.items()):
            status = proc.poll()
            if status is None:
                continue
            del running[i]
            if status and not code:
                code = status if status > 0 else 128 - status
                why = " (ssh could not reach it?)" if status == 255 else ""
                print(
                    f"gossamer run: the agent on {hosts[i]} exited with code {status}{why}; "
                    "stopping the others",
                    file=sys.stderr,
                )
                _signal_all(agents, signal.SIGTERM)
        if running:
            time.sleep(0.05)
    return code


def watch_parent() -> None:
    """In an agent of a ``-H`` job: SIGTERM this process once stdin reaches end-of-file."""

    def watch() -> None:
        with contextlib.suppress(OSError):
            while os.read(0, 4096):
                pass
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="gossamer-parent-watch", daemon=True).start()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _is_loopback(name: str) -> bool:
    return name.startswith("127.") or name == "::1"


def _over_ssh(host: str, agent: list[str], port: int | None) -> list[str]:
    forwarded = [f"{k}={v}" for k, v in os.environ.items() if k.startswith(_FORWARDED_PREFIXES)]
    remote = f"cd {shlex.quote(os.getcwd())} && exec env {shlex.join(forwarded + agent)}"
    ssh = ["ssh", "-o", "BatchMode=yes"]
    if port:
        ssh += ["-p", str(port)]
    return [*ssh, host, remote]
