"""Chrome trace-event files: spans rendered as rows of one rank, written, and merged.

The layout (one trace process per rank, one thread per row, overlapping spans of a row spread
over extra rows, wall-clock origins under ``otherData``) is described in
:mod:`gossamer.profiling.timeline`.

Example:
    >>> from gossamer.profiling import trace
    >>> files = sorted(glob.glob("/tmp/trace.rank*.json"))
    >>> trace.merge_traces(files, "/tmp/trace.json")  # doctest: +SKIP
    PosixPath('/tmp/trace.json')
"""

from __future__ import annotations

import json
import os
import pathlib
import reprlib
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gossamer.profiling.spans import Span

__all__ = ["merge_traces"]

_CHUNK = 10_000  # events encoded per json.dumps call when writing

# One rank's share of a merged trace: (rank, wall-clock ns of its ts = 0, its events).
_Part = tuple[int, int, list[dict[str, Any]]]


def _check_path(path: object, what: str) -> str:
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"{what} must be a str or os.PathLike; got {type(path).__name__}")
    text = os.fspath(path)
    if not isinstance(text, str) or not text:
        raise ValueError(f"{what} must be a non-empty path; got {path!r}")
    return text


def check_writable(file: pathlib.Path, what: str) -> None:
    """Raise unless ``file`` can be written: its folder made, and it is not a folder itself.

    Raises:
        ValueError: naming ``what`` and the reason.
    """
    if file.is_dir():
        raise ValueError(f"{what}: {str(file)!r} is a directory, not a file to write")
    try:
        file.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"{what}: cannot make the folder of {str(file)!r} ({err})") from err
    if not os.access(file.parent, os.W_OK):
        raise ValueError(f"{what}: the folder of {str(file)!r} is not writable")


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


def _fits(open_ends: list[int], span: Span) -> bool:
    """Close the spans that ended before ``span``; True if it nests in the innermost left."""
    while open_ends and open_ends[-1] <= span[2]:
        open_ends.pop()
    return not open_ends or span[3] <= open_ends[-1]


def _rows(spans: Iterable[Span]) -> list[tuple[str, list[Span]]]:
    """Group spans into rows (order of first appearance); split overlaps into extra rows.

    A track draws correctly only if its spans nest or are disjoint, so each span goes to the
    first of its name's tracks where it does.
    """
    by_name: dict[str, list[tuple[list[int], list[Span]]]] = {}
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


def _render(spans: list[Span], rank: int, origin_ns: int) -> list[dict[str, Any]]:
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
        for _, label, t0, t1, error, *extra in placed:
            nbytes = extra[0] if extra else 0  # spans recorded before bytes were counted
            event: dict[str, Any] = {
                "name": label,
                "cat": "gossamer",
                "ph": "X",
                "ts": (t0 - origin_ns) / 1000,
                "dur": (t1 - t0) / 1000,
                "pid": rank,
                "tid": tid,
            }
            args: dict[str, Any] = {}
            if error is not None:
                args["error"] = error
            if nbytes:
                args["bytes"] = nbytes
            if args:
                event["args"] = args
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
    try:
        with open(partial, "w", encoding="utf-8") as f:
            # json.dump encodes in pure Python (~30 µs an event); json.dumps uses the C
            # encoder. Chunks keep the string in memory small for long traces.
            f.write('{"traceEvents":[')
            for i in range(0, len(events), _CHUNK):
                if i:
                    f.write(",")
                f.write(json.dumps(events[i : i + _CHUNK], separators=(",", ":"))[1:-1])
            f.write("],")
            f.write(json.dumps(rest, separators=(",", ":"))[1:])
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
    return path


def _write_rank(path: str, part: _Part) -> pathlib.Path:
    """Write one rank's part to its own file: ``path`` named for that rank (:func:`_rank_file`)."""
    rank, anchor, events = part
    return _write(_rank_file(path, rank), _document(events, {rank: anchor}))


def _ns(us: float) -> int:
    """Integer nanoseconds of a time :func:`_render` wrote in microseconds (``ns / 1000``)."""
    return round(us * 1000)


