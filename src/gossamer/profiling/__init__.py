"""Profiling: a Chrome-trace timeline of gossamer's operations and of user activities.

See :mod:`gossamer.profiling.timeline` for the file layout.

Example:
    >>> from gossamer import profiling
    >>> with profiling.tracing("/tmp/trace"):  # doctest: +SKIP
    ...     with profiling.activity("model", "forward"):
    ...         loss = model(x)
"""

from __future__ import annotations

from gossamer.profiling.timeline import (
    activity,
    end_activity,
    maybe_start_from_env,
    merge_traces,
    start_activity,
    start_timeline,
    stop_timeline,
    timeline_enabled,
    tracing,
)

__all__ = [
    "activity",
    "end_activity",
    "maybe_start_from_env",
    "merge_traces",
    "start_activity",
    "start_timeline",
    "stop_timeline",
    "timeline_enabled",
    "tracing",
]
