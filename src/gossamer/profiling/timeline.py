"""A per-process timeline of operations, written as Chrome trace-event JSON.

The file loads in ``chrome://tracing`` and in Perfetto (https://ui.perfetto.dev). Every rank
is one trace *process* (``pid`` = rank, named ``"rank k"``) and every row name (an operation
such as ``"neighbor_allreduce"``, or a name passed to :func:`start_activity`) is one *thread*
of it (a ``tid`` named by ``thread_name`` metadata). So a merged file shows one collapsible
group per rank with the same rows in each, which BlueFog's one-pid-per-tensor layout cannot
do once several ranks share a file. Each span is a complete (``"X"``) event labelled with its
activity: ``"queued"`` (submitted, waiting for the communication thread), ``"running"`` (the
operation's body), and inside it ``"communicating"`` and ``"combining"``.

Spans of one row that overlap without nesting (several asynchronous operations queued at
once, say) would be drawn wrongly on one track, so the writer spreads them over extra rows,
``"neighbor_allreduce (2)"`` and so on.

Files:

- :func:`start_timeline` ``("out/trace")`` writes ``out/trace.rank<k>.json`` on every rank
  (a trailing ``.json`` is dropped first: ``trace.json`` gives ``trace.rank0.json``). A
  ``{rank}`` in the path is replaced instead: ``"out/{rank}/trace.json"``.
- ``merged=True`` writes one file, ``out/trace.json`` (``{rank}`` becomes ``all``), on
  rank 0 only: :func:`stop_timeline` then gathers every rank's spans, so it is a collective.
- Timestamps are microseconds since the rank's own :func:`start_timeline`; the wall-clock
  time of that moment is kept under ``otherData``, and merging (``merged=True`` or
  :func:`merge_traces`) uses it to align the ranks.

Spans are kept in memory and written by :func:`stop_timeline`, or at interpreter exit if the
timeline is still on (per-rank files then, even with ``merged=True``, since other ranks may
already be gone). ``GOSSAMER_TIMELINE=<path>`` starts it in :func:`gossamer.init`.

When the timeline is off every recording function returns after one test of a module-level
flag, without allocating or locking. When on, recording a span costs a few microseconds and
no lock (one ``list.append``); each span holds about 100 bytes until written, and writing
takes some seconds per million spans.

Example:
    >>> from gossamer.profiling import timeline
    >>> timeline.start_timeline("/tmp/trace")  # doctest: +SKIP
    >>> with timeline.activity("model", "forward"):  # doctest: +SKIP
    ...     loss = model(x)
    >>> timeline.stop_timeline()  # doctest: +SKIP
    [PosixPath('/tmp/trace.rank0.json')]
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import pathlib
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from gossamer import env

__all__ = [
    "PHASES",
    "activity",
    "end_activity",
    "maybe_start_from_env",
    "merge_traces",
    "record",
    "start_activity",
    "start_timeline",
    "stop_timeline",
    "timeline_enabled",
    "traced",
    "tracing",
]

T = TypeVar("T")

# The activities the communication layer records, in the order an operation goes through.
PHASES = ("queued", "running", "communicating", "combining")

# A span: (row, activity, start ns, end ns, name of the exception that ended it or None).
_Span = tuple[str, str, int, int, str | None]

# The one flag every recording function tests first; nothing else is touched while it is off.
_on = False
_events: list[_Span] = []
_origin_ns = 0  # perf_counter_ns() at start: timestamps are relative to it
_anchor_ns = 0  # time.time_ns() at the same moment, to align ranks when merging
_path = ""
_merged = False
_lock = threading.Lock()  # guards starting/stopping and the open activities below
_open: dict[str, list[tuple[str, int]]] = {}  # row -> stack of (activity, start ns)
_local = threading.local()  # .op: the operation the engine is running on this thread
_rank_seen = 0
_hooks_installed = False
_now = time.perf_counter_ns

_FALLBACK_ROW = "gossamer"
_CHUNK = 10_000  # events encoded per json.dumps call when writing


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
        self._events.append((self._row, self._activity, self._t0, _now(), error))


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


def activity(name: str, activity: str) -> contextlib.AbstractContextManager[None]:
    """Time a ``with`` block as ``activity`` on row ``name`` (BlueFog's ``timeline_context``).

    Args:
        name (str): the row, e.g. a tensor or layer name.
        activity (str): the label of the span, e.g. ``"FORWARD"``.

    Returns:
        A context manager; it records nothing while the timeline is off.

    Example:
        >>> with activity("layer1.weight", "FORWARD"):
        ...     pass
    """
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
        events.append((name, "queued", submitted, started, None))
        outer = getattr(_local, "op", None)
        _local.op = name
        error = None
        try:
            return job()
        except BaseException as err:
            error = type(err).__name__
            raise
        finally:
            _local.op = outer
            events.append((name, "running", started, _now(), error))

    return run


def start_activity(name: str, activity: str) -> None:
    """Begin ``activity`` on row ``name``; :func:`end_activity` ends it.

    Activities on one row nest: ``end_activity(name)`` ends the latest one begun there, from
    any thread. Nothing is recorded while the timeline is off.

    Args:
        name (str): the row, e.g. a tensor name.
        activity (str): the label of the span.

    Example:
        >>> start_activity("batch", "LOAD")
        >>> end_activity("batch")
    """
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

    Example:
        >>> start_activity("batch", "LOAD")
        >>> end_activity("batch")
    """
    if not _on:
        return
    t1 = _now()
    with _lock:
        stack = _open.get(name)
        if not stack:
            return
        label, t0 = stack.pop()
        _events.append((name, label, t0, t1, None))


def _check_path(path: object, what: str) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} must be a str or os.PathLike; got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what} must be a non-empty path; got {path!r}")
    return text


