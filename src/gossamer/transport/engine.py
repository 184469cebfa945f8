"""One communication thread per process: runs operations in program order.

Every gossamer operation, blocking or not, runs on this thread, so operations are issued to
torch.distributed in the same order on every rank even while asynchronous ones are pending,
and a multi-phase operation (header, then data) progresses without the caller.

The thread waits on gloo directly (no hand-off: that would cost tens of microseconds per
wait), and gloo's waits cannot be interrupted. So the heartbeat thread
(:mod:`~gossamer.transport.liveness`) looks at the operation in progress after each beat:
when it has run for :data:`~gossamer.transport.liveness.STALL_S` and a rank is found lost,
the operation and every one queued behind it fail with
:class:`~gossamer.errors.RankLostError` at once, while this thread stays in gloo's wait
until gloo gives up (the peer's connection closes, or the deadline passes).

An operation submitted with ``peers`` is failed only for the loss of one of those ranks; an
elastic gossip round passes none (it deals with dead peers itself), so a survivor keeps
working after a death.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from gossamer import context
from gossamer.errors import GossamerError
from gossamer.profiling import timeline
from gossamer.transport.failures import is_backend_error, lost_error, translate
from gossamer.transport.handle import Handle
from gossamer.transport.liveness import STALL_S, Liveness, get_liveness

__all__ = ["Engine", "run", "submit"]

Peers = Collection[int] | None  # the global ranks an operation talks to; None: any rank


def _relevant(lost: set[int], peers: Peers) -> set[int]:
    """The lost ranks that ``peers`` (None: every rank) includes."""
    return set(lost) if peers is None else set(lost).intersection(peers)


def _settle(future: concurrent.futures.Future, result: Any = None, error: Any = None) -> None:
    """Complete ``future`` unless the stall watchdog already failed it."""
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


class Engine:
    """The communication thread of one runtime; started on first use, stopped by ``close``."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # queued or running: (op, peers)
        self._pending: dict[concurrent.futures.Future, tuple[str, Peers]] = {}
        self._current: tuple[concurrent.futures.Future, float] | None = None
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="gossamer-comm", daemon=True)
        self._thread.start()
        live = get_liveness()
        if live is not None:
            live.on_beat(self.fail_if_stalled)
            live.report(self.stalled)

    def _serve(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, fn = job
            try:
                skip = future.done() or not future.set_running_or_notify_cancel()
            except RuntimeError:
                skip = True
            if skip:  # cancelled, or failed by the watchdog while queued
                with self._lock:
                    self._pending.pop(future, None)
                continue
            self._current = (future, time.monotonic())
            try:
                _settle(future, result=fn())
            except BaseException as err:  # handed to the caller, who re-raises it
                _settle(future, error=err)
            finally:
                self._current = None
                with self._lock:
                    self._pending.pop(future, None)

    def submit(
        self, op: str, fn: Callable[[], Any], deadline_s: float, peers: Peers = None
    ) -> Handle:
        """Queue ``fn``; return a handle to its result.

        Called from a job already running on the thread (an operation made of operations,
        such as a compressed allreduce), ``fn`` runs at once, in place: queueing it behind
        the running job would wait for itself.
        """
        future: concurrent.futures.Future = concurrent.futures.Future()
        if threading.current_thread() is self._thread:
            try:
                future.set_result(fn())
            except BaseException as err:  # handed to the caller, who re-raises it
                future.set_exception(err)
        else:
            with self._lock:
                self._pending[future] = (op, peers)
            self._jobs.put((future, timeline.traced(op, fn)))  # "queued" until it runs
        return Handle(future, op, deadline_s)

    def stalled(self) -> str:
        """The operation running for :data:`STALL_S` or more (waiting, most likely), or ``""``."""
        current = self._current
        if current is None or time.monotonic() - current[1] < STALL_S:
            return ""
        with self._lock:
            entry = self._pending.get(current[0])
        return "" if entry is None else entry[0]

    def fail_if_stalled(self, live: Liveness) -> None:
        """If the running operation stalled on a lost rank, fail it and those queued.

        Operations that name their peers are failed only when one of them is lost.
        """
        current = self._current
        if current is None or time.monotonic() - current[1] < STALL_S:
            return
        lost = live.check()
        if not lost:
            return
        with self._lock:
            pending = list(self._pending.items())
            running = self._pending.get(current[0])
        if running is not None and not _relevant(lost, running[1]):
            return  # the stalled operation waits for live ranks: it will complete
        for future, (op, peers) in pending:
            if _relevant(lost, peers):
                _settle(future, error=lost_error(op, _relevant(lost, peers)))

    def close(self) -> None:
        """Let queued operations finish, then end the thread.

        The thread may be inside a wait abandoned after a rank was lost: it is joined anyway
        (gloo ends that wait by the deadline at the latest), since an interpreter that exits
        while a thread is inside gloo's wait aborts the process when the wait returns.
        """
        self._jobs.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=context.timeout() + 5.0)


def _guarded(op: str, fn: Callable[[], Any], peers: Peers = None) -> Callable[[], Any]:
    """``fn``, failing at once after a rank was lost, with backend errors translated.

    Posting work (``batch_isend_irecv``, ``all_reduce``) raises gloo's error at once when a
    connection already broke, before any wait could translate it.
    """

    def guarded() -> Any:
        live = get_liveness()
        lost = _relevant(live.lost, peers) if live is not None else set()
        if lost:
            raise lost_error(op, lost)
        try:
            return fn()
        except RuntimeError as err:
            if isinstance(err, GossamerError) or not is_backend_error(err):
                raise
            raise translate(op, -1, err, live) from err

    return guarded


def submit(op: str, fn: Callable[[], Any], *, peers: Peers = None) -> Handle:
    """Queue ``fn`` on this process's communication thread; return a handle to its result.

    Args:
        op: the operation's name (errors and the timeline show it).
        fn: what runs on the thread.
        peers: the global ranks ``fn`` talks to; None (default): any rank, so the loss of
            any rank fails it. With peers, only the loss of one of them does; an empty
            collection: ``fn`` deals with lost ranks itself (elastic gossip), nothing fails
            it early.

    Raises:
        RankLostError: a rank (of ``peers``) was lost earlier; nothing is queued.
    """
    runtime = context.runtime()
    live = get_liveness()
    lost = _relevant(live.lost, peers) if live is not None else set()
    if lost:
        raise lost_error(op, lost)
    engine = runtime.component("engine", Engine)
    return engine.submit(op, _guarded(op, fn, peers), runtime.timeout, peers)


def run(op: str, fn: Callable[[], Any], async_op: bool) -> Any:
    """Run ``fn`` on the communication thread: a handle if ``async_op``, else the result."""
    handle = submit(op, fn)
    return handle if async_op else handle.wait()
