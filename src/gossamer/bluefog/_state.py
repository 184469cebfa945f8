"""The facade's process-wide state (BlueFog's globals), held on gossamer's runtime.

BlueFog keeps a global topology, a table of integer handles, named windows and a push-sum
switch. Here they are one object, a component of :func:`gossamer.context.runtime`, so
``shutdown`` drops them with everything else.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from gossamer import context

__all__ = ["FacadeState", "state"]


@dataclass
class FacadeState:
    """BlueFog's globals for one runtime."""

    views: dict[str, Any] = field(default_factory=dict)  # "world" / "machine" -> graph view
    skip_negotiate_stage: bool = False
    handles: dict[int, tuple[Any, Any]] = field(default_factory=dict)  # id -> (Handle, finish)
    handle_ids: itertools.count = field(default_factory=itertools.count)
    windows: dict[str, Any] = field(default_factory=dict)  # name -> gossamer.Window
    window_handles: dict[int, Any] = field(default_factory=dict)
    window_ids: itertools.count = field(default_factory=itertools.count)
    push_sum: bool = False
    # Whether bf.init has honoured BLUEFOG_TIMELINE in this runtime: BlueFog opens its
    # timeline once, at the first init, though programs call bf.init() many times.
    timeline_checked: bool = False


def state() -> FacadeState:
    """The facade's state in this runtime (raises ``NotInitializedError`` before init)."""
    return context.runtime().component("bluefog", FacadeState)
