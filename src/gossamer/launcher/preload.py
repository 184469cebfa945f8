"""Ranks forked from a process that imported torch once, instead of each importing it again.

Importing torch costs a rank about 3 s of CPU on a small machine: most of what a short job
spends before its first step, four times over on four ranks. The launcher therefore starts,
beside its torchrun agent, one *preloader*: a process that imports torch and then waits.
torchrun still starts one process per rank and watches it, but that process is the small
client of :mod:`gossamer.launcher.preload_client` (the standard library only, no ``site``),
which hands its command line, environment, working directory, CPU affinity and standard
streams to the preloader over a Unix socket. The preloader forks; the child takes all of
that on and runs the program as ``python -u`` would (``runpy``, with ``__main__``), while
the client relays signals to it and ends the way it ended: its exit code, or killed by the
same signal. Fork is what makes it cheap: the child shares the imported pages.

What a fresh interpreter would do differently is done in the child: ``OMP_NUM_THREADS``
(read by the OpenMP runtime when torch loaded it, in the preloader) is applied with
``torch.set_num_threads``, and NumPy's global generator is reseeded (Python's ``random``
reseeds itself after a fork), so that ranks do not share an unseeded stream. The
preloader never runs user code and never starts torch's thread pools, so every child
starts from the same clean state, also after an elastic restart.

A client that finds no preloader (``gossamer run --no-preload``, or one that failed to
start) runs ``python -u program`` itself, so a launch never depends on it. A client that
dies takes its rank with it (the preloader kills a rank whose client is gone), and the
preloader kills every rank and leaves when the launcher that started it goes (its stdin
reaches end-of-file).
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass, field

__all__ = ["SOCKET_VARIABLE", "Preloader", "client_command", "start"]

# The clients find the preloader's socket here (the ranks inherit the agent's environment).
SOCKET_VARIABLE = "GOSSAMER_PRELOAD_SOCKET"
_LENGTH = struct.Struct("!Q")
_LISTEN_TIMEOUT_S = 10.0
_STREAMS = 3  # stdin, stdout, stderr travel with the request
# Not `-m gossamer.launcher.preload`: the package imports this module first (runpy warns).
_SERVE = "from gossamer.launcher.preload import main; main()"


@dataclass
class _Job:
    """What a client asked the preloader to run (its ``python`` command line and context)."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    affinity: list[int] = field(default_factory=list)


def client_command(command: list[str]) -> list[str]:
    """The command torchrun starts per rank, for ``python -u command...``: the client's."""
    client = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preload_client.py")
    return [sys.executable, "-S", client, "-u", *command]


class Preloader:
    """The running preloader of this launcher; :meth:`stop` ends it and every rank it forked."""

    def __init__(self, proc: subprocess.Popen, path: str) -> None:
        self._proc, self._path = proc, path

    def stop(self) -> None:
        """Close its stdin (it kills what it forked and leaves), wait, remove its socket."""
        with contextlib.suppress(OSError):
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        shutil.rmtree(os.path.dirname(self._path), ignore_errors=True)


def start() -> Preloader | None:
    """Start the preloader and point this process's future ranks at it (``SOCKET_VARIABLE``).

    Returns None when it could not start; the clients then run their programs themselves.
    """
    os.environ.pop(SOCKET_VARIABLE, None)  # not an enclosing launch's (a launch in a rank)
    path = os.path.join(tempfile.mkdtemp(prefix="gossamer-preload-"), "socket")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", _SERVE, path],
            stdin=subprocess.PIPE,
            start_new_session=True,  # as torchrun's ranks: no terminal's signals
        )
    except OSError:
        return None
    preloader = Preloader(proc, path)
    # It listens before it imports torch: a few tens of milliseconds.
    deadline = time.monotonic() + _LISTEN_TIMEOUT_S
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            preloader.stop()
            return None
        time.sleep(0.01)
    os.environ[SOCKET_VARIABLE] = path
    return preloader


def _receive_job(conn: socket.socket) -> tuple[_Job, list[int]]:
    """Read one request: a length, the JSON of a job, and the client's streams."""
    head, fds, _, _ = socket.recv_fds(conn, _LENGTH.size, _STREAMS)
    if len(head) < _LENGTH.size:
        raise ConnectionError("short request")
    (size,) = _LENGTH.unpack(head)
    body = bytearray()
    while len(body) < size:
        chunk = conn.recv(size - len(body))
        if not chunk:
            raise ConnectionError("short request")
        body += chunk
    return _Job(**json.loads(body)), fds


def _reply(conn: socket.socket, **fields: int) -> None:
    with contextlib.suppress(OSError):  # the client is gone; its rank is being killed
        conn.sendall((json.dumps(fields) + "\n").encode())


