"""Posting a window operation's requests and completing it when every answer is in.

Requests of one rank are posted in call order from one client thread. Without a mutex they
are all in flight at once (and later operations may be posted before they complete); with
``require_mutex`` each takes its peer's mutex first, one at a time.
"""

from __future__ import annotations

import concurrent.futures
import functools
import threading
from collections.abc import Callable

from gossamer import context
from gossamer.errors import CommunicationTimeout, PeerArgumentError, PeerError, RankLostError
from gossamer.transport import (
    Handle,
    find_lost,
    get_liveness,
    get_membership,
    known_dead,
    lost_error,
)
from gossamer.windows.locks import remote_locks
from gossamer.windows.registry import registry
from gossamer.windows.service import WindowState

__all__ = ["issue"]


def named(what: str, err: BaseException, peer: int | None = None) -> BaseException:
    """``err``, or :class:`RankLostError` naming the dead ranks if a death explains it.

    A peer's death shows in a window operation as a refused connection, a failed window
    service or a timeout; the heartbeats tell which rank died. With ``peer`` (the rank whose
    request failed), only that rank's death explains it: an earlier death, which an elastic
    job has already dropped, does not.
    """
    if not isinstance(err, PeerError | CommunicationTimeout) or isinstance(
        err, RankLostError | PeerArgumentError
    ):
        return err
    lost = find_lost(peer=peer)
    if not lost or (peer is not None and peer not in lost):
        return err
    found = lost_error(what, lost)
    found.__cause__ = err
    return found


def _settle(done: concurrent.futures.Future, error: BaseException | None = None) -> None:
    """Complete ``done`` unless the loss watchdog already failed it."""
    try:
        if error is None:
            done.set_result(None)
        else:
            done.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass


def _when_all(
    what: str, posted: list, finish, done: concurrent.futures.Future, elastic: bool = False
) -> None:
    """Complete ``done`` (after ``finish``) once every posted request is answered.

    ``elastic``: a request whose peer was lost counts as answered (it is dropped).
    """
    left = [len(posted)]
    keep = [sends for _, _, sends in posted]  # the send buffers must outlive the sends
    lock = threading.Lock()  # callbacks run on the progress thread or, if done, right here

    def complete() -> None:
        keep.clear()
        try:
            finish()
            _settle(done)
        except BaseException as err:
            _settle(done, err)

    def answered(peer: int, future: concurrent.futures.Future) -> None:
        error = future.exception()
        if error is not None and elastic and _lost_peer(peer, error):
            error = None
        with lock:
            if done.done():
                return
            if error is not None:
                _settle(done, named(what, error, peer))
                return
            left[0] -= 1
            last = left[0] == 0
        if last:
            complete()

    if not posted:  # every peer was found dead while posting
        complete()
    for peer, future, _ in posted:
        future.add_done_callback(functools.partial(answered, peer))


def _lost_peer(peer: int, error: BaseException) -> bool:
    """Whether ``error`` of a request to ``peer`` is ``peer``'s death (then reported)."""
    if isinstance(error, RankLostError):
        lost = set(error.ranks)
    elif isinstance(error, PeerError | CommunicationTimeout):
        lost = find_lost(peer=peer)
    else:
        return False
    if peer not in lost:
        return False
    get_membership().report({peer})
    return True


def _post_all(svc, state: WindowState, requests: list, elastic: bool) -> list:
    """Post the requests at once; ``elastic``: a peer found dead on the way is dropped."""
    posted = []
    for peer, kind, payload, value, codec in requests:
        try:
            future, sends = svc.request(
                kind, peer, state.wid, payload=payload, value=value, codec=codec
            )
        except PeerError as err:
            if elastic and _lost_peer(peer, err):
                continue
            raise
        if elastic:  # watched one by one: only this peer's loss fails it
            registry().watch(f"window request to rank {peer}", future, peers={peer})
        posted.append((peer, future, sends))
    return posted


def issue(
    state: WindowState,
    what: str,
    requests: list,
    require_mutex: bool,
    finish: Callable[[], None],
    async_op: bool,
) -> Handle | None:
    """Send ``requests`` ``(peer, kind, payload, value[, codec])``; ``finish`` once all land.

    On an elastic window (without ``require_mutex``) requests to dead peers are not sent,
    and a peer that dies before answering is dropped from the operation instead of failing
    it (the death is reported to the membership).
    """
    done: concurrent.futures.Future = concurrent.futures.Future()
    windows = registry()
    requests = [(*r, 0) if len(r) == 4 else r for r in requests]
    elastic = state.elastic and not require_mutex and context.size() > 1
    live = get_liveness() if context.size() > 1 else None
    if elastic:
        dead = known_dead()
        requests = [r for r in requests if r[0] not in dead]
    elif live is not None and live.lost:  # the job is broken: fail at once
        raise lost_error(what, live.lost)

    def post() -> None:
        svc = windows.service
        try:
            if svc is None or not requests:
                finish()
                _settle(done)
            elif require_mutex:
                for peer, kind, payload, value, codec in requests:
                    with remote_locks(svc, state, [peer]):
                        future, sends = svc.request(
                            kind, peer, state.wid, payload=payload, value=value, codec=codec
                        )
                        svc.wait(what, peer, future, sends)
                finish()
                _settle(done)
            else:
                posted = _post_all(svc, state, requests, elastic)
                _when_all(what, posted, finish, done, elastic)
        except BaseException as err:  # handed to the caller through the handle
            _settle(done, named(what, err))

    if context.size() == 1:
        post()
    else:
        if not elastic:  # an elastic operation's requests are watched one by one
            windows.watch(what, done)
        windows.client().submit(post)
    handle = Handle(done, what, context.timeout())
    return handle if async_op else handle.wait()
