"""Recording spans: the state of the timeline and the hooks called on the hot path.

Each recording function tests one module-level flag first and returns at once while the
timeline is off (costs in :mod:`gossamer.profiling.timeline`). Starting and stopping are
:mod:`gossamer.profiling.session`'s, writing is :mod:`gossamer.profiling.trace`'s.

Example:
    >>> from gossamer.profiling import spans
    >>> with spans.record("neighbor_allreduce", "combining"):  # a no-op while off
    ...     pass
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import TypeVar

__all__ = [
    "PHASES",
    "activity",
    "begin",
    "end_activity",
    "record",
    "sent",
    "start_activity",
    "timeline_enabled",
    "traced",
]

T = TypeVar("T")

# The activities the communication layer records, in the order an operation goes through.
PHASES = ("queued", "running", "communicating", "combining")

# A span: (row, activity, start ns, end ns, name of the exception that ended it or None,
# bytes sent during it: 0 when none or not counted).
Span = tuple[str, str, int, int, str | None, int]
# Activities begun and not yet ended: row -> stack of (activity, start ns).
_Open = dict[str, list[tuple[str, int]]]

# The one flag every recording function tests first; nothing else is touched while it is off.
_on = False
_events: list[Span] = []
_lock = threading.Lock()  # guards the open activities and the handing over of the buffers
_open: _Open = {}
# .op: the operation the engine is running on this thread; .sent: [bytes it sent so far]
_local = threading.local()
_now = time.perf_counter_ns

_FALLBACK_ROW = "gossamer"


class _Off:
    """The context manager returned while the timeline is off: shared, does nothing."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


_OFF = _Off()


class _Recording:
    """Times a ``with`` block into the buffer that was current when the block began."""

    __slots__ = ("_activity", "_events", "_row", "_t0")

    def __init__(self, row: str | None, activity: str) -> None:
        self._row = row
        self._activity = activity

    def __enter__(self) -> None:
        if self._row is None:
            self._row = getattr(_local, "op", None) or _FALLBACK_ROW
        # Keep the buffer, not the module global: a span still open when the timeline is
        # stopped and restarted must not land in the next trace with a foreign start time.
        self._events = _events
        self._t0 = _now()

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        error = None if exc_type is None else exc_type.__name__
        self._events.append((self._row, self._activity, self._t0, _now(), error, 0))


def timeline_enabled() -> bool:
    """True while the timeline records.

    Example:
        >>> timeline_enabled()
        False
    """
    return _on


def record(name: str | None, phase: str) -> contextlib.AbstractContextManager[None]:
    """Time a ``with`` block as ``phase`` on row ``name``: the communication layer's hook.

    Args:
        name (str | None): the row, usually the operation (``"neighbor_allreduce"``).
            ``None`` means the operation the engine is running on this thread, so shared
            helpers such as the weighted combine need not be told which one called them.
        phase (str): one of :data:`PHASES` (not checked: this is on the hot path).

    Returns:
        A context manager; a shared no-op one while the timeline is off.

    Example:
        >>> with record("neighbor_allreduce", "combining"):
        ...     pass
    """
    if not _on:
        return _OFF
    return _Recording(name, phase)


def _check_label(value: object, what: str) -> None:
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str; got {value!r}")


def activity(name: str, activity: str) -> contextlib.AbstractContextManager[None]:
    """Time a ``with`` block as ``activity`` on row ``name`` (BlueFog's ``timeline_context``).

    Args:
        name (str): the row, e.g. a tensor or layer name.
        activity (str): the label of the span, e.g. ``"FORWARD"``.

    Returns:
        A context manager; it records nothing while the timeline is off.

    Raises:
        TypeError: ``name`` or ``activity`` is not a str.

    Example:
        >>> with activity("layer1.weight", "FORWARD"):
        ...     pass
    """
    _check_label(name, "name")
    _check_label(activity, "activity")
    if not _on:
        return _OFF
    return _Recording(name, activity)


