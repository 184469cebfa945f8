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
  Stopped after :func:`gossamer.shutdown` (nothing left to gather over), it writes per-rank
  files and warns; if the gather fails (a peer gone), this rank's file is written before the
  error is raised.
- Timestamps are microseconds since the rank's own :func:`start_timeline`; the wall-clock
  time of that moment is kept under ``otherData``, and merging (``merged=True`` or
  :func:`merge_traces`) uses it to align the ranks.

Spans are kept in memory and written by :func:`stop_timeline`, or at interpreter exit if the
timeline is still on (per-rank files then, even with ``merged=True``, since other ranks may
already be gone). ``GOSSAMER_TIMELINE=<path>`` starts it in :func:`gossamer.init`.

The timeline is made of :mod:`gossamer.profiling.spans` (recording),
:mod:`gossamer.profiling.trace` (the files) and :mod:`gossamer.profiling.session` (starting,
stopping, and the binding to the runtime); this module gathers their API under one name.

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

from gossamer.profiling.session import (
    maybe_start_from_env,
    start_timeline,
    stop_timeline,
    tracing,
)
from gossamer.profiling.spans import (
    PHASES,
    activity,
    begin,
    end_activity,
    record,
    start_activity,
    timeline_enabled,
    traced,
)
from gossamer.profiling.trace import merge_traces

__all__ = [
    "PHASES",
    "activity",
    "begin",
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