def _stem(path: str) -> str:
    stem = path.removesuffix(".json")
    if not os.path.basename(stem):  # "out/": a directory was meant
        stem = os.path.join(stem, "timeline")
    return stem


def _rank_file(path: str, rank: int) -> pathlib.Path:
    if "{rank}" in path:
        return pathlib.Path(path.replace("{rank}", str(rank)))
    return pathlib.Path(f"{_stem(path)}.rank{rank}.json")


def _merged_file(path: str) -> pathlib.Path:
    if "{rank}" in path:
        return pathlib.Path(path.replace("{rank}", "all"))
    return pathlib.Path(f"{_stem(path)}.json")


def _rank() -> int:
    """This process's rank; the last one seen once gossamer has shut down, 0 before init."""
    global _rank_seen
    from gossamer import context  # lazily: this module must import without torch

    if context.is_initialized():
        _rank_seen = context.rank()
    return _rank_seen


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    from gossamer import context

    # Remember the rank while it is known: the exit handler may run after shutdown.
    context.on_shutdown(_rank)
    atexit.register(_write_at_exit)
    # A forked child is not the rank: it must neither record nor overwrite the rank's file.
    os.register_at_fork(after_in_child=_forget_in_child)
    _hooks_installed = True


def _forget_in_child() -> None:
    global _on, _events
    _on = False
    _events = []
    _open.clear()


def start_timeline(path: str | os.PathLike[str], *, merged: bool = False) -> None:
    """Start recording; spans are written when :func:`stop_timeline` is called.

    Args:
        path (str | os.PathLike): file prefix. Rank ``k`` writes ``<path>.rank<k>.json``
            (``<path>`` without a trailing ``.json``), or ``path`` with ``{rank}`` replaced.
        merged (bool): write one file, ``<path>.json``, on rank 0 instead: every rank's
            spans are gathered at :func:`stop_timeline`, which is then collective.

    Raises:
        TypeError: ``path`` is not a path or ``merged`` not a bool.
        ValueError: ``path`` is empty.
        RuntimeError: the timeline is already on.

    Example:
        >>> start_timeline("/tmp/trace")  # doctest: +SKIP
    """
    global _on, _events, _origin_ns, _anchor_ns, _path, _merged
    text = _check_path(path, "path")
    if not isinstance(merged, bool):
        raise TypeError(f"merged must be a bool; got {merged!r}")
    with _lock:
        if _on:
            raise RuntimeError(
                f"the timeline is already on (writing to {_path!r}); call stop_timeline() first"
            )
        _install_hooks()
        _rank()
        _events = []
        _open.clear()
        _path, _merged = text, merged
        _anchor_ns, _origin_ns = time.time_ns(), _now()
        _on = True


def _fits(open_ends: list[int], span: _Span) -> bool:
    """Close the spans that ended before ``span``; True if it nests in the innermost left."""
    while open_ends and open_ends[-1] <= span[2]:
        open_ends.pop()
    return not open_ends or span[3] <= open_ends[-1]