def _merge(parts: Iterable[_Part]) -> dict[str, Any]:
    """One document from ``(rank, wall-clock origin ns, events)`` parts, aligned in time.

    Shifted in integer nanoseconds: a span that ended as the next began still does so, where
    adding a float shift to ``ts`` alone would round the two ends apart (partial overlaps,
    which the viewer draws wrongly).
    """
    parts = sorted(parts, key=lambda p: p[0])
    if not parts:
        return _document([], {})
    first = min(anchor for _, anchor, _ in parts)
    merged: list[dict[str, Any]] = []
    for _, anchor, events in parts:
        shift_ns = anchor - first
        for event in events:
            if event.get("ph") != "M" and "ts" in event:
                event = {**event, "ts": (_ns(event["ts"]) + shift_ns) / 1000}
                if "dur" in event:
                    event["dur"] = _ns(event["dur"]) / 1000
            merged.append(event)
    return _document(merged, {rank: first for rank, _, _ in parts})


def _not_a_rank_trace(where: str, why: str) -> ValueError:
    return ValueError(f"{where} is not a per-rank trace written by gossamer's timeline: {why}")


def _read_part(where: str, path: str) -> _Part:
    """One per-rank file as a :data:`_Part`; ``where`` names it in errors (``inputs[0] = ...``)."""
    with open(path, encoding="utf-8") as f:
        try:
            document = json.load(f)
        except json.JSONDecodeError as err:
            raise _not_a_rank_trace(where, f"it is not JSON ({err})") from err
    if not isinstance(document, dict):
        raise _not_a_rank_trace(where, f"its JSON is a {type(document).__name__}, not an object")
    events = document.get("traceEvents")
    if not isinstance(events, list):
        raise _not_a_rank_trace(where, f"its traceEvents is {reprlib.repr(events)}, not a list")
    other = document.get("otherData")
    if not isinstance(other, dict):
        raise _not_a_rank_trace(where, f"its otherData is {reprlib.repr(other)}, not an object")
    origins = other.get("gossamer_time_origin_ns")
    if not isinstance(origins, dict) or len(origins) != 1:
        raise _not_a_rank_trace(
            where,
            f"its otherData.gossamer_time_origin_ns is {reprlib.repr(origins)}, not one"
            " {rank: origin} (a merged trace holds several ranks)",
        )
    ((rank, origin_ns),) = origins.items()
    if not rank.isdigit() or not isinstance(origin_ns, int) or isinstance(origin_ns, bool):
        raise _not_a_rank_trace(
            where, f"its time origin {{{rank!r}: {origin_ns!r}}} is not {{rank: integer ns}}"
        )
    return int(rank), origin_ns, events


def merge_traces(
    inputs: Iterable[str | os.PathLike[str]], output: str | os.PathLike[str]
) -> pathlib.Path:
    """Merge per-rank trace files written by this module into one, aligning their clocks.

    For timelines that could not be merged at stop (started by ``GOSSAMER_TIMELINE``).

    Args:
        inputs (Iterable[str | os.PathLike]): the per-rank files, one per rank (a list, not
            a single path).
        output (str | os.PathLike): the merged file to write.

    Returns:
        pathlib.Path: ``output``.

    Raises:
        TypeError: ``inputs`` is a single path or not iterable, or an input or ``output``
            is not a path.
        ValueError: ``inputs`` is empty, an input is not a per-rank trace written by this
            module, two inputs hold the same rank, or ``output`` is a directory or in a
            folder that cannot be made or written.
        OSError: an input could not be read or ``output`` written.

    Example:
        >>> files = sorted(glob.glob("/tmp/trace.rank*.json"))
        >>> merge_traces(files, "/tmp/trace.json")  # doctest: +SKIP
        PosixPath('/tmp/trace.json')
    """
    if isinstance(inputs, str | bytes | os.PathLike):
        raise TypeError(
            f"inputs must be an iterable of per-rank trace files, not a single path; got "
            f"{inputs!r} (pass [{inputs!r}] to merge one file)"
        )
    try:
        names = list(inputs)
    except TypeError:
        raise TypeError(
            f"inputs must be an iterable of per-rank trace files; got {type(inputs).__name__}"
        ) from None
    if not names:
        raise ValueError("inputs must name at least one per-rank trace file; got none")
    target = pathlib.Path(_check_path(output, "output"))
    check_writable(target, "output")
    parts: list[_Part] = []
    holder: dict[int, str] = {}  # rank -> the input that held it
    for i, name in enumerate(names):
        path = _check_path(name, f"inputs[{i}]")
        where = f"inputs[{i}] = {path!r}"
        part = _read_part(where, path)
        if part[0] in holder:
            raise ValueError(
                f"{holder[part[0]]} and {where} both hold rank {part[0]}; "
                "merge_traces takes one file per rank"
            )
        holder[part[0]] = where
        parts.append(part)
    return _write(target, _merge(parts))