def traced(name: str, job: Callable[[], T]) -> Callable[[], T]:
    """Wrap a job submitted to the communication thread: ``queued`` now, ``running`` later.

    The span ``"queued"`` lasts from this call until the job starts; ``"running"`` covers
    the job itself, during which :func:`record` with ``name=None`` means ``name``.

    Args:
        name (str): the operation, which names the row.
        job (Callable[[], T]): what the communication thread will call.

    Returns:
        ``job`` itself while the timeline is off, else a wrapper around it.

    Example:
        >>> traced("allreduce", print) is print  # timeline off
        True
    """
    if not _on:
        return job
    events = _events
    submitted = _now()

    def run() -> T:
        started = _now()
        events.append((name, "queued", submitted, started, None, 0))
        outer, outer_sent = getattr(_local, "op", None), getattr(_local, "sent", None)
        _local.op, _local.sent = name, [0]
        sent = _local.sent
        error = None
        try:
            return job()
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            _local.op, _local.sent = outer, outer_sent
            events.append((name, "running", started, _now(), error, sent[0]))

    return run


def _nothing() -> None:
    pass


def begin(name: str, phase: str) -> Callable[[], None]:
    """Begin ``phase`` on row ``name`` now; the returned function ends it, from any thread.

    For work that runs outside gossamer's threads (an allreduce posted to gloo, ended by its
    completion callback). While the timeline is off, a shared no-op.

    Example:
        >>> end = begin("allreduce", "communicating")
        >>> end()
    """
    if not _on:
        return _nothing
    events, t0 = _events, _now()

    def end() -> None:
        events.append((name, phase, t0, _now(), None, 0))

    return end


def sent(op: str, nbytes: int) -> None:
    """Put ``nbytes`` sent by ``op`` on the timeline (the byte counters' hook).

    Inside a job of the communication thread (:func:`traced`) the bytes add to that job's
    ``"running"`` span (its ``args.bytes``); elsewhere (the window service's threads) they
    are a span ``"sent"`` of no duration on row ``op``. Nothing happens while the timeline
    is off.
    """
    if not _on:
        return
    total = getattr(_local, "sent", None)
    if total is not None:
        total[0] += nbytes
        return
    now = _now()
    _events.append((op, "sent", now, now, None, nbytes))


def start_activity(name: str, activity: str) -> None:
    """Begin ``activity`` on row ``name``; :func:`end_activity` ends it.

    Activities on one row nest: ``end_activity(name)`` ends the latest one begun there, from
    any thread. Nothing is recorded while the timeline is off.

    Args:
        name (str): the row, e.g. a tensor name.
        activity (str): the label of the span.

    Raises:
        TypeError: ``name`` or ``activity`` is not a str.

    Example:
        >>> start_activity("batch", "LOAD")
        >>> end_activity("batch")
    """
    _check_label(name, "name")
    _check_label(activity, "activity")
    if not _on:
        return
    t0 = _now()
    with _lock:
        _open.setdefault(name, []).append((activity, t0))


def end_activity(name: str) -> None:
    """End the latest activity begun on row ``name`` by :func:`start_activity`.

    An end without a matching start is ignored: the timeline may have been switched on
    between the two calls.

    Args:
        name (str): the row given to :func:`start_activity`.

    Raises:
        TypeError: ``name`` is not a str.

    Example:
        >>> start_activity("batch", "LOAD")
        >>> end_activity("batch")
    """
    _check_label(name, "name")
    if not _on:
        return
    t1 = _now()
    with _lock:
        stack = _open.get(name)
        if not stack:
            return
        label, t0 = stack.pop()
        _events.append((name, label, t0, t1, None, 0))


def _switch_on() -> None:
    """Start recording into empty buffers (the session has checked that it was off)."""
    global _on, _events
    with _lock:
        _events = []
        _open.clear()
        _on = True


def _switch_off() -> list[Span]:
    """Stop recording and hand over the spans, activities never ended included."""
    global _on, _events
    with _lock:
        _on = False
        spans, still_open = _events, list(_open.items())
        _events = []
        _open.clear()
    # Activities never ended are shown up to the stop, flagged, rather than dropped.
    end = _now()
    for row, stack in still_open:
        spans.extend((row, label, t0, end, "not ended", 0) for label, t0 in stack)
    return spans


def _forget() -> None:
    """Drop everything without recording more: for a forked child, which is not the rank."""
    global _on, _events
    # No lock: another thread of the parent may have held it at the fork, and nothing else
    # runs in the child yet.
    _on = False
    _events = []
    _open.clear()