def _rows(spans: Iterable[_Span]) -> list[tuple[str, list[_Span]]]:
    """Group spans into rows (order of first appearance); split overlaps into extra rows.

    A track draws correctly only if its spans nest or are disjoint, so each span goes to the
    first of its name's tracks where it does.
    """
    by_name: dict[str, list[tuple[list[int], list[_Span]]]] = {}
    for span in sorted(spans, key=lambda s: (s[2], -s[3])):
        lanes = by_name.setdefault(span[0], [])
        lane = next((lane for lane in lanes if _fits(lane[0], span)), None)
        if lane is None:
            lane = ([], [])
            lanes.append(lane)
        lane[0].append(span[3])
        lane[1].append(span)
    rows = []
    for name, lanes in by_name.items():
        for i, (_, placed) in enumerate(lanes):
            rows.append((name if i == 0 else f"{name} ({i + 1})", placed))
    return rows


def _render(spans: list[_Span], rank: int, origin_ns: int) -> list[dict[str, Any]]:
    """Chrome trace events for one rank: metadata first, then each row's spans in time order."""
    events: list[dict[str, Any]] = [
        {
            "name": "process_name",
            "ph": "M",
            "pid": rank,
            "tid": 0,
            "args": {"name": f"rank {rank}"},
        },
        {
            "name": "process_sort_index",
            "ph": "M",
            "pid": rank,
            "tid": 0,
            "args": {"sort_index": rank},
        },
    ]
    for tid, (row, placed) in enumerate(_rows(spans), start=1):
        events.append(
            {"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}}
        )
        events.append(
            {
                "name": "thread_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": tid,
                "args": {"sort_index": tid},
            }
        )
        for _, label, t0, t1, error in placed:
            event: dict[str, Any] = {
                "name": label,
                "cat": "gossamer",
                "ph": "X",
                "ts": (t0 - origin_ns) / 1000,
                "dur": (t1 - t0) / 1000,
                "pid": rank,
                "tid": tid,
            }
            if error is not None:
                event["args"] = {"error": error}
            events.append(event)
    return events


def _document(events: list[dict[str, Any]], anchors: dict[int, int]) -> dict[str, Any]:
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        # Wall-clock time (ns since the epoch, exact) of ts = 0, per rank: what merging aligns.
        "otherData": {"gossamer_time_origin_ns": {str(r): a for r, a in anchors.items()}},
    }


def _write(path: pathlib.Path, document: dict[str, Any]) -> pathlib.Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write aside, then rename: a reader (or a crash) never sees half a file.
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    events = document["traceEvents"]
    rest = {k: v for k, v in document.items() if k != "traceEvents"}
    with open(partial, "w", encoding="utf-8") as f:
        # json.dump encodes in pure Python (~30 µs an event); json.dumps uses the C encoder.
        # Chunks keep the string in memory small for long traces.
        f.write('{"traceEvents":[')
        for i in range(0, len(events), _CHUNK):
            if i:
                f.write(",")
            f.write(json.dumps(events[i : i + _CHUNK], separators=(",", ":"))[1:-1])
        f.write("],")
        f.write(json.dumps(rest, separators=(",", ":"))[1:])
    os.replace(partial, path)
    return path


def _merge(parts: Iterable[tuple[int, int, list[dict[str, Any]]]]) -> dict[str, Any]:
    """One document from ``(rank, wall-clock origin ns, events)`` parts, aligned in time."""
    parts = sorted(parts, key=lambda p: p[0])
    if not parts:
        return _document([], {})
    first = min(anchor for _, anchor, _ in parts)
    merged: list[dict[str, Any]] = []
    for _, anchor, events in parts:
        shift = (anchor - first) / 1000
        for event in events:
            if event.get("ph") != "M" and "ts" in event:
                event = {**event, "ts": event["ts"] + shift}
            merged.append(event)
    return _document(merged, {rank: first for rank, _, _ in parts})


def _take() -> tuple[list[_Span], int, int, str, bool, list[tuple[str, list[tuple[str, int]]]]]:
    """Switch recording off and hand over what it collected."""
    global _on, _events
    with _lock:
        _on = False
        taken = (_events, _origin_ns, _anchor_ns, _path, _merged, list(_open.items()))
        _events = []
        _open.clear()
    return taken


