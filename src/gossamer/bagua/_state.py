"""The facade's process-wide state, held on gossamer's runtime.

Bagua keeps a default process group, a backend per wrapped model (found by the model's
name when a tensor is marked ready) and a Rust thread that runs the buckets' operations.
Here they are one object, a component of :func:`gossamer.context.runtime`, so
``gossamer.shutdown()`` stops the thread and drops everything with the rest.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import queue
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gossamer import context

__all__ = ["BaguaState", "Worker", "state"]


class Worker:
    """One thread that runs the buckets' operation lists, in submission order.

    Bagua runs them on its Rust backend thread. Operations of every wrapped model go
    through this single thread, so each rank issues its collectives in the order the
    buckets became ready, which is the same on every rank; the thread itself hands them to
    gossamer's communication thread and blocks, leaving the training thread free.
    """

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="gossamer-bagua", daemon=True)
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
                except BaseException as err:  # re-raised by whoever waits for it
                    future.set_exception(err)

    def submit(self, fn: Callable[[], Any]) -> concurrent.futures.Future:
        """Queue ``fn``; return a future of its result."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn))
        return future

    def close(self) -> None:
        """Let queued jobs finish, then end the thread."""
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=context.timeout())


@dataclass
class BaguaState:
    """Bagua's globals for one runtime."""

    default_group: Any = None  # BaguaProcessGroup over the world, made on first use
    group_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    inter_node_group: Any = None  # (torch group or None, leader ranks), made on first use
    # module name -> its BaguaDistributedDataParallel (weakly: a dropped model goes away)
    models: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    closers: list[Callable[[], None]] = field(default_factory=list)  # background loops
    _worker: Worker | None = None

    @property
    def worker(self) -> Worker:
        """The thread that runs bucket operations (started on first use)."""
        if self._worker is None:
            self._worker = Worker()
        return self._worker

    def close(self) -> None:
        """Stop background loops, then the worker (called by ``gossamer.shutdown``)."""
        for closer in reversed(self.closers):
            closer()
        self.closers.clear()
        if self._worker is not None:
            self._worker.close()
            self._worker = None


def state() -> BaguaState:
    """The facade's state in this runtime (raises ``NotInitializedError`` before init)."""
    return context.runtime().component("bagua", BaguaState)


def wait(future: concurrent.futures.Future, what: str) -> Any:
    """The result of ``future``, waiting at most gossamer's deadline (plus a grace period).

    Raises:
        CommunicationTimeout: the operation did not finish in time.
    """
    from gossamer.errors import CommunicationTimeout

    limit = context.timeout() + 30.0
    try:
        return future.result(timeout=limit)
    except TimeoutError:
        if future.done():
            raise
        raise CommunicationTimeout(f"{what} did not complete within {limit:g} s") from None
