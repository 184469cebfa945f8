"""Starting and stopping the timeline, and its binding to the process of the job.

This package never imports the runtime: :func:`gossamer.init` calls :func:`attach` with this
process's rank, the size of the world and a collective that gathers one object from every rank
to rank 0, and :func:`gossamer.shutdown` calls :func:`detach`. Unattached, the timeline is
rank 0 of a world of one; detached, it has no gather but keeps the rank and the size attached
last: a timeline left on is written at interpreter exit, after shutdown, and a merged stop
after shutdown writes per-rank files rather than have every rank overwrite one merged file.

Example:
    >>> from gossamer.profiling import session
    >>> with session.tracing("/tmp/trace"):  # doctest: +SKIP
    ...     gossamer.neighbor_allreduce(x)
"""

from __future__ import annotations

import atexit
import contextlib
import os
import pathlib
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from gossamer import env
from gossamer.errors import CommunicationTimeout, GossamerError, PeerError
from gossamer.profiling import counters, spans, trace

__all__ = [
    "attach",
    "detach",
    "maybe_start_from_env",
    "start_timeline",
    "stop_timeline",
    "tracing",
]

# Sends one picklable object from every rank to rank 0: the list in rank order there, else None.
Gather = Callable[[object], list[Any] | None]


@dataclass(frozen=True)
class _World:
    """This process as the runtime last described it."""

    rank: int = 0
    size: int = 1
    gather: Gather | None = None
    detached: bool = False  # gossamer.shutdown() has run: rank and size are the last job's


@dataclass(frozen=True)
class _Run:
    """One start of the timeline: where to write, and the clocks at its ``ts = 0``."""

    path: str = ""
    merged: bool = False
    anchor_ns: int = 0  # time.time_ns(), to align ranks when merging
    origin_ns: int = 0  # perf_counter_ns() at the same moment: span times are relative to it


_world = _World()
_run = _Run()
_lock = threading.Lock()  # guards starting and stopping
_hooks_installed = False


def attach(rank: int, size: int, gather: Gather | None = None) -> None:
    """Tell the timeline which process of the job this is; for the runtime, not for users.

    :func:`gossamer.init` calls it; this package does not import the runtime.

    Args:
        rank (int): this process's rank: it names the per-rank file and the trace process.
        size (int): the number of ranks.
        gather (Callable[[object], list | None], optional): a collective sending one
            picklable object from every rank to rank 0, which gets the list in rank order
            (the others get None). :func:`stop_timeline` calls it on every rank to write a
            merged trace; without it a merged stop writes this rank's per-rank file when
            ``size > 1`` (with a warning), and the merged file when ``size == 1``.

    Raises:
        ValueError: ``rank`` is not in ``range(size)``.

    Example:
        >>> attach(0, 1)  # doctest: +SKIP
    """
    global _world
    if counters.check_count(rank, "rank") >= counters.check_count(size, "size"):
        raise ValueError(f"rank must be in range(size); got rank={rank}, size={size}")
    _world = _World(rank, size, gather)


def detach() -> None:
    """Forget the job at its shutdown; for the runtime, not for users.

    :func:`gossamer.shutdown` calls it. The process group is gone then, so a merged stop
    cannot gather: on a job of more than one rank it writes this rank's per-rank file (with a
    warning) rather than have every rank write the same merged file. The rank attached last
    still names the files: a timeline left on is written at interpreter exit, which may come
    after shutdown.

    Example:
        >>> detach()  # doctest: +SKIP
    """
    global _world
    _world = _World(rank=_world.rank, size=_world.size, detached=True)


def _install_hooks() -> None:
    global _hooks_installed
    if _hooks_installed:
        return
    atexit.register(_write_at_exit)
    # A forked child is not the rank: it must neither record nor overwrite the rank's file.
    os.register_at_fork(after_in_child=spans._forget)
    # SIGTERM's default action skips atexit, and SIGTERM is how the launcher stops the
    # ranks (Ctrl-C, a rank that died): exit through Python instead, so the file is written.
    on_main = threading.current_thread() is threading.main_thread()
    if on_main and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _exit_on_sigterm)
    _hooks_installed = True


def _exit_on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    if not spans.timeline_enabled():  # stopped since: nothing to write, die as by default
        os.kill(os.getpid(), signum)
        return
    raise SystemExit(128 + signum)


