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
from gossamer.ops.handle import Handle
from gossamer.profiling import timeline as _timeline

__all__ = ["run", "stop", "submit"]

_lock = threading.Lock()
_queue: queue.SimpleQueue | None = None
_thread: threading.Thread | None = None


def _serve(jobs: queue.SimpleQueue) -> None:
    while True:
        job = jobs.get()
        if job is None:
            return
        future, fn = job
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the caller, who re-raises it
                future.set_exception(err)


def submit(op: str, fn: Callable[[], Any]) -> Handle:
    """Queue ``fn`` on the communication thread; return a handle to its result."""
    global _queue, _thread
    deadline = context.timeout()
    future: concurrent.futures.Future = concurrent.futures.Future()
    fn = _timeline.traced(op, fn)  # "queued" from now until the thread runs it
    with _lock:
        jobs = _queue
        if jobs is None or _thread is None or not _thread.is_alive():
            _queue = jobs = queue.SimpleQueue()
            _thread = threading.Thread(
                target=_serve, args=(jobs,), name="gossamer-comm", daemon=True
            )
            _thread.start()
        jobs.put((future, fn))
    return Handle(future, op, deadline)


def run(op: str, fn: Callable[[], Any], async_op: bool) -> Any:
    """Run ``fn`` on the communication thread: a handle if ``async_op``, else the result."""
    handle = submit(op, fn)
    return handle if async_op else handle.wait()


def stop() -> None:
    """Let queued operations finish, then end the thread (called at shutdown)."""
    global _queue, _thread
    with _lock:
        jobs, thread, _queue, _thread = _queue, _thread, None, None
    if thread is not None and jobs is not None:
        jobs.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout=context.timeout())


context.on_shutdown(stop)
