"""Allreduces posted from the caller's thread, on a gloo group of their own.

The communication thread (:mod:`~gossamer.transport.engine`) keeps program order by running
every operation itself, with a call header before each. For the buckets of a backward pass
that costs what overlap is meant to save: each bucket waits for the previous one's header
round trip and transfer, and the thread competes with the backward pass for the
interpreter. A bucket allreduce whose layout was checked once is therefore *posted*
instead: ``dist.all_reduce(..., async_op=True)`` straight from the backward hook, on a
group that only posted allreduces use, so their order is the caller's and cannot interleave
with the communication thread's. gloo's own threads move the bytes (torch DDP's reducer
does the same). The wait translates gloo's errors like every other wait
(:func:`~gossamer.transport.failures.wait_works`); a rank that dies closes its connections,
so the wait fails with :class:`~gossamer.errors.RankLostError` rather than hanging.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.profiling import count_collective, timeline
from gossamer.transport.failures import is_backend_error, lost_error, translate, wait_works
from gossamer.transport.liveness import get_liveness
from gossamer.transport.p2p import check_same_call

__all__ = ["Posted", "can_post", "post_allreduce"]

_FLOATS = (torch.float32, torch.float64)  # summed by gloo as they are (no widening)


def _group() -> dist.ProcessGroup:
    """The world group of posted allreduces; created, collectively, on first use."""
    timeout = timedelta(seconds=context.timeout())
    return context.runtime().component(
        "posted_group", lambda: dist.new_group(backend="gloo", timeout=timeout)
    )


def can_post(tensor: torch.Tensor) -> bool:
    """Whether :func:`post_allreduce` takes ``tensor``: gloo, a host float32/64 tensor."""
    return (
        context.backend() == "gloo"
        and context.size() > 1
        and tensor.device.type == "cpu"
        and tensor.dtype in _FLOATS
        and tensor.is_contiguous()
    )


class Posted:
    """A posted allreduce in flight; :meth:`wait` returns the averaged tensor."""

    def __init__(self, op: str, work: dist.Work, tensor: torch.Tensor, size: int) -> None:
        self._op, self._work, self._tensor, self._size = op, work, tensor, size

    def wait(self) -> torch.Tensor:
        """Wait for gloo; divide the sum by the world size (once)."""
        if self._work is not None:
            work, self._work = self._work, None
            wait_works(self._op, [(-1, work)])
            self._tensor.div_(self._size)
        return self._tensor


def post_allreduce(op: str, tensor: torch.Tensor, *, check: bool) -> Posted:
    r"""Start averaging ``tensor`` in place over the world: :math:`x \leftarrow \frac1n\sum_r x_r`.

    ``tensor`` must pass :func:`can_post`, and every rank must post the same sequence of
    tensors (same dtype and size at each position). ``check``: first make sure of that with
    a call header (blocking); callers check once per layout, then post without.

    Raises:
        PeerError: ``check`` found that ranks posted different tensors.
        RankLostError: a rank was lost earlier.
    """
    live = get_liveness()
    if live is not None and live.lost:
        raise lost_error(op, live.lost)
    group = _group()
    if check:
        check_same_call(op, tensor, group)
    end_span = timeline.begin(op, "communicating")
    try:
        work = dist.all_reduce(tensor, group=group, async_op=True)
    except RuntimeError as err:  # gloo raises at once when a connection already broke
        if not is_backend_error(err):
            raise
        raise translate(op, -1, err, live) from err
    if timeline.timeline_enabled():  # the span ends when gloo completes the work
        work.get_future().then(lambda _: end_span())
    size = dist.get_world_size(group)
    count_collective(op, "all_reduce", tensor.nbytes, size)
    return Posted(op, work, tensor, size)
