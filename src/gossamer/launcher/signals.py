"""Ctrl-C and termination of the launcher, and the rank processes it must not leave behind.

The first SIGINT, SIGTERM or SIGHUP raises an exception in the main thread, which stops the
job in an orderly way (ranks get SIGTERM, then SIGKILL after a grace period). A second one
kills what is left at once instead of cutting that cleanup short.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from types import FrameType

__all__ = [
    "HANDLED",
    "Interrupted",
    "Interruption",
    "children",
    "interrupted_message",
    "kill_process_trees",
]

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(BaseException):
    """The launcher got ``signum``; a BaseException so that no ``except Exception`` eats it."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"got {signal.Signals(signum).name}")
        self.signum = signum


class Interruption:
    """Signal handlers for :data:`HANDLED`, installed for the life of a launch.

    Attributes:
        signum: the first signal received, or None.
        raise_as: builds the exception raised for the first signal (torch's
            ``SignalException`` once torchrun runs, so that its agent stops the ranks).
        on_repeat: called for each later signal (kills the ranks at once).
    """

    def __init__(self) -> None:
        self.signum: int | None = None
        self.raise_as: Callable[[int], BaseException] = Interrupted
        self.on_repeat: Callable[[], None] = lambda: None
        self._armed = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Interruption:
        for sig in HANDLED:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._armed = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.disarm()
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)  # type: ignore[arg-type]

    def disarm(self) -> None:
        """From now on a signal is only recorded (the job is over; cleanup must finish)."""
        self._armed = False

    @property
    def exit_code(self) -> int:
        """128 + the signal number, as a shell reports a process killed by that signal."""
        if self.signum is None:
            raise RuntimeError("exit_code asked for, but no signal was received")
        return 128 + self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None:
            self.on_repeat()
            return
        self.signum = signum
        if self._armed:
            raise self.raise_as(signum)


def interrupted_message(stopped: int) -> str:
    """The one line the launcher prints when a signal ended the job."""
    if stopped == 0:
        return "gossamer run: interrupted before any rank started"
    return f"gossamer run: interrupted; stopped {stopped} rank{'s' if stopped != 1 else ''}"


def children(marker: bytes | None = None) -> list[int]:
    """Pids of this process's living children (Linux ``/proc``; empty elsewhere).

    Args:
        marker (bytes, optional): keep only children whose initial environment holds this
            ``NAME=value`` entry (or starts one with it), so that a program that calls the
            launcher in-process keeps its other children.
    """
    me = os.getpid()
    found = []
    with contextlib.suppress(OSError):
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", "rb") as stat:
                    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
                    fields = stat.read().rpartition(b")")[2].split()
                if int(fields[1]) != me or fields[0] == b"Z":
                    continue
                if marker is not None:
                    with open(f"/proc/{entry.name}/environ", "rb") as environ:
                        if not any(v.startswith(marker) for v in environ.read().split(b"\0")):
                            continue
            except OSError:
                continue  # gone meanwhile
            found.append(int(entry.name))
    return found


def kill_process_trees(pids: list[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid's process group when it leads one, else to the pid alone.

    torchrun starts every rank in a session of its own, so its group also holds whatever
    the rank started (data loader workers, compilers).
    """
    own_group = os.getpgrp()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(pid) == pid != own_group:
                os.killpg(pid, sig)
            else:
                os.kill(pid, sig)
