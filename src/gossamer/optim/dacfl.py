r"""DACFL: local training from a consensus estimate tracked by dynamic average consensus.

Chen, Li, Zhu and Zhang, *DACFL: Dynamic Average Consensus Based Federated Learning in
Decentralized Topology* (arXiv:2111.05505; Sensors 22(9), 2022). Every rank keeps
:math:`x_i`, its estimate of the network's average model, and :math:`\theta_i`, the model its
last local training produced. In round :math:`r` rank :math:`i` trains locally *starting from
its estimate* (``num_steps_per_communication`` steps of the wrapped optimizer on its own
data), then updates the estimate by first-order dynamic average consensus (FODAC; Zhu and
Martinez, 2010) with the change of its trained model as the reference signal:

.. math::
    x_i(0) = \theta_i(0),\qquad
    \theta_i(r+1) = \mathrm{LocalTrain}_i\big(x_i(r)\big),\qquad
    x_i(r+1) = \sum_j W_{ji}(r)\, x_j(r) + \big(\theta_i(r+1) - \theta_i(r)\big).

The model's parameters hold :math:`x_i(r)` at the start of every round, so the next local
training and any evaluation between rounds read the estimate.

With column-sum-one mixing (doubly stochastic :math:`W(r)`, e.g. Metropolis-Hastings weights
or the one-peer exponential schedule) the average is tracked exactly:
:math:`\frac1n\sum_i x_i(r) = \frac1n\sum_i \theta_i(r)` at every round. With one local SGD
step per round, :math:`\theta_i(r+1) = x_i(r) - \eta\, g_i(x_i(r))`, the update reads

.. math::
    x(r+1) = W x(r) + x(r) - x(r-1) - \eta\,\big(g(x(r)) - g(x(r-1))\big),\qquad r \ge 1,

(for :math:`r = 0` it is one adapt-with-combine step, :math:`W x(0) - \eta g(x(0))`): the
gradient enters as a difference, as in gradient tracking and EXTRA. A fixed point is
consensual (:math:`x = W x`) with :math:`\sum_i g_i(x) = 0`, the optimum of the average
loss, where plain DSGD settles at an :math:`O(\eta)` distance from it under skew.

**Stability and the correction gain.** Write :math:`e_i(r) = x_i(r) - \theta_i(r)`. Then
the update is :math:`x(r+1) = W x(r) + (\theta(r+1) - x(r)) + e(r)` with
:math:`e(r+1) = e(r) + (W - I)\, x(r)`: a local step plus the sum of all past mixing
corrections, a consensus controller with an integral gain of 1. That gain sits on the edge
of stability. In a direction where the loss is flat, a disagreement mode with eigenvalue
:math:`\lambda` of :math:`W` evolves by :math:`z^2 - (1 + \lambda) z + 1 = 0`: both roots
lie on the unit circle for real :math:`\lambda \in (-1, 1)` (no decay), one lies outside
for complex :math:`\lambda` (directed graphs, the one-peer exponential schedule), and a
switching schedule (even of symmetric matchings, whose :math:`\lambda \in \{0, 1\}` give
a Jordan block at 1) pumps energy into these undamped modes until they diverge. The
mixing matrices were right at both ends of every exchange; the recursion itself is unstable.

``correction`` :math:`= \alpha \in (0, 1]` scales the integral term,

.. math::
    x(r+1) = W(r)\, x(r) + \big(\theta(r+1) - x(r)\big) + e(r),\qquad
    e(r+1) = e(r) + \alpha\,\big(W(r) - I\big)\, x(r),

so :math:`\alpha = 1` is the paper. For :math:`\alpha < 1` a flat mode follows
:math:`z^2 - (1+\lambda) z + \alpha + \lambda(1 - \alpha) = 0`, whose roots lie strictly
inside the unit circle for every real :math:`\lambda \in (-1, 1)`. The fixed points are
unchanged (:math:`(W - I) x = 0`: consensus; then :math:`e = \eta g` with
:math:`\sum_i e_i = 0` because column-stochastic mixing keeps :math:`\sum_i e_i` at 0: the
optimum of the average loss), and so is the tracking: with :math:`\sum_i e_i(r) = 0`,
:math:`\frac1n\sum_i x_i(r+1) = \frac1n\sum_i \theta_i(r+1)` for every :math:`\alpha`.
In one process (8 ranks, skewed least squares with a flat direction), alpha = 1/2
converges on the static ring, the one-peer exponential schedule and switching matchings,
where alpha = 1 diverges on the last two, and alpha = 3/4 still diverges on the one-peer
exponential schedule (``tests/algorithms/test_heterogeneity.py`` checks the first two
claims on its problems).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gossamer.optim.base import DecentralizedOptimizer

__all__ = ["DACFL"]


class DACFL(DecentralizedOptimizer):
    r"""DACFL: local training from the FODAC estimate of the average model (see the module).

    Between rounds the model's parameters hold :math:`x_i`; during a round of
    ``num_steps_per_communication`` steps they hold the local training under way. A round's
    last :meth:`step` mixes :math:`x(r)` (started before the local step, so the exchange
    overlaps it), adds :math:`\theta_i(r+1) - \theta_i(r)` and writes :math:`x_i(r+1)` into
    the parameters. One model is sent per neighbour and round.

    Args:
        optimizer (torch.optim.Optimizer): the local training; its state (momentum) carries
            over from round to round.
        model (nn.Module | Sequence[nn.Module]): the model(s) owning its parameters.
        correction (float): :math:`\alpha \in (0, 1]`, the gain of the consensus correction
            (see the module). 1 is the paper's recursion, stable only on static symmetric
            graphs; the default 1/2 is also stable on directed and time-varying ones.
        **kwargs: the options of :class:`DecentralizedOptimizer`: ``topology=`` (static),
            ``schedule=`` (a dynamic topology, e.g. ``one_peer_exponential``),
            ``communicator=``, ``num_steps_per_communication``, ``fusion_threshold_bytes``.
            The communicator mixes :math:`x`; its weights must be column stochastic
            (doubly stochastic for the average to be the plain mean).

    Raises:
        ValueError: ``correction`` outside ``(0, 1]``, or ``elastic=True`` (not supported).

    Example:
        >>> opt = DACFL(torch.optim.SGD(model.parameters(), lr=0.05), model,
        ...             topology=ring(n))
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()        # local step from x_i, FODAC update; the model now holds x_i
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, model, *, correction: float = 0.5, **kwargs
    ) -> None:
        if isinstance(correction, bool) or not isinstance(correction, int | float):
            raise TypeError(f"correction must be a number in (0, 1]; got {correction!r}")
        if not 0 < correction <= 1:
            raise ValueError(f"correction must be in (0, 1]; got {correction!r}")
        if kwargs.get("elastic") is True:
            # The tracker's sum loses a dead rank's share and nothing restarts it: the
            # survivors would settle away from their optimum (measured: 1.50 for 4/3).
            raise ValueError("DACFL does not support elastic=True (its tracker is not restarted)")
        super().__init__(optimizer, model, **kwargs)
        self.correction = float(correction)
        self.tracker: list[torch.Tensor] = [b.pack().clone() for b in self.buckets]
        # x_i(r) - e_i(r): theta_i(r) itself when correction == 1 (the paper's reference)
        self.trained: list[torch.Tensor] = [x.clone() for x in self.tracker]

    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built)."""
        return {**super().settings(), "correction": self.correction}

    def step(self, closure=None):
        r"""A local step; at a round's end, the FODAC update and :math:`x_i` into the model."""
        if not self._is_round():
            loss = self._update(closure)
            self.steps += 1
            return loss
        # x(r) is fixed for the whole round: its mixing overlaps the local step.
        self.communicator.next_round()
        pending = [self.communicator.start(x, i) for i, x in enumerate(self.tracker)]
        loss = self._update(closure)
        for i, bucket in enumerate(self.buckets):
            theta = bucket.pack().clone()
            x = self.tracker[i]
            mixed = x if pending[i] is None else pending[i].wait()
            correction = x - self.trained[i]  # e(r)
            new = mixed + (theta - x) + correction  # = mixed + theta - trained
            correction += self.correction * (mixed - x)  # e(r+1)
            self.tracker[i] = new
            self.trained[i] = new - correction
            bucket.unpack(new, lambda p: p.data)
        self.steps += 1
        return loss

    def average_state(self) -> dict[str, torch.Tensor]:
        """This rank's estimate :math:`x_i` of the average model, by parameter name."""
        out: dict[str, torch.Tensor] = {}
        for bucket, flat in zip(self.buckets, self.tracker, strict=True):
            offset = 0
            for p in bucket.tensors:
                out[self.param_names[p]] = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return out

    @contextlib.contextmanager
    def averaged(self) -> Iterator[None]:
        r"""Within the block the parameters hold :math:`x_i`; what they held, after.

        Between rounds that is the model itself; in the middle of a round (a period above
        1) it evaluates the estimate instead of the local training under way.
        """
        saved = [b.pack().clone() for b in self.buckets]
        try:
            for bucket, flat in zip(self.buckets, self.tracker, strict=True):
                bucket.unpack(flat, lambda p: p.data)
            yield
        finally:
            for bucket, flat in zip(self.buckets, saved, strict=True):
                bucket.unpack(flat, lambda p: p.data)

    def _comm_state(self) -> dict:
        return {
            **super()._comm_state(),
            "tracker": [x.clone() for x in self.tracker],
            "trained": [t.clone() for t in self.trained],
        }

    def _load_comm_state(self, state: dict) -> None:
        shapes = [tuple(b.flat.shape) for b in self.buckets]
        for key in ("tracker", "trained"):
            got = [tuple(t.shape) for t in state.get(key, self.tracker)]
            if got != shapes:
                raise ValueError(
                    f"state[{key!r}] has buckets of shapes {got}; this optimizer's are "
                    f"{shapes} (another model or fusion_threshold_bytes?)"
                )
        super()._load_comm_state(state)
        for key in ("tracker", "trained"):
            if key in state:
                setattr(self, key, [t.detach().clone() for t in state[key]])
