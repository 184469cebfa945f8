"""Patterns over all ranks: the global average, and no communication at all."""

from __future__ import annotations

import torch

from gossamer import ops, transport
from gossamer.communicators.base import Communicator, Pending, PostedState

__all__ = ["Allreduce", "NoCommunication"]


class Allreduce(Communicator):
    r"""Every round is the global average :math:`\bar x = \frac1n \sum_i x_i`.

    On gloo, float32 and float64 host buckets are averaged by allreduces posted from the
    caller's thread (:func:`gossamer.transport.post_allreduce`): the layout of each bucket
    is checked across ranks in its first round, later rounds post without a call header.
    Other buckets go through :func:`gossamer.ops.allreduce`.

    Args:
        in_place (bool): a round may overwrite the tensor it is given with the average
            while it is in flight (the optimizer's own fusion buffer of gradients), saving
            a copy of every bucket. Refused by AWC and ATC, whose buckets hold the
            parameters themselves.
        global_average_every: as :class:`Communicator`'s.
    """

    name = "allreduce"

    def __init__(self, *, in_place: bool = False, global_average_every: int | None = None):
        super().__init__(global_average_every=global_average_every)
        if not isinstance(in_place, bool):
            raise TypeError(f"in_place must be a bool; got {in_place!r}")
        self.in_place = in_place
        self._posted = PostedState()  # slot 0: the copy posted when not in place

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        if not transport.can_post(flat):
            return ops.allreduce(flat, async_op=True)
        if not self.in_place:
            flat = self._posted.buffer(index, 0, flat.numel(), flat.dtype).copy_(flat)
        check = self._posted.needs_check(index, (flat.dtype, flat.numel()))
        return transport.post_allreduce("allreduce", flat, check=check)


class NoCommunication(Communicator):
    """Rounds do nothing: every rank trains alone.

    With ``global_average_every=K`` it is local SGD with a global average every K rounds.
    """

    name = "none"

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        return None
