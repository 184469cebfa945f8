"""BlueFog's one-sided window operations: windows looked up by name, integer handles.

Each window is a :class:`gossamer.Window` kept under its name. The window captures the
default topology when it is created, so ``win_update`` with no weights mixes as the topology
was set (``is_weighted`` or uniform). The global push-sum switch
(:func:`turn_on_win_ops_with_associated_p`) sets :attr:`gossamer.Window.push_sum` on every
window made here, existing and future.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Mapping, Sequence

import torch

import gossamer
from gossamer.bluefog._compat import check_weight_types, plain_ranks, plain_weights
from gossamer.bluefog._state import state
from gossamer.bluefog.timeline import recorded
from gossamer.transport import Handle

__all__ = [
    "get_current_created_window_names",
    "get_win_version",
    "neighbor_win_accumulate",
    "neighbor_win_accumulate_nonblocking",
    "neighbor_win_get",
    "neighbor_win_get_nonblocking",
    "neighbor_win_put",
    "neighbor_win_put_nonblocking",
    "turn_off_win_ops_with_associated_p",
    "turn_on_win_ops_with_associated_p",
    "win_accumulate",
    "win_accumulate_nonblocking",
    "win_associated_p",
    "win_create",
    "win_free",
    "win_get",
    "win_get_nonblocking",
    "win_mutex",
    "win_poll",
    "win_put",
    "win_put_nonblocking",
    "win_update",
    "win_update_then_collect",
    "win_wait",
]

logger = logging.getLogger(__name__)


def _window(name: str) -> gossamer.Window:
    window = state().windows.get(name)
    if window is None:
        raise ValueError(
            f"no window named {name!r}; created windows: {get_current_created_window_names()}"
        )
    return window


# ---------------------------------------------------------------------- lifecycle
@recorded(None, "WIN_CREATE")
def win_create(tensor: torch.Tensor, name: str, zero_init: bool = False) -> bool:
    """Register ``tensor`` (the object itself) as this rank's window ``name``. Collective.

    The buffers for the in-neighbours start as copies of ``tensor``, or zeros with
    ``zero_init`` (:meth:`gossamer.Window.create`).

    Returns:
        bool: True, or False (with a warning logged) when ``name`` is already in use.

    Raises:
        TypeError: ``tensor`` is not a dense tensor of a dtype gossamer sends (every
            floating, integer and bool dtype; BlueFog took float32, float64, int32 and
            int64 only), or ``name`` not a str.
    """
    if name in state().windows or name in gossamer.live_windows():
        logger.warning("win_create: a window named %r already exists", name)
        return False
    window = gossamer.Window.create(
        tensor, zero_init=zero_init, name=name, push_sum=state().push_sum
    )
    state().windows[name] = window
    return True


def win_free(name: str | None = None) -> bool:
    """Free window ``name``, or every window made by :func:`win_create` when None. Collective.

    Returns:
        bool: True, or False (with an error logged) when there is no window ``name``.
    """
    if name is None:
        windows = state().windows
        for each in sorted(windows):
            windows.pop(each).free()
        return True
    if name not in state().windows:
        logger.error("win_free: no window named %r", name)
        return False
    state().windows.pop(name).free()
    return True


def get_current_created_window_names() -> list[str]:
    """Names of the windows made by :func:`win_create`, sorted."""
    return sorted(state().windows)


# ---------------------------------------------------------------------- update
def win_update(
    name: str,
    self_weight: float | None = None,
    neighbor_weights: Mapping[int, float] | None = None,
    reset: bool = False,
    clone: bool = False,
    require_mutex: bool = False,
) -> torch.Tensor:
    r"""Combine the registered tensor with the buffers (:meth:`gossamer.Window.update`).

    :math:`x \leftarrow a x + \sum_s w_s\, b[s]`, in place unless ``clone``. With no weights:
    the topology's edge weights if set with ``is_weighted=True``, else
    ``(x + sum_s b[s]) / (indegree+1)``. ``reset`` zeroes the buffers used; versions are
    cleared.

    Raises:
        ValueError: only one of the weights, weights of the wrong kind, keys that are not
            in-neighbours, or an unknown window.
    """
    weights = plain_weights(neighbor_weights)
    self_weight = check_weight_types(self_weight, weights, "neighbor_weights")
    if (self_weight is None) != (weights is None):
        raise ValueError(
            "win_update: self_weight and neighbor_weights must be given together; got "
            f"self_weight={self_weight!r}, neighbor_weights={neighbor_weights!r}"
        )
    return _window(name).update(
        self_weight=self_weight,
        src_weights=weights,
        reset=reset,
        clone=clone,
        require_mutex=require_mutex,
    )


def win_update_then_collect(name: str, require_mutex: bool = True) -> torch.Tensor:
    """``x <- x + sum_s b[s]``, then zero the buffers (``Window.update_then_collect``)."""
    return _window(name).update_then_collect(require_mutex=require_mutex)


# ---------------------------------------------------------------------- put, get, accumulate
def _window_handle(hid: int) -> Handle | None:
    return state().window_handles.get(hid)


def _start(handle: Handle) -> int:
    table = state()
    hid = next(table.window_ids)
    table.window_handles[hid] = handle
    return hid


def _write(
    kind: str,
    tensor: torch.Tensor,
    name: str,
    self_weight: float | None,
    dst_weights: object,
    require_mutex: bool,
) -> Handle:
    weights = plain_weights(dst_weights)
    self_weight = check_weight_types(self_weight, weights, "dst_weights")
    method = getattr(_window(name), kind)
    return method(
        tensor,
        self_weight=self_weight,
        dst_weights=weights,
        require_mutex=require_mutex,
        async_op=True,
    )


@recorded(None, "ENQUEUE_WIN_PUT", _window_handle)
def win_put_nonblocking(
    tensor: torch.Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> int:
    r"""Start writing ``w_d * tensor`` into this rank's slot at each destination ``d``.

    Afterwards ``tensor *= self_weight`` (:meth:`gossamer.Window.put`). ``dst_weights``
    keys must be out-neighbours (default: all, weight 1). Returns a handle for
    :func:`win_wait`.
    """
    return _start(_write("put", tensor, name, self_weight, dst_weights, require_mutex))


def win_put(
    tensor: torch.Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Blocking :func:`win_put_nonblocking`; returns True."""
    return win_wait(win_put_nonblocking(tensor, name, self_weight, dst_weights, require_mutex))


