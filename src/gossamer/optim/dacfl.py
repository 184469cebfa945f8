r"""DACFL: first-order dynamic average consensus (FODAC) tracking the average of local models.

Chen, Li, Zhu and Zhang, *DACFL: Dynamic Average Consensus Based Federated Learning in
Decentralized Topology* (arXiv:2111.05505; Sensors 22(9), 2022). Every rank trains its own
model :math:`\theta_i` with the wrapped optimizer on its own data, and keeps a second
vector :math:`x_i`, its estimate of the network's average model
:math:`\bar\theta = \frac1n \sum_j \theta_j`, updated by first-order dynamic average
consensus (Zhu and Martinez, 2010):

.. math::
    x_i(0) = \theta_i(0),\qquad
    x_i(k+1) = \sum_j W_{ji}(k)\, x_j(k) + \big(\theta_i(k+1) - \theta_i(k)\big).

With column-sum-one mixing (doubly stochastic :math:`W(k)`, e.g. Metropolis-Hastings
weights or the one-peer exponential schedule) the average is tracked exactly,
:math:`\frac1n\sum_i x_i(k) = \bar\theta(k)` at every step, and each :math:`x_i` follows
:math:`\bar\theta` with an error of the order of the local models' change per step divided
by the spectral gap. The graph may change every step (``schedule=``). Steps that do not
communicate (``num_steps_per_communication > 1``) take :math:`W = I`.

The training itself does not read :math:`x_i`: the model's parameters stay
:math:`\theta_i`. Evaluate the tracked average with :meth:`DACFL.averaged` (a context that
swaps :math:`x_i` into the model) or read it with :meth:`DACFL.average_state`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from gossamer.optim.base import DecentralizedOptimizer

__all__ = ["DACFL"]


class DACFL(DecentralizedOptimizer):
    r"""FODAC tracking of the average model next to local training (see the module).

    Args:
        optimizer (torch.optim.Optimizer): trains this rank's local model :math:`\theta_i`.
        model (nn.Module | Sequence[nn.Module]): the model(s) owning its parameters.
        **kwargs: the options of :class:`DecentralizedOptimizer`: ``topology=`` (static),
            ``schedule=`` (a dynamic topology, e.g.
            ``gossamer.topology.one_peer_exponential(g, rank)``), ``communicator=``,
            ``num_steps_per_communication``, ``fusion_threshold_bytes``. The communicator
            mixes :math:`x`; any neighbour-averaging one works (``NonlinearGossip``
            too, though it tracks the average only with symmetric weights).

    Example:
        >>> opt = DACFL(torch.optim.SGD(model.parameters(), lr=0.05), model,
        ...             schedule=one_peer_exponential(exponential_two(n), rank))
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()              # local step of theta_i, then x_i's FODAC update
        >>> with opt.averaged():    # evaluate x_i, the tracked average model
        ...     accuracy = evaluate(model)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        super().__init__(optimizer, model, **kwargs)
        self.tracker: list[torch.Tensor] = [b.pack().clone() for b in self.buckets]

    def step(self, closure=None):
        r"""The wrapped optimizer's step on :math:`\theta_i`, then the FODAC update of x."""
        pending: list = [None] * len(self.buckets)
        if self._is_round():
            # x(k) is known before the local step: its mixing overlaps the step.
            self.communicator.next_round()
            pending = [self.communicator.start(x, i) for i, x in enumerate(self.tracker)]
        before = [b.pack().clone() for b in self.buckets]
        loss = self.optimizer.step(closure)
        for i, bucket in enumerate(self.buckets):
            mixed = self.tracker[i] if pending[i] is None else pending[i].wait()
            self.tracker[i] = mixed + (bucket.pack() - before[i])
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
        r"""Within the block the model's parameters hold :math:`x_i`; :math:`\theta_i` after."""
        saved = [b.pack().clone() for b in self.buckets]
        try:
            for bucket, flat in zip(self.buckets, self.tracker, strict=True):
                bucket.unpack(flat, lambda p: p.data)
            yield
        finally:
            for bucket, flat in zip(self.buckets, saved, strict=True):
                bucket.unpack(flat, lambda p: p.data)

    def _comm_state(self) -> dict:
        return {**super()._comm_state(), "tracker": [x.clone() for x in self.tracker]}

    def _load_comm_state(self, state: dict) -> None:
        tracker = state.get("tracker")
        if tracker is not None:
            shapes = [tuple(b.flat.shape) for b in self.buckets]
            got = [tuple(t.shape) for t in tracker]
            if got != shapes:
                raise ValueError(
                    f"state['tracker'] has buckets of shapes {got}; this optimizer's are "
                    f"{shapes} (another model or fusion_threshold_bytes?)"
                )
        super()._load_comm_state(state)
        if tracker is not None:
            self.tracker = [t.detach().clone() for t in tracker]
