"""A rank's process under ``gossamer run``: ``python -S preload_client.py -u program args...``.

It asks the preloader (:mod:`gossamer.launcher.preload`) to fork the rank with this
process's command line, environment, working directory, CPU affinity and standard streams,
relays the signals it gets to the rank, and ends as the rank ended. Without a preloader it
becomes ``python -u program args...`` itself. Standard library only: it runs without
``site`` (``-S``), so that starting it costs milliseconds.
"""

import contextlib
import json
import os
import signal
import socket
import struct
import sys

# gossamer.launcher.preload.SOCKET_VARIABLE: without site, this file cannot import gossamer.
_SOCKET_VARIABLE = "GOSSAMER_PRELOAD_SOCKET"
_RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1,
            signal.SIGUSR2)  # fmt: skip


def _run_here(argv):
    os.execv(sys.executable, [sys.executable, *argv])


def _request(path, argv):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    job = {
        "argv": argv,
        "cwd": os.getcwd(),
        "env": dict(os.environ),
        "affinity": sorted(os.sched_getaffinity(0)),
    }
    body = json.dumps(job).encode()
    socket.send_fds(conn, [struct.pack("!Q", len(body))], [0, 1, 2])
    conn.sendall(body)
    return conn.makefile("r")


def _end(code):
    """Exit with ``code``, or die of signal ``-code`` (as the rank did)."""
    if code < 0:
        if -code != signal.SIGKILL:
            signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
        code = 128 - code  # a signal this process cannot die of (SIGSTOP's kin)
    os._exit(code)


def main():
    """Run ``sys.argv[1:]`` (``-u program args...``) as a forked rank, or here."""
    argv = sys.argv[1:]
    path = os.environ.get(_SOCKET_VARIABLE)
    if not path or argv[:1] != ["-u"] or len(argv) < 2:
        _run_here(argv)
    try:
        replies = _request(path, argv)
        pid = json.loads(replies.readline())["pid"]
    except (OSError, ValueError, KeyError):
        _run_here(argv)  # no preloader (gone, or never started): nothing was forked

    def relay(signum, _frame):
        # As torchrun signals a rank: its whole process group. (If it has ended, its
        # code is on the way.)
        with contextlib.suppress(OSError):
            os.killpg(pid, signum)

    for sig in _RELAYED:
        signal.signal(sig, relay)
    try:
        code = json.loads(replies.readline())["code"]
    except (OSError, ValueError, KeyError):
        # The preloader is gone without a word: do not leave the rank behind.
        with contextlib.suppress(OSError):
            os.killpg(pid, signal.SIGKILL)
        code = 1
    _end(code)


main()
