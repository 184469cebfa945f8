"""BlueFog's timeline on :mod:`gossamer.profiling.timeline`: its files, activities and names.

BlueFog writes the timeline when ``BLUEFOG_TIMELINE`` (``bfrun --timeline-filename``) names a
file prefix: rank ``k`` writes ``<prefix><k>.json``. :func:`start_from_env` (called by
``bf.init``) does the same on gossamer's timeline; ``GOSSAMER_TIMELINE=<prefix>`` (read by
``gossamer.init``) and :func:`gossamer.profiling.start_timeline` keep working, with
gossamer's file names. An activity is a span on the row named ``tensor_name`` of this rank's
trace.

While the timeline is on, the facade's operations record BlueFog's activity names on
BlueFog's rows (:func:`recorded`): ``ENQUEUE_NEIGHBOR_ALLREDUCE`` on the row
``neighbor.allreduce.<name>`` (``neighbor.allreduce.noname.<n>`` without a ``name``) from the
call until the operation completes, ``ENQUEUE_WIN_PUT`` on the window's name, and so on; the
optimizers record ``FORWARD`` and ``GRADIENT COMPT.`` per parameter
(:func:`parameter_activities`). gossamer's own spans of each operation (``queued``,
``running``, ``communicating``, ``combining``) are recorded beside them, on rows named by the
operation; BlueFog's core activities (``PROC_*``, ``COMMUNICATE``, ``NEGOTIATION``, ...) are
not produced.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import nn

from gossamer import env
from gossamer.profiling import timeline
from gossamer.transport import Handle

__all__ = [
    "parameter_activities",
    "recorded",
    "start_from_env",
    "stop_started_from_env",
    "timeline_context",
    "timeline_end_activity",
    "timeline_start_activity",
]

logger = logging.getLogger(__name__)

F = TypeVar("F", bound=Callable[..., Any])

_complained = [False]
# The path given to start_timeline by start_from_env while that run is on, else None.
_started: list[str | None] = [None]
# Numbers the rows of operations called without a name (BlueFog numbers them by handle).
_noname = itertools.count()


def _on() -> bool:
    """Whether the timeline records; logs an error the first time it does not (as BlueFog)."""
    if timeline.timeline_enabled():
        return True
    if not _complained[0]:
        _complained[0] = True
        logger.error(
            "The timeline is not on, so timeline activities are not recorded. Set "
            "BLUEFOG_TIMELINE=<file prefix> (or GOSSAMER_TIMELINE) before bf.init() "
            "or call gossamer.profiling.start_timeline()."
        )
    return False


def start_from_env() -> bool:
    """Start the timeline as BlueFog does when ``BLUEFOG_TIMELINE`` names a file prefix.

    Rank ``rank`` will write ``<prefix><rank>.json``, exactly BlueFog's name (a ``{rank}``
    in the prefix is the one exception: it is replaced by the rank). A relative prefix is
    taken from the working directory of this call, where BlueFog opened its file. The file
    is written by :func:`stop_started_from_env` (``bf.shutdown``), by
    :func:`gossamer.profiling.stop_timeline`, or at exit.

    Returns:
        bool: True if this call started the timeline; False when ``BLUEFOG_TIMELINE`` is
        unset or the timeline was already on (``GOSSAMER_TIMELINE`` wins).

    Example:
        >>> start_from_env()  # BLUEFOG_TIMELINE unset
        False
    """
    prefix = env.settings().bluefog_timeline
    if prefix is None:
        return False
    if timeline.timeline_enabled():
        logger.warning(
            "BLUEFOG_TIMELINE=%s is ignored: the timeline is already on (GOSSAMER_TIMELINE or "
            "gossamer.profiling.start_timeline)",
            prefix,
        )
        return False
    # os.path.join, not abspath: a prefix "out/" must keep its slash ("out/0.json").
    path = os.path.join(os.getcwd(), prefix) + "{rank}.json"
    timeline.start_timeline(path)
    _started[0] = path
    logger.debug("timeline started from BLUEFOG_TIMELINE: %s", path)
    return True


def stop_started_from_env() -> None:
    """Write and stop the timeline if :func:`start_from_env` started it (for ``bf.shutdown``).

    BlueFog's file is complete once BlueFog shuts down; so is this one. A timeline started
    otherwise is left alone.

    Example:
        >>> stop_started_from_env()  # not started from BLUEFOG_TIMELINE: nothing happens
    """
    path, _started[0] = _started[0], None
    if path is not None and timeline.timeline_enabled():
        timeline.stop_timeline()


def recorded(
    prefix: str | None, activity: str, handle_of: Callable[[Any], Handle | None] | None = None
) -> Callable[[F], F]:
    """Record BlueFog's ``activity`` (``"ENQUEUE_ALLREDUCE"``...) for each call of a facade op.

    The row is BlueFog's tensor name: ``<prefix>.<name>``, or ``<prefix>.noname.<n>`` when
    the call has no ``name``; with ``prefix=None`` it is ``name`` itself (window operations).
    The span lasts from the call until the operation completes: the return of a blocking
    call, or the completion of the handle ``handle_of(result)`` of a nonblocking one. While
    the timeline is off the call costs one test of a flag.

    Args:
        prefix (str | None): BlueFog's operation prefix (``"neighbor.allreduce"``).
        activity (str): the span's label.
        handle_of (Callable, optional): maps a nonblocking call's integer handle to the
            gossamer :class:`~gossamer.transport.Handle` it stands for.
    """

    def wrap(fn: F) -> F:
        position = list(inspect.signature(fn).parameters).index("name")

        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if not timeline.timeline_enabled():
                return fn(*args, **kwargs)
            name = kwargs.get("name", args[position] if len(args) > position else None)
            row = _row(prefix, name)
            timeline.start_activity(row, activity)
            try:
                result = fn(*args, **kwargs)
            except BaseException:
                timeline.end_activity(row)
                raise
            handle = None if handle_of is None else handle_of(result)
            if handle is None:
                timeline.end_activity(row)
            else:
                handle.get_future().add_done_callback(lambda _: timeline.end_activity(row))
            return result

        return call  # type: ignore[return-value]

    return wrap


def _row(prefix: str | None, name: object) -> str:
    if prefix is None:
        return str(name)
    if name:
        return f"{prefix}.{name}"
    return f"{prefix}.noname.{next(_noname)}"


def timeline_start_activity(tensor_name: str, activity_name: str) -> bool:
    """Begin ``activity_name`` on the timeline row ``tensor_name``.

    Args:
        tensor_name (str): the row (BlueFog's tensor name).
        activity_name (str): the label of the span.

    Returns:
        bool: True if recorded; False (with an error logged once) while the timeline is off.

    Example:
        >>> timeline_start_activity("batch", "LOAD")  # timeline off
        False
    """
    if not _on():
        return False
    timeline.start_activity(tensor_name, activity_name)
    return True


def timeline_end_activity(tensor_name: str) -> bool:
    """End the latest activity begun on the row ``tensor_name``.

    Args:
        tensor_name (str): the row given to :func:`timeline_start_activity`.

    Returns:
        bool: True if recorded; False (with an error logged once) while the timeline is off.

    Example:
        >>> timeline_end_activity("batch")  # timeline off
        False
    """
    if not _on():
        return False
    timeline.end_activity(tensor_name)
    return True


@contextlib.contextmanager
def timeline_context(tensor_name: str, activity_name: str) -> Iterator[None]:
    """Record the ``with`` block as ``activity_name`` on the row ``tensor_name``.

    The activity ends also when the block raises (BlueFog's left it open).

    Example:
        >>> with timeline_context("model", "FORWARD"):
        ...     pass
    """
    started = timeline_start_activity(tensor_name, activity_name)
    try:
        yield
    finally:
        if started:
            timeline.end_activity(tensor_name)


def parameter_activities(
    param_names: Mapping[torch.Tensor, str], models: Sequence[nn.Module]
) -> list[Any]:
    """Hooks that record ``FORWARD`` and ``GRADIENT COMPT.`` spans per parameter (BlueFog's).

    Rows are named by the parameters' names; returns the hook handles (``remove()`` each).
    """
    awaiting: set[str] = set()
    handles: list[Any] = []
    for param, name in param_names.items():
        handles.append(param.register_post_accumulate_grad_hook(_gradient_done(name, awaiting)))
    for model in models:
        for prefix, module in model.named_modules():
            names = [
                f"{prefix}.{n}" if prefix else n
                for n, p in module.named_parameters(recurse=False)
                if p in param_names
            ]
            if not names:
                continue
            handles.append(module.register_forward_pre_hook(_forward_started(names)))
            handles.append(module.register_forward_hook(_forward_done(names, awaiting)))
    return handles


def _forward_started(names: list[str]) -> Any:
    def hook(module: nn.Module, inputs: Any) -> None:
        for name in names:
            timeline.start_activity(name, "FORWARD")

    return hook


def _forward_done(names: list[str], awaiting: set[str]) -> Any:
    def hook(module: nn.Module, inputs: Any, output: Any) -> None:
        for name in names:
            timeline.end_activity(name)
            if torch.is_grad_enabled() and name not in awaiting:
                awaiting.add(name)
                timeline.start_activity(name, "GRADIENT COMPT.")

    return hook


def _gradient_done(name: str, awaiting: set[str]) -> Any:
    def hook(param: torch.Tensor) -> None:
        if name in awaiting:
            awaiting.discard(name)
            timeline.end_activity(name)

    return hook