class _Server:
    """The preloader's loop: accept requests, fork ranks, report how they ended."""

    def __init__(self, path: str) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the loop through wake_w
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "child")
        self.selector.register(0, selectors.EVENT_READ, "parent")
        self.ranks: dict[int, socket.socket] = {}  # pid -> its client's connection

    def serve(self) -> _Job | None:
        """Run until the launcher goes (None); in a forked child, return its job."""
        while True:
            for key, _ in self.selector.select():
                if key.data == "accept":
                    job = self._accept()
                    if job is not None:
                        return job
                elif key.data == "child":
                    os.read(self.wake_r, 4096)
                    self._reap()
                elif key.data == "parent":
                    if not os.read(0, 4096):
                        self._stop()
                        return None
                else:  # a client's connection: it only ever closes (the client died)
                    if not key.fileobj.recv(1):
                        self._kill(key.data)

    def _accept(self) -> _Job | None:
        conn, _ = self.listener.accept()
        try:
            job, fds = _receive_job(conn)
        except (OSError, ValueError, TypeError):
            conn.close()
            return None
        pid = os.fork()
        if pid == 0:
            conn.close()
            self._become_rank(fds)
            return job
        with contextlib.suppress(OSError):
            os.setpgid(pid, pid)  # here too: the group exists before the client learns the pid
        for fd in fds:
            os.close(fd)
        self.ranks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        _reply(conn, pid=pid)
        return None

    def _become_rank(self, fds: list[int]) -> None:
        """In the child: the client's streams on 0, 1, 2, and nothing of the server left."""
        os.setpgid(0, 0)  # a process group of its own, which the client's signals reach
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        for fd, target in zip(fds, range(_STREAMS), strict=False):
            os.dup2(fd, target)
            os.close(fd)
        self.selector.close()
        self.listener.close()
        for conn in self.ranks.values():
            conn.close()
        os.close(self.wake_r)
        os.close(self.wake_w)

    def _reap(self) -> None:
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            conn = self.ranks.pop(pid, None)
            if conn is not None:
                self._forget(conn)
                _reply(conn, code=os.waitstatus_to_exitcode(status))
                conn.close()

    def _kill(self, pid: int) -> None:
        """SIGKILL the rank's process group (it leads one, as torchrun's ranks do)."""
        conn = self.ranks.get(pid)
        if conn is not None:
            self._forget(conn)  # reaped (and closed) when it has died
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)

    def _forget(self, conn: socket.socket) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(conn)

    def _stop(self) -> None:
        """Kill every rank, and tell each client how its rank ended before leaving."""
        for pid in list(self.ranks):
            self._kill(pid)
        for pid, conn in list(self.ranks.items()):
            with contextlib.suppress(ChildProcessError):
                _, status = os.waitpid(pid, 0)
                _reply(conn, code=os.waitstatus_to_exitcode(status))
            conn.close()


def _run(job: _Job) -> None:
    """Run ``python job.argv...`` in this (forked) process, as a fresh interpreter would."""
    import runpy

    os.chdir(job.cwd)
    os.environ.clear()
    os.environ.update(job.env)
    if job.affinity:
        os.sched_setaffinity(0, job.affinity)
    _fresh_state(job.env)
    _unbuffered_streams()
    args = job.argv[1:]  # after "-u"
    if args[0] == "-m":
        sys.argv = [args[1], *args[2:]]
        sys.path[0] = os.getcwd()
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        return
    sys.argv = list(args)
    path = os.path.realpath(args[0])
    sys.path[0] = os.path.dirname(path)
    if os.path.isdir(path) or zipfile.is_zipfile(path):  # run through its __main__.py
        runpy.run_path(args[0], run_name="__main__")
    else:
        _run_script(os.path.abspath(args[0]))


def _unbuffered_streams() -> None:
    """Standard streams on this process's 0, 1, 2, unbuffered as under ``python -u``."""
    for name, fd in (("stdout", 1), ("stderr", 2)):
        old = getattr(sys, name)
        stream = open(fd, "w", buffering=1, encoding=old.encoding, errors=old.errors, closefd=False)  # noqa: SIM115
        stream.reconfigure(write_through=True)
        setattr(sys, name, stream)
    sys.stdin = open(0, encoding=sys.stdin.encoding, closefd=False)  # noqa: SIM115


def _run_script(path: str) -> None:
    """As the interpreter runs a script: in a ``__main__`` module of its own, kept after."""
    import builtins
    import importlib.machinery
    import types

    main = types.ModuleType("__main__")
    main.__file__ = path
    main.__loader__ = importlib.machinery.SourceFileLoader("__main__", path)
    main.__builtins__ = builtins
    sys.modules["__main__"] = main
    with open(path, "rb") as source:
        code = compile(source.read(), path, "exec")
    exec(code, main.__dict__)


def _fresh_state(env: dict[str, str]) -> None:
    import torch

    threads = env.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    # Every rank is a fork of one process: without a new seed each would draw the same
    # numbers, where separately started ranks (``--no-preload``, torchrun) do not.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main() -> None:
    """The preloader's program (``sys.argv[1]``: its socket): import torch, serve forks."""
    # Listening first: a client that comes while torch is being imported waits in the
    # backlog instead of finding no preloader.
    server = _Server(sys.argv[1])
    import torch  # noqa: F401  (the point of this process)

    job = server.serve()
    if job is not None:
        _run(job)
