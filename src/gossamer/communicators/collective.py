"""Patterns over all ranks: the global average, and no communication at all."""

from __future__ import annotations

import torch

from gossamer import ops
from gossamer.communicators.base import Communicator, Pending

__all__ = ["Allreduce", "NoCommunication"]


class Allreduce(Communicator):
    r"""Every round is the global average :math:`\bar x = \frac1n \sum_i x_i`."""

    name = "allreduce"

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        return ops.allreduce(flat, async_op=True)


class NoCommunication(Communicator):
    """Rounds do nothing: every rank trains alone.

    With ``global_average_every=K`` it is local SGD with a global average every K rounds.
    """

    name = "none"

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        return None