@recorded(None, "ENQUEUE_WIN_ACCUMULATE", _window_handle)
def win_accumulate_nonblocking(
    tensor: torch.Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> int:
    """Like :func:`win_put_nonblocking`, but adds into the slots (``Window.accumulate``)."""
    return _start(_write("accumulate", tensor, name, self_weight, dst_weights, require_mutex))


def win_accumulate(
    tensor: torch.Tensor,
    name: str,
    self_weight: float | None = None,
    dst_weights: Mapping[int, float] | None = None,
    require_mutex: bool = False,
) -> bool:
    """Blocking :func:`win_accumulate_nonblocking`; returns True."""
    return win_wait(
        win_accumulate_nonblocking(tensor, name, self_weight, dst_weights, require_mutex)
    )


@recorded(None, "ENQUEUE_WIN_GET", _window_handle)
def win_get_nonblocking(
    name: str, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> int:
    """Start fetching each source's current tensor into its buffer, scaled by its weight.

    ``src_weights`` keys must be in-neighbours (default: all, weight 1)
    (:meth:`gossamer.Window.get`). Returns a handle for :func:`win_wait`.
    """
    weights = plain_weights(src_weights)
    check_weight_types(None, weights, "src_weights")
    return _start(
        _window(name).get(src_weights=weights, require_mutex=require_mutex, async_op=True)
    )


def win_get(
    name: str, src_weights: Mapping[int, float] | None = None, require_mutex: bool = False
) -> bool:
    """Blocking :func:`win_get_nonblocking`; returns True."""
    return win_wait(win_get_nonblocking(name, src_weights, require_mutex))


neighbor_win_put = win_put
neighbor_win_put_nonblocking = win_put_nonblocking
neighbor_win_accumulate = win_accumulate
neighbor_win_accumulate_nonblocking = win_accumulate_nonblocking
neighbor_win_get = win_get
neighbor_win_get_nonblocking = win_get_nonblocking


def win_poll(handle: int) -> bool:
    """True once the window operation ``handle`` has finished; never blocks.

    Raises:
        ValueError: ``handle`` is unknown (or already waited for).
    """
    if handle not in state().window_handles:
        raise ValueError(f"Cannot find window handle {handle!r} to poll")
    return state().window_handles[handle].is_completed()


def win_wait(handle: int) -> bool:
    """Wait for the window operation ``handle``; True once done.

    An unknown handle logs a warning and returns False. The operation's error is raised.
    """
    if handle not in state().window_handles:
        logger.warning("win_wait: handle %r is not found (already waited for?)", handle)
        return False
    state().window_handles.pop(handle).wait()
    return True


# ---------------------------------------------------------------------- mutex, versions, p
def win_mutex(
    name: str, for_self: bool = False, ranks: Sequence[int] | None = None
) -> contextlib.AbstractContextManager[None]:
    """Hold window ``name``'s distributed mutexes (:meth:`gossamer.Window.mutex`).

    By default this rank's slot at each rank of ``ranks`` (default: the out-neighbours),
    which puts with ``require_mutex`` take; ``for_self`` takes this rank's own slots of
    ``ranks``, which ``win_update(require_mutex=True)`` takes.
    """
    return _window(name).mutex(plain_ranks(ranks), for_self=for_self)


def get_win_version(name: str) -> dict[int, int]:
    """``{in-neighbour: puts and gets from it since the last win_update}``."""
    return _window(name).versions()


def win_associated_p(name: str) -> float:
    """This rank's push-sum weight ``p`` of window ``name`` (starts at 1.0)."""
    return _window(name).p


def turn_on_win_ops_with_associated_p() -> None:
    """Make put, accumulate and update carry ``p`` on every window, existing and new."""
    state().push_sum = True
    for window in state().windows.values():
        window.push_sum = True


def turn_off_win_ops_with_associated_p() -> None:
    """Stop carrying ``p`` (the default)."""
    state().push_sum = False
    for window in state().windows.values():
        window.push_sum = False
