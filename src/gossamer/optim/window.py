r"""Asynchronous optimizers over one-sided windows: no rank ever waits for another's compute.

- :class:`WindowPut` (BlueFog's win-put): before the forward pass each rank puts its
  parameters into its out-neighbours' windows; :meth:`step` combines whatever has arrived
  (:math:`x \leftarrow w_{ii} x + \sum_j w_{ji} b_j`) and then takes the local step. It is
  adapt-with-combine over :class:`~gossamer.communicators.WindowPutGossip`.
- :class:`PushSum` (stochastic gradient push; Assran et al., 2019): each rank steps on
  :math:`z_i = x_i / p_i`, then pushes shares of :math:`(x_i, p_i)` to its out-neighbours and
  adds what it received (:class:`~gossamer.communicators.PushSumGossip`), also on directed
  graphs.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gossamer import context
from gossamer.communicators import PushSumGossip, WindowPutGossip
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.optim.combine import AdaptWithCombine
from gossamer.topology import Step, Topology

__all__ = ["PushSum", "WindowPut"]


class _OverWindows:
    """Builds the window communicator of a window optimizer (a mixin before its base).

    ``communication`` is accepted for symmetry with the other optimizers and must be
    ``"neighbor_allreduce"`` (or None).
    """

    gossip: type[WindowPutGossip | PushSumGossip]

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        topology: Topology | None = None,
        schedule: Iterator[Step] | None = None,
        communication: str | None = None,
        **kwargs,
    ) -> None:
        if kwargs.get("compression") not in (None, "none"):
            raise ValueError(
                f"{type(self).__name__}: compression={kwargs['compression']!r} is not built for "
                "window optimizers yet (compressed window deltas); use AdaptWithCombine or "
                "AdaptThenCombine with compression= (CHOCO-gossip)"
            )
        kwargs.pop("compression", None)
        if communication not in (None, "neighbor_allreduce"):
            raise ValueError(
                f"{type(self).__name__} communicates through windows; communication must be "
                f"'neighbor_allreduce'; got {communication!r}"
            )
        gossip = self.gossip(topology, schedule=schedule)
        super().__init__(optimizer, model, communicator=gossip, **kwargs)  # type: ignore[call-arg]

    @property
    def windows(self) -> list:
        """The optimizer's windows, one per bucket."""
        return self.communicator.windows  # type: ignore[attr-defined]

    def free(self) -> None:
        """Free the windows (collective); the optimizer cannot communicate afterwards."""
        self.close()  # type: ignore[attr-defined]


class WindowPut(_OverWindows, AdaptWithCombine):
    """Put the parameters to the out-neighbours before forward; combine what arrived at step.

    Args:
        optimizer, model: as for every decentralized optimizer.
        topology (Topology, optional): the windows' graph (default: the default topology).
        schedule (Iterator[Step], optional): per round, the destinations and their weights.
        communication (str, optional): only ``"neighbor_allreduce"`` (kept for symmetry).
        **kwargs: ``num_steps_per_communication``, ``fusion_threshold_bytes``.

    Example:
        >>> opt = WindowPut(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()       # x <- average of x and the latest neighbour copies, then SGD
        >>> opt.free()       # collective, when training is over
    """

    gossip = WindowPutGossip
    warn_on_second_forward = False

    def wait_puts(self) -> None:
        """Wait until this rank's puts in flight have landed at every destination.

        The combine still happens at :meth:`step`. With every rank calling this and then a
        barrier, every put of the round is in its slot before any rank combines.
        """
        for _, round_, _ in self._pending:
            if round_ is not None:
                round_.sent()

    def synchronize(self) -> None:
        """Wait for this rank's puts in flight (the combine waits for :meth:`step`)."""
        # The rounds stay pending: dropping them here would skip this step's combine.
        self.wait_puts()

    def close(self) -> None:
        """Wait for the puts in flight, then free the windows (collective)."""
        super().close()
        self._pending = []
        self._started = False

    def step(self, closure=None):
        """Combine the window buffers into the parameters, then the wrapped step."""
        pending, self._pending = self._pending, []
        try:
            for bucket, round_, _ in pending:
                if round_ is not None:
                    bucket.unpack(round_.wait(), lambda p: p.data)
        finally:
            self._started = False  # a failed round is over too (see AdaptWithCombine.step)
        self.steps += 1
        return self.optimizer.step(closure)


class PushSum(_OverWindows, DecentralizedOptimizer):
    r"""Asynchronous push-sum SGD over windows (works on directed graphs).

    The windows hold :math:`x_i = p_i z_i`; the parameters hold :math:`z_i`, which the
    wrapped optimizer steps (see :class:`~gossamer.communicators.PushSumGossip`).
    :meth:`state_dict` holds the windows' contents and weights, so a resumed run continues
    exactly.

    Example:
        >>> opt = PushSum(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()       # local step, push shares of (x, p), add what arrived
    """

    gossip = PushSumGossip

    def step(self, closure=None):
        """Local step, then (on communication steps) push shares and collect."""
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication or context.size() == 1:
            return loss
        self.communicator.next_round()
        for index, bucket in enumerate(self.buckets):
            bucket.unpack(self.communicator.start(bucket.pack(), index).wait(), lambda p: p.data)
        return loss
