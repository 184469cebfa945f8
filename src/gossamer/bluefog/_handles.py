"""The table of BlueFog's integer handles: each maps to a gossamer Handle and a finisher."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

from gossamer import context
from gossamer.ops.handle import Handle

__all__ = ["lookup", "register", "take"]

_ids = itertools.count()
# handle id -> (core handle, what turns its result into BlueFog's return value)
_handles: dict[int, tuple[Handle, Callable[[Any], Any]]] = {}


def _drop_handles() -> None:
    _handles.clear()


context.on_shutdown(_drop_handles)


def _same(result: Any) -> Any:
    return result


def register(started: Handle | tuple[Handle, Callable[[Any], Any]]) -> int:
    """A new integer handle for ``started``: a Handle, or a Handle and its finisher."""
    handle, finish = started if isinstance(started, tuple) else (started, _same)
    hid = next(_ids)
    _handles[hid] = (handle, finish)
    return hid


def lookup(hid: int) -> Handle | None:
    """The Handle behind ``hid``, or None."""
    entry = _handles.get(hid)
    return None if entry is None else entry[0]


def take(hid: int) -> Callable[[], Any] | None:
    """Forget ``hid``; return what waits for its result (None for an unknown handle)."""
    entry = _handles.pop(hid, None)
    if entry is None:
        return None
    handle, finish = entry
    return lambda: finish(handle.wait())
