"""The windows of one runtime: their progress service, its gloo groups, the live windows.

One :class:`Registry` is a component of the runtime (:func:`gossamer.context.runtime`), so
``shutdown`` frees every window and a new ``init`` starts from nothing.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from gossamer import context
from gossamer.transport import get_liveness, lost_error
from gossamer.transport.engine import Engine
from gossamer.transport.liveness import STALL_S, Liveness
from gossamer.windows.service import Service

__all__ = ["Registry", "registry"]


class Registry:
    """Live windows by name, the service that serves them, and the client thread."""

    def __init__(self) -> None:
        # The windows are freed through the engine at shutdown: start it first, so that
        # the runtime (which closes components newest first) closes it after this.
        context.runtime().component("engine", Engine)
        self.windows: dict[str, Any] = {}
        self.service: Service | None = None
        self._groups: tuple[dist.ProcessGroup, dist.ProcessGroup] | None = None
        self._ids = itertools.count(1)
        self._client: ThreadPoolExecutor | None = None
        # Operations in flight: future -> (what, when it started, the peers whose loss
        # fails it or None for any), for the loss watchdog.
        self._inflight: dict[concurrent.futures.Future, tuple[str, float, set[int] | None]] = {}
        self._inflight_lock = threading.Lock()
        live = get_liveness() if context.size() > 1 else None
        if live is not None:
            live.on_beat(self._fail_if_lost)
            live.report(self.stalled)

    def watch(
        self, what: str, done: concurrent.futures.Future, peers: set[int] | None = None
    ) -> None:
        """Fail ``done`` with RankLostError if it stalls while a rank is found lost.

        A put to a dead rank may never be answered and its connection may never report an
        error (gloo's receive from any source does not notice one peer's closure), so the
        heartbeat thread does what the engine's watchdog does for operations. With
        ``peers``, only the loss of one of them fails it (an elastic window's request).
        """
        with self._inflight_lock:
            self._inflight[done] = (what, time.monotonic(), peers)

        def forget(future: concurrent.futures.Future) -> None:
            with self._inflight_lock:
                self._inflight.pop(future, None)

        done.add_done_callback(forget)

    def stalled(self) -> str:
        """The window operation in flight for :data:`STALL_S` or more, or ``""``."""
        now = time.monotonic()
        with self._inflight_lock:
            waits = [(t, w) for w, t, _ in self._inflight.values() if now - t >= STALL_S]
        return min(waits)[1] if waits else ""

    def _fail_if_lost(self, live: Liveness) -> None:
        now = time.monotonic()
        with self._inflight_lock:
            stalled = [(f, w, p) for f, (w, t, p) in self._inflight.items() if now - t >= STALL_S]
        if not stalled:
            return
        lost = live.check()
        if not lost:
            return
        for future, what, peers in stalled:
            hit = lost if peers is None else lost & peers
            if hit:
                with contextlib.suppress(concurrent.futures.InvalidStateError):  # completed
                    future.set_exception(lost_error(what, hit))

    def names(self) -> list[str]:
        """Names of the live windows, sorted."""
        return sorted(self.windows)

    def next_id(self) -> int:
        """A new window id (the same on every rank: windows are created collectively)."""
        return next(self._ids)

    def start_service(self) -> Service | None:
        """The progress service, started if needed (collective on first use); None alone."""
        if self.service is None and context.size() > 1:
            if self._groups is None:  # one per direction (see Service)
                timeout = timedelta(seconds=context.timeout())
                up = dist.new_group(backend="gloo", timeout=timeout)
                self._groups = (up, dist.new_group(backend="gloo", timeout=timeout))
            self.service = Service(self._groups)
        return self.service

    def stop_service_if_idle(self, ring: list[int] | None = None) -> None:
        """Stop the service (collective over ``ring``, default all) once it serves no window."""
        if self.service is not None and not self.service.windows:
            service, self.service = self.service, None
            service.stop(ring)

    def client(self) -> ThreadPoolExecutor:
        """The one thread that posts this rank's window requests, in call order."""
        if self._client is None:
            self._client = ThreadPoolExecutor(1, thread_name_prefix="gossamer-window-ops")
        return self._client

    def close(self) -> None:
        """Free every window (collective), then stop the client thread."""
        for window in list(self.windows.values()):
            try:
                window.free()
            except Exception:  # shutdown must go on even if a peer is gone
                self.windows.pop(window.name, None)
        self.windows.clear()
        if self.service is not None:  # a free failed (a rank was lost): stop without peers
            service, self.service = self.service, None
            service.abort()
        if self._client is not None:
            self._client.shutdown(wait=False)
            self._client = None


def registry() -> Registry:
    """The registry of this runtime."""
    return context.runtime().component("windows", Registry)
