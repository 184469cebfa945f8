r"""Asynchronous optimizers over one-sided windows: no rank ever waits for another's compute.

- :class:`WindowPut` (BlueFog's win-put): before the forward pass each rank puts its
  parameters into its out-neighbours' windows; :meth:`step` combines whatever has arrived
  (:math:`x \leftarrow w_{ii} x + \sum_j w_{ji} b_j`) and then takes the local step. It is
  adapt-with-combine over :class:`~gossamer.communicators.WindowPutGossip`.
- :class:`WindowAdaptThenCombine`: win-put of the local step instead: each bucket is
  stepped and put from the backward pass, as :class:`~gossamer.optim.AdaptThenCombine` sends
  it, and combined with what has arrived before its module's next forward pass,
  :math:`x \leftarrow w_{ii} \psi + \sum_j w_{ji} b_j`.
- :class:`PushSum` (stochastic gradient push; Assran et al., 2019): each rank steps on
  :math:`z_i = x_i / p_i`, then pushes shares of :math:`(x_i, p_i)` to its out-neighbours and
  adds what it received (:class:`~gossamer.communicators.PushSumGossip`), also on directed
  graphs. Each bucket is stepped and pushed from the backward pass; :meth:`PushSum.step`
  collects.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from gossamer.communicators import PushSumGossip, WindowPutGossip
from gossamer.compression import get_compressor
from gossamer.optim.base import TIMELINE_ROW, evaluate
from gossamer.optim.combine import AdaptThenCombine, AdaptWithCombine
from gossamer.optim.overlap import BucketwiseOptimizer
from gossamer.profiling import timeline
from gossamer.topology import Step, Topology

__all__ = ["PushSum", "WindowAdaptThenCombine", "WindowPut"]


# Options of the other optimizers that the window ones do not take, and why.
_NOT_TAKEN = {
    "communicator": "it communicates through its own windows",
    "error_feedback": (
        "a compressed put sends the change of the copy its destination holds, so nothing "
        "is lost that a residual would keep"
    ),
    "global_average_every": "window rounds have no global-average variant",
}


class _OverWindows:
    """Builds the window communicator of a window optimizer (a mixin before its base).

    ``communication`` is accepted for symmetry with the other optimizers and must be
    ``"neighbor_allreduce"`` (or None).
    """

    gossip: type[WindowPutGossip | PushSumGossip]
    # Win-put's windows share the packing buffer, which must stay a snapshot of the round.
    params_in_buckets = False

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
        name = type(self).__name__
        for key, why in _NOT_TAKEN.items():
            if key in kwargs:
                raise TypeError(f"{name} takes no {key}= (got {kwargs[key]!r}): {why}")
        compression = kwargs.pop("compression", None)
        given = get_compressor(compression).name  # a bad spec gets the registry's error
        if given != "none" and self.gossip is not WindowPutGossip:
            raise ValueError(
                f"{name}: compression={compression!r} is not built for push-sum "
                "(its puts must carry the mass exactly: a compressed value, or an "
                "error-feedback residual, loses or holds back some); "
                "use WindowPut, or AdaptWithCombine with compression= (CHOCO-gossip)"
            )
        elastic = kwargs.pop("elastic", False)
        if not isinstance(elastic, bool):
            raise TypeError(f"{name}: elastic must be a bool; got {elastic!r}")
        if communication not in (None, "neighbor_allreduce"):
            raise ValueError(
                f"{name} communicates through windows; communication must be "
                f"'neighbor_allreduce'; got {communication!r}"
            )
        if self.gossip is WindowPutGossip:
            gossip = WindowPutGossip(
                topology, schedule=schedule, compression=compression, elastic=elastic
            )
        else:
            gossip = self.gossip(topology, schedule=schedule, elastic=elastic)
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
        compression (str | Compressor, optional): compress the puts: each sends the
            compressed change of the copy its destination holds (``"uint8"``,
            ``"topk:0.1"``, ...; see :meth:`gossamer.windows.Window.put`).
        elastic (bool): train on when ranks die: puts skip the dead and the combine uses
            :meth:`Topology.without(dead) <gossamer.topology.Topology.without>`'s weights
            (compressed or not, static topology or schedule); :meth:`free` is collective
            over the live ranks.
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
        """Combine the window buffers into the parameters, then the wrapped step.

        A ``closure`` is evaluated first (see :func:`~gossamer.optim.base.evaluate`): its
        forward starts the puts.
        """
        loss = evaluate(closure)
        pending, self._pending = self._pending, []
        try:
            for bucket, round_, _ in pending:
                if round_ is not None:
                    bucket.unpack(round_.wait(), lambda p: p.data)
        finally:
            self._started = False  # a failed round is over too (see AdaptWithCombine.step)
        self.steps += 1
        self._update()
        return loss


class WindowAdaptThenCombine(_OverWindows, AdaptThenCombine):
    r"""Win-put of the local step: put each bucket from the backward pass, combine later.

    Adapt-then-combine over :class:`~gossamer.communicators.WindowPutGossip`: as soon as
    the backward pass has accumulated a bucket's gradients, the wrapped optimizer steps the
    bucket (:math:`\psi_i = x_i + u_i`) and the bucket is put into the out-neighbours'
    windows at once, so the puts run beside the rest of the backward pass; before a
    module's next forward pass (or at :meth:`synchronize`) its buckets are combined with
    whatever has arrived, :math:`x_i \leftarrow w_{ii} \psi_i + \sum_j w_{ji} b_j`, where
    :math:`b_j` is the latest :math:`\psi_j` that neighbour j put. No rank waits for
    another's compute. The rules of :class:`~gossamer.optim.AdaptThenCombine` for
    ``overlap=``, ``send_order=``, gradient accumulation and :meth:`no_sync` apply; exact
    diffusion is not built for windows; ``elastic=True`` is as for :class:`WindowPut`.

    :class:`WindowPut` (BlueFog's win-put) is the adapt-with-combine form: it puts
    :math:`x_t` before forward and combines at ``step()``.

    Args:
        optimizer, model: as for every decentralized optimizer.
        topology, schedule, communication, compression, elastic: as for :class:`WindowPut`.
        **kwargs: ``overlap``, ``send_order``, ``num_steps_per_communication``,
            ``fusion_threshold_bytes``.

    Example:
        >>> opt = WindowAdaptThenCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()  # per bucket: local step, then its puts
        >>> opt.step()       # steps and puts what backward left
        >>> model(x)         # each module combines its buckets with what arrived
        >>> opt.free()       # collective, when training is over
    """

    gossip = WindowPutGossip

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        if kwargs.get("exact_diffusion", False) is not False:
            raise ValueError(
                "WindowAdaptThenCombine: exact_diffusion is not built for windows (its "
                f"correction needs every neighbour's value of the same round); got "
                f"exact_diffusion={kwargs['exact_diffusion']!r}"
            )
        super().__init__(optimizer, model, **kwargs)

    def wait_puts(self) -> None:
        """Wait until this rank's puts in flight have landed at every destination.

        With every rank calling this and then a barrier, every put of the round is in its
        slot before any rank combines.
        """
        for _, round_, _ in self._pending:
            if round_ is not None:
                round_.sent()


class PushSum(_OverWindows, BucketwiseOptimizer):
    r"""Asynchronous push-sum SGD over windows (works on directed graphs).

    The windows hold :math:`x_i = p_i z_i`; the parameters hold :math:`z_i`, which the
    wrapped optimizer steps (see :class:`~gossamer.communicators.PushSumGossip`).
    :meth:`state_dict` holds the windows' contents and weights, so a resumed run continues
    exactly.

    With ``overlap=True`` (the default), on communication steps, each bucket is stepped as
    soon as the backward pass has accumulated its gradients and its shares are pushed at
    once (as :class:`~gossamer.optim.AdaptThenCombine` does; the same rules for gradient
    accumulation, :meth:`no_sync` and gradients changed after ``backward()`` apply);
    :meth:`step` steps and pushes the buckets backward did not complete, then collects
    what arrived into every bucket. ``overlap=False`` does all of it in :meth:`step`.

    With ``elastic=True`` it trains on when ranks die: each round pushes shares over the
    live out-neighbours only (a static topology or a schedule); see
    :class:`~gossamer.communicators.PushSumGossip`.

    Example:
        >>> opt = PushSum(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()  # per bucket: local step, shares pushed
        >>> opt.step()       # push what is left, collect what arrived
    """

    gossip = PushSumGossip

    def _step_bucket(self, index: int) -> tuple[torch.Tensor, None]:
        bucket = self.buckets[index]
        with timeline.activity(TIMELINE_ROW, "local step"):
            self._step_only(bucket.tensors)
        return bucket.pack(), None

    def step(self, closure=None):
        """Local step, then (on communication steps) push shares and collect."""
        loss = evaluate(closure)  # its backward pass may already step and push buckets
        if not self._is_round():
            self._update()
            self.steps += 1
            return loss
        self._take_remaining_steps()
        self.synchronize()
        self.steps += 1
        return loss
