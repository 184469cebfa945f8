"""Bucket allreduces and exchanges posted from the caller's thread, on gloo groups of their own.

The communication thread (:mod:`~gossamer.transport.engine`) keeps program order by running
every operation itself, with a call header before each. For the buckets of a backward pass
that costs what overlap is meant to save: each bucket waits for the previous one's header
round trip and transfer, and the thread competes with the backward pass for the
interpreter. A bucket allreduce whose layout was checked once is therefore *posted*
instead: ``dist.all_reduce(..., async_op=True)`` straight from the backward hook, on a
group that only posted allreduces use, so their order is the caller's and cannot interleave
with the communication thread's. gloo's own threads move the bytes (torch DDP's reducer
does the same). The *wait* runs on the communication thread, under its stall watchdog, and
translates gloo's errors like every other wait
(:func:`~gossamer.transport.failures.wait_works`): a dead rank, even one this rank does not
talk to, fails it with :class:`~gossamer.errors.RankLostError` within seconds.

Neighbour rounds of a fixed bucket are posted the same way (:func:`post_exchange`): after
the first round's check, each round posts its chunked receives and sends at once, with the
bucket's index in the tags, so that rounds of different buckets cannot match each other.
On more than one machine the two directions of a pair travel on two groups, as in
:mod:`~gossamer.transport.p2p`.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.profiling import count_collective, count_sent, timeline
from gossamer.transport import staging
from gossamer.transport.engine import submit
from gossamer.transport.failures import is_backend_error, lost_error, translate, wait_works
from gossamer.transport.handle import Handle
from gossamer.transport.liveness import get_liveness
from gossamer.transport.p2p import MAX_CHUNKS, check_same_call, post_chunks
from gossamer.transport.payload import as_bytes

__all__ = [
    "Posted",
    "PostedExchange",
    "can_post",
    "post_allreduce",
    "post_exchange",
    "post_exchange_works",
]

_FLOATS = (torch.float32, torch.float64)  # summed by gloo as they are (no widening)


def _new_group(name: str) -> dist.ProcessGroup:
    """A gloo group over the world, ``name``'d on the runtime; created, collectively, once."""
    timeout = timedelta(seconds=context.timeout())
    return context.runtime().component(
        name, lambda: dist.new_group(backend="gloo", timeout=timeout)
    )


def _group() -> dist.ProcessGroup:
    """The group of posted allreduces, and of posted exchanges from lower to higher rank."""
    return _new_group("posted_group")


def _reverse_group() -> dist.ProcessGroup | None:
    """The second group of posted exchanges (higher to lower rank); None on one machine."""
    return None if context.reverse_group() is None else _new_group("posted_reverse_group")


def can_post(tensor: torch.Tensor) -> bool:
    """Whether :func:`post_allreduce` takes ``tensor``: gloo, a host float32/64 tensor."""
    return (
        context.backend() == "gloo"
        and context.size() > 1
        and not staging.needs_staging(tensor)  # a device tensor takes the staged path
        and tensor.dtype in _FLOATS
        and tensor.is_contiguous()
    )


def _waiter(op: str, works: list, end_span: Callable[[], None]) -> Handle:
    """Queue the wait for posted work on the communication thread, at once.

    The thread blocks in gloo (without the interpreter lock) while the caller computes,
    and its stall watchdog fails the wait when any rank died, also one this rank does not
    talk to (its neighbours stopped, so what they would send never comes); a wait on the
    caller's thread would last until gloo's deadline. The timeline's span ends here, when
    the work completed (gloo's point-to-point work has no completion callback).
    """

    def wait() -> None:
        wait_works(op, works)
        end_span()

    return submit(op, wait)


class Posted:
    """A posted allreduce in flight; :meth:`wait` returns the averaged tensor."""

    def __init__(self, waiter: Handle, tensor: torch.Tensor, size: int) -> None:
        self._waiter: Handle | None = waiter
        self._tensor, self._size = tensor, size

    def wait(self) -> torch.Tensor:
        """Wait for gloo; divide the sum by the world size (once)."""
        if self._waiter is not None:
            waiter, self._waiter = self._waiter, None
            waiter.wait()
            self._tensor.div_(self._size)
        return self._tensor


