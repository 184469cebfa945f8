"""The table of BlueFog's integer handles: each maps to a gossamer Handle and a finisher."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gossamer.bluefog._state import state
from gossamer.transport import Handle

__all__ = ["lookup", "register", "take"]


def _same(result: Any) -> Any:
    return result


def register(started: Handle | tuple[Handle, Callable[[Any], Any]]) -> int:
    """A new integer handle for ``started``: a Handle, or a Handle and its finisher."""
    handle, finish = started if isinstance(started, tuple) else (started, _same)
    table = state()
    hid = next(table.handle_ids)
    # handle id -> (core handle, what turns its result into BlueFog's return value)
    table.handles[hid] = (handle, finish)
    return hid


def lookup(hid: int) -> Handle | None:
    """The Handle behind ``hid``, or None."""
    entry = state().handles.get(hid)
    return None if entry is None else entry[0]


def take(hid: int) -> Callable[[], Any] | None:
    """Forget ``hid``; return what waits for its result (None for an unknown handle)."""
    entry = state().handles.pop(hid, None)
    if entry is None:
        return None
    handle, finish = entry
    return lambda: finish(handle.wait())
