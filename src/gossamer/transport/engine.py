"""One communication thread per process: runs operations in program order.

Every gossamer operation, blocking or not, runs on this thread, so operations are issued to
torch.distributed in the same order on every rank even while asynchronous ones are pending,
and a multi-phase operation (header, then data) progresses without the caller.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

from gossamer import context
from gossamer.profiling import timeline
from gossamer.transport.checks import check_flag
from gossamer.transport.handle import Handle

__all__ = ["Engine", "run", "submit"]


class Engine:
    """The communication thread of one runtime; started on first use, stopped by ``close``."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="gossamer-comm", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as err:  # handed to the caller, who re-raises it
                    future.set_exception(err)

    def submit(self, op: str, fn: Callable[[], Any], deadline_s: float) -> Handle:
        """Queue ``fn``; return a handle to its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, timeline.traced(op, fn)))  # "queued" until the thread runs it
        return Handle(future, op, deadline_s)

    def close(self) -> None:
        """Let queued operations finish, then end the thread."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=context.timeout())


def submit(op: str, fn: Callable[[], Any]) -> Handle:
    """Queue ``fn`` on this process's communication thread; return a handle to its result."""
    runtime = context.runtime()
    return runtime.component("engine", Engine).submit(op, fn, runtime.timeout)


def run(op: str, fn: Callable[[], Any], async_op: bool) -> Any:
    """Run ``fn`` on the communication thread: a handle if ``async_op``, else the result.

    Raises:
        TypeError: ``async_op`` is not a bool (checked before anything is queued).
    """
    check_flag(async_op, "async_op", op)
    handle = submit(op, fn)
    return handle if async_op else handle.wait()
