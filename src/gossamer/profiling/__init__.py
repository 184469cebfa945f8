"""Profiling: a Chrome-trace timeline of gossamer's operations and of user activities.

See :mod:`gossamer.profiling.timeline` for the file layout. This package imports nothing of
gossamer but :mod:`gossamer.env` and :mod:`gossamer.errors`: the runtime tells it about the
job through :func:`attach` and :func:`detach`, which are for :func:`gossamer.init` and
:func:`gossamer.shutdown`, not for users.

Example:
    >>> from gossamer import profiling
    >>> with profiling.tracing("/tmp/trace"):  # doctest: +SKIP
    ...     with profiling.activity("model", "forward"):
    ...         loss = model(x)
"""

from __future__ import annotations

from gossamer.profiling.counters import (
    bytes_sent,
    bytes_sent_by_op,
    collective_bytes,
    count_collective,
    count_sent,
    reset_bytes_sent,
)
from gossamer.profiling.session import (
    attach,
    detach,
    maybe_start_from_env,
    start_timeline,
    stop_timeline,
    tracing,
)
from gossamer.profiling.spans import activity, end_activity, start_activity, timeline_enabled
from gossamer.profiling.trace import merge_traces

__all__ = [
    "activity",
    "attach",
    "bytes_sent",
    "bytes_sent_by_op",
    "collective_bytes",
    "count_collective",
    "count_sent",
    "detach",
    "end_activity",
    "maybe_start_from_env",
    "merge_traces",
    "reset_bytes_sent",
    "start_activity",
    "start_timeline",
    "stop_timeline",
    "timeline_enabled",
    "tracing",
]