def start_timeline(path: str | os.PathLike[str], *, merged: bool = False) -> None:
    """Start recording; spans are written when :func:`stop_timeline` is called.

    Args:
        path (str | os.PathLike): file prefix. Rank ``k`` writes ``<path>.rank<k>.json``
            (``<path>`` without a trailing ``.json``), or ``path`` with ``{rank}`` replaced.
        merged (bool): write one file, ``<path>.json``, on rank 0 instead: every rank's
            spans are gathered at :func:`stop_timeline`, which is then collective.

    Raises:
        TypeError: ``path`` is not a path or ``merged`` not a bool.
        ValueError: ``path`` is empty, names a directory, or its folder cannot be made or
            written.
        RuntimeError: the timeline is already on.

    Example:
        >>> start_timeline("/tmp/trace")  # doctest: +SKIP
    """
    global _run
    text = trace._check_path(path, "path")
    if not isinstance(merged, bool):
        raise TypeError(f"merged must be a bool; got {merged!r}")
    # Found now, not at the stop (or at exit, where the trace would be lost quietly).
    trace.check_writable(trace._rank_file(text, _world.rank), "path")
    if merged:
        trace.check_writable(trace._merged_file(text), "path")
    with _lock:
        if spans.timeline_enabled():
            raise RuntimeError(
                f"the timeline is already on (writing to {_run.path!r}); call stop_timeline() first"
            )
        _install_hooks()
        _run = _Run(text, merged, anchor_ns=time.time_ns(), origin_ns=spans._now())
        spans._switch_on()


def _take() -> tuple[_Run, trace._Part]:
    """Switch recording off; hand over the run and this rank's spans, rendered."""
    with _lock:
        run, recorded = _run, spans._switch_off()
    rank = _world.rank
    return run, (rank, run.anchor_ns, trace._render(recorded, rank, run.origin_ns))


def stop_timeline() -> list[pathlib.Path]:
    """Stop recording and write the trace; does nothing if the timeline is off.

    With ``merged=True`` this is a collective over gossamer's host process group
    (``torch.distributed.gather_object`` to rank 0): call it on every rank at the same point
    of the program, with no asynchronous operation pending (wait their handles first), and
    before :func:`gossamer.shutdown`. After shutdown, on a job of more than one rank, there is
    nothing to gather over: each rank then writes its per-rank file, as without ``merged``,
    and warns (join them with :func:`merge_traces`). If the gather fails (a peer exited or
    died), this rank's spans are written to its per-rank file before the error is raised.

    Returns:
        list[pathlib.Path]: the files this rank wrote (none on ranks > 0 when merged).

    Raises:
        OSError: the file could not be written.
        PeerError: ``merged=True`` and gathering the ranks' spans failed
            (:class:`~gossamer.errors.CommunicationTimeout` if it timed out); the
            original error is its ``__cause__``.

    Example:
        >>> stop_timeline()  # doctest: +SKIP
        [PosixPath('/tmp/trace.rank0.json')]
    """
    if not spans.timeline_enabled():
        return []
    run, part = _take()
    if not run.merged:
        return [trace._write_rank(run.path, part)]
    world = _world
    if world.size == 1:
        return [trace._write(trace._merged_file(run.path), trace._merge([part]))]
    if world.gather is None:
        # Every rank would write the same merged file, and only the last one's spans survive.
        written = trace._write_rank(run.path, part)
        why = "after gossamer.shutdown()" if world.detached else "without a gather (attach)"
        warnings.warn(
            f"stop_timeline(merged=True) {why} on rank {world.rank} of {world.size}: the merge "
            "needs a live runtime to gather every rank's spans, so this rank wrote its "
            f"per-rank file {str(written)!r}; stop the timeline before gossamer.shutdown(), "
            "or join the files with gossamer.profiling.merge_traces",
            RuntimeWarning,
            stacklevel=2,
        )
        return [written]
    try:
        gathered = world.gather(part)
    except Exception as err:
        raise _gather_failed(run, part, world, err) from err
    if gathered is None:  # not rank 0, which writes the file
        return []
    return [trace._write(trace._merged_file(run.path), trace._merge(gathered))]


def _gather_failed(run: _Run, part: trace._Part, world: _World, err: Exception) -> GossamerError:
    """Write this rank's spans on its own, and the error that a merged stop raises then."""
    try:
        kept = f"this rank's spans were written to {str(trace._write_rank(run.path, part))!r}"
    except OSError as lost:
        kept = f"this rank's spans could not be written either ({lost})"
    reason = (str(err).strip().splitlines() or [""])[0][:300]
    kind = CommunicationTimeout if isinstance(err, TimeoutError) else PeerError
    return kind(
        f"stop_timeline(merged=True) on rank {world.rank} of {world.size}: gathering every "
        f"rank's spans to rank 0 failed ({type(err).__name__}: {reason}); a peer may have "
        f"exited, died, or not called stop_timeline; {kept}"
    )


def _write_at_exit() -> None:
    if not spans.timeline_enabled():
        return
    run, part = _take()
    # Per-rank even when merged was asked for: the other ranks may be gone by now.
    try:
        trace._write_rank(run.path, part)
    except OSError as err:  # a traceback from an atexit hook says less than this
        print(f"gossamer: the timeline {run.path!r} could not be written: {err}", file=sys.stderr)


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
    if path is None or spans.timeline_enabled():
        return False
    try:
        start_timeline(path)
    except ValueError as err:
        raise ValueError(f"GOSSAMER_TIMELINE={path!r}: {err}") from None
    return True
