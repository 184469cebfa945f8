"""Posting a window operation's requests and completing it when every answer is in.

Requests of one rank are posted in call order from one client thread. Without a mutex they
are all in flight at once (and later operations may be posted before they complete); with
``require_mutex`` each takes its peer's mutex first, one at a time.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable

from gossamer import context
from gossamer.transport import Handle
from gossamer.windows.locks import remote_locks
from gossamer.windows.registry import registry
from gossamer.windows.service import WindowState

__all__ = ["issue"]


def _when_all(posted: list, finish, done: concurrent.futures.Future) -> None:
    """Complete ``done`` (after ``finish``) once every posted request is answered."""
    left = [len(posted)]
    keep = [sends for _, sends in posted]  # the send buffers must outlive the sends
    lock = threading.Lock()  # callbacks run on the progress thread or, if done, right here

    def one(future: concurrent.futures.Future) -> None:
        error = future.exception()
        with lock:
            if done.done():
                return
            if error is not None:
                done.set_exception(error)
                return
            left[0] -= 1
            last = left[0] == 0
        if last:
            keep.clear()
            try:
                finish()
                done.set_result(None)
            except BaseException as err:
                done.set_exception(err)

    for future, _ in posted:
        future.add_done_callback(one)


def issue(
    state: WindowState,
    what: str,
    requests: list,
    require_mutex: bool,
    finish: Callable[[], None],
    async_op: bool,
) -> Handle | None:
    """Send ``requests`` ``(peer, kind, payload, value[, codec])``; ``finish`` once all land."""
    done: concurrent.futures.Future = concurrent.futures.Future()
    windows = registry()
    requests = [(*r, 0) if len(r) == 4 else r for r in requests]

    def post() -> None:
        svc = windows.service
        try:
            if svc is None or not requests:
                finish()
                done.set_result(None)
            elif require_mutex:
                for peer, kind, payload, value, codec in requests:
                    with remote_locks(svc, state, [peer]):
                        future, sends = svc.request(
                            kind, peer, state.wid, payload=payload, value=value, codec=codec
                        )
                        svc.wait(what, peer, future, sends)
                finish()
                done.set_result(None)
            else:
                posted = [
                    svc.request(kind, peer, state.wid, payload=payload, value=value, codec=codec)
                    for peer, kind, payload, value, codec in requests
                ]
                _when_all(posted, finish, done)
        except BaseException as err:  # handed to the caller through the handle
            done.set_exception(err)

    if context.size() == 1:
        post()
    else:
        windows.client().submit(post)
    handle = Handle(done, what, context.timeout())
    return handle if async_op else handle.wait()