def _posting(op: str, live, post: Callable[[], Any]) -> Any:
    """``post()``, with gloo's error (raised at once on a broken connection) translated."""
    try:
        return post()
    except RuntimeError as err:
        if not is_backend_error(err):
            raise
        raise translate(op, -1, err, live) from err


def _check(op: str, tensor: torch.Tensor, **fields: int) -> None:
    """Check that every rank makes this call, on the world group in program order.

    Not on the posted group: a rank whose call goes through the communication thread
    instead (another communicator, a compressed one) checks there, and the posted group is
    made on first use, collectively, which such a rank never does. Either way the ranks
    would wait for each other until the deadline instead of raising.
    """
    submit(op, lambda: check_same_call(op, tensor, None, **fields)).wait()


def _check_live(op: str):
    live = get_liveness()
    if live is not None and live.lost:
        raise lost_error(op, live.lost)
    return live


def post_allreduce(op: str, tensor: torch.Tensor, *, check: bool) -> Posted:
    r"""Start averaging ``tensor`` in place over the world: :math:`x \leftarrow \frac1n\sum_r x_r`.

    ``tensor`` must pass :func:`can_post`, and every rank must post the same sequence of
    tensors (same dtype and size at each position). ``check``: first make sure of that with
    a call header (blocking); callers check once per layout, then post without.

    Raises:
        PeerError: ``check`` found that ranks posted different tensors.
        RankLostError: a rank was lost earlier.
    """
    live = _check_live(op)
    if check:
        _check(op, tensor)
    group = _group()
    end_span = timeline.begin(op, "communicating")
    work = _posting(op, live, lambda: dist.all_reduce(tensor, group=group, async_op=True))
    size = dist.get_world_size(group)
    count_collective(op, "all_reduce", tensor.nbytes, size)
    return Posted(_waiter(op, [(-1, work)], end_span), tensor, size)


class PostedExchange:
    """A posted exchange in flight; :meth:`wait` returns the received tensors by source."""

    def __init__(self, waiter: Handle, received: dict[int, torch.Tensor]) -> None:
        self._waiter, self._received = waiter, received

    def wait(self) -> dict[int, torch.Tensor]:
        """Wait for every send and receive of the round."""
        self._waiter.wait()
        return self._received


def post_exchange(
    op: str,
    tensor: torch.Tensor,
    sends: dict[int, torch.Tensor],
    receives: dict[int, torch.Tensor],
    *,
    key: int,
    check: bool,
    codec: int = 0,
) -> PostedExchange:
    """Start sending ``sends[d]`` to every ``d`` and receiving into ``receives[s]``.

    Every tensor must be laid out like ``tensor`` (which :func:`can_post` takes), sends
    and receives must not change until :meth:`PostedExchange.wait` returned, and every
    peer must post the same ``key`` (a bucket index) for the same round. ``check``: first
    check, with a call header over every rank (blocking), that all ranks post ``tensor``'s
    dtype and size under ``key`` and the same ``codec`` (a compressor's id, for compressed
    payloads); callers check once per bucket, then post without.

    Raises:
        PeerError: ``check`` found that ranks posted different tensors.
        RankLostError: a rank was lost earlier.
    """
    works = post_exchange_works(op, tensor, sends, receives, key=key, check=check, codec=codec)
    return PostedExchange(_waiter(op, works, timeline.begin(op, "communicating")), receives)


def post_exchange_works(
    op: str,
    tensor: torch.Tensor,
    sends: dict[int, torch.Tensor],
    receives: dict[int, torch.Tensor],
    *,
    key: int,
    check: bool,
    codec: int = 0,
) -> list[tuple[int, dist.Work]]:
    """:func:`post_exchange` for a job of the communication thread: the posted work.

    The job waits for it itself (:func:`~gossamer.transport.failures.wait_works`, under the
    thread's stall watchdog), so it can post several exchanges before waiting for the
    first, and work on each as it completes.
    """
    live = _check_live(op)
    if check:
        _check(op, tensor, aux=key, codec=codec)
    group, reverse = _group(), _reverse_group()
    sent = [(d, as_bytes(t)) for d, t in sends.items()]
    received = [(s, as_bytes(t)) for s, t in receives.items()]
    works = _posting(
        op, live, lambda: post_chunks(sent, received, group, key * MAX_CHUNKS, reverse=reverse)
    )
    count_sent(op, sum(t.nbytes for _, t in sent))
    return works
