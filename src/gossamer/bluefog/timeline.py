"""BlueFog's user timeline activities, on :mod:`gossamer.profiling.timeline`.

BlueFog writes the timeline when ``BLUEFOG_TIMELINE`` (``bfrun --timeline-filename``) names a
file prefix. gossamer's timeline is started by ``GOSSAMER_TIMELINE=<prefix>`` (read by
``gossamer.init``, hence by ``bf.init``) or by :func:`gossamer.profiling.start_timeline`.
An activity is a span on the row named ``tensor_name`` of this rank's trace.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from gossamer.profiling import timeline

__all__ = [
    "parameter_activities",
    "timeline_context",
    "timeline_end_activity",
    "timeline_start_activity",
]

logger = logging.getLogger(__name__)

_complained = [False]


def _on() -> bool:
    """Whether the timeline records; logs an error the first time it does not (as BlueFog)."""
    if timeline.timeline_enabled():
        return True
    if not _complained[0]:
        _complained[0] = True
        logger.error(
            "The timeline is not on, so timeline activities are not recorded. Set "
            "GOSSAMER_TIMELINE=<file prefix> before bf.init() (BlueFog's BLUEFOG_TIMELINE) "
            "or call gossamer.profiling.start_timeline()."
        )
    return False


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