def _close_open(spans: list[_Span], still_open: list[tuple[str, list[tuple[str, int]]]]) -> None:
    # Activities never ended are shown up to the stop, flagged, rather than dropped.
    end = _now()
    for row, stack in still_open:
        spans.extend((row, label, t0, end, "not ended") for label, t0 in stack)


def stop_timeline() -> list[pathlib.Path]:
    """Stop recording and write the trace; does nothing if the timeline is off.

    With ``merged=True`` this is a collective over the default process group
    (``torch.distributed.gather_object`` to rank 0): call it on every rank at the same point
    of the program, with no asynchronous operation pending (wait their handles first).

    Returns:
        list[pathlib.Path]: the files this rank wrote (none on ranks > 0 when merged).

    Raises:
        OSError: the file could not be written.

    Example:
        >>> stop_timeline()  # doctest: +SKIP
        [PosixPath('/tmp/trace.rank0.json')]
    """
    if not _on:
        return []
    spans, origin, anchor, path, merged, still_open = _take()
    _close_open(spans, still_open)
    rank = _rank()
    events = _render(spans, rank, origin)
    if not merged:
        return [_write(_rank_file(path, rank), _document(events, {rank: anchor}))]
    parts = [(rank, anchor, events)]
    from gossamer import context

    if context.is_initialized() and context.size() > 1:
        import torch.distributed as dist

        gathered: list[Any] | None = [None] * context.size() if rank == 0 else None
        dist.gather_object(parts[0], gathered, dst=0)
        if rank != 0:
            return []
        parts = list(gathered or [])
    return [_write(_merged_file(path), _merge(parts))]


def _write_at_exit() -> None:
    if not _on:
        return
    spans, origin, anchor, path, _, still_open = _take()
    _close_open(spans, still_open)
    rank = _rank()
    # Per-rank even when merged was asked for: the other ranks may be gone by now.
    _write(_rank_file(path, rank), _document(_render(spans, rank, origin), {rank: anchor}))


@contextlib.contextmanager
def tracing(path: str | os.PathLike[str], *, merged: bool = False) -> Iterator[None]:
    """Record a timeline for the duration of a ``with`` block.

    Args:
        path (str | os.PathLike): as for :func:`start_timeline`.
        merged (bool): as for :func:`start_timeline` (the exit is then collective).

    Example:
        >>> with tracing("/tmp/trace"):  # doctest: +SKIP
        ...     gossamer.neighbor_allreduce(x)
    """
    start_timeline(path, merged=merged)
    try:
        yield
    finally:
        stop_timeline()


def maybe_start_from_env() -> bool:
    """Start the timeline if ``GOSSAMER_TIMELINE`` names a path and it is not already on.

    Called by :func:`gossamer.init`. The timeline started this way writes per-rank files.

    Returns:
        bool: True if this call started it.

    Example:
        >>> maybe_start_from_env()  # GOSSAMER_TIMELINE unset
        False
    """
    path = env.settings().timeline
    if path is None or _on:
        return False
    start_timeline(path)
    return True


def merge_traces(
    inputs: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str]
) -> pathlib.Path:
    """Merge per-rank trace files written by this module into one, aligning their clocks.

    For timelines that could not be merged at stop (started by ``GOSSAMER_TIMELINE``).

    Args:
        inputs (Iterable[str | os.PathLike]): the per-rank files.
        output (str | os.PathLike): the merged file to write.

    Returns:
        pathlib.Path: ``output``.

    Raises:
        ValueError: an input is not a trace written by this module.

    Example:
        >>> files = sorted(glob.glob("/tmp/trace.rank*.json"))
        >>> merge_traces(files, "/tmp/trace.json")  # doctest: +SKIP
        PosixPath('/tmp/trace.json')
    """
    parts = []
    for name in inputs:
        with open(_check_path(name, "inputs"), encoding="utf-8") as f:
            document = json.load(f)
        origins = document.get("otherData", {}).get("gossamer_time_origin_ns")
        if not isinstance(origins, dict) or len(origins) != 1:
            raise ValueError(f"{name} is not a per-rank trace written by gossamer's timeline")
        ((rank, origin_ns),) = origins.items()
        parts.append((int(rank), int(origin_ns), document["traceEvents"]))
    return _write(pathlib.Path(_check_path(output, "output")), _merge(parts))
