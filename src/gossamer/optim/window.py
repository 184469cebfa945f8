r"""Asynchronous optimizers over one-sided windows: no rank ever waits for another's compute.

- :class:`WindowPut` (BlueFog's win-put): after the forward pass each rank puts its
  parameters into its out-neighbours' windows; :meth:`step` combines whatever has arrived
  (:math:`x \leftarrow w_{ii} x + \sum_j w_{ji} b_j`) and then takes the local step.
- :class:`PushSum` (stochastic gradient push; Assran et al., 2019): each rank keeps
  :math:`x_i` and a weight :math:`p_i`, steps on :math:`z_i = x_i / p_i`, then pushes a
  share :math:`1/(d_i+1)` of :math:`(x_i, p_i)` to each of its :math:`d_i` out-neighbours and
  adds what it received. Mass is conserved, so on any strongly connected directed graph,
  with weights that need not be doubly stochastic, the :math:`z_i` reach consensus.
"""

from __future__ import annotations

import itertools

import torch

from gossamer import context
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.windows import Window

__all__ = ["PushSum", "WindowPut"]

_prefixes = itertools.count()


class _WindowOptimizer(DecentralizedOptimizer):
    """Windows over the flat buckets; created (collectively) with the optimizer."""

    push_sum = False

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        super().__init__(optimizer, model, **kwargs)
        if self.communicator.communication != "neighbor_allreduce":
            raise ValueError(
                f"{type(self).__name__} communicates through windows; "
                "communication must be 'neighbor_allreduce'"
            )
        prefix = f"{type(self).__name__}.{next(_prefixes)}"
        for bucket in self.buckets:
            bucket.pack()
        # Push-sum keeps x apart from the packing buffer; win-put shares it.
        self.windows = [
            Window.create(
                b.flat.clone() if self.push_sum else b.flat,
                zero_init=self.push_sum,
                push_sum=self.push_sum,
                name=f"{prefix}.{i}",
                topology=self.communicator.topology,
            )
            for i, b in enumerate(self.buckets)
        ]

    def _dst_weights(self, window: Window, share: float = 1.0) -> dict[int, float]:
        step = self.communicator.step
        if step is None:
            return dict.fromkeys(window.out_neighbors, share)
        return {d: w * share for d, w in step.dst_weights.items()}

    def free(self) -> None:
        """Free the windows (collective); the optimizer cannot communicate afterwards."""
        self.synchronize()
        for window in self.windows:
            window.free()
        self.windows = []


class WindowPut(_WindowOptimizer):
    """Put the parameters to the out-neighbours after forward; combine what arrived at step.

    Example:
        >>> opt = WindowPut(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()       # x <- average of x and the latest neighbour copies, then SGD
        >>> opt.free()       # collective, when training is over
    """

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        super().__init__(optimizer, model, **kwargs)
        self._handles: list = []
        self._hooks = [m.register_forward_hook(self._after_forward) for m in self.models]

    def _after_forward(self, module, inputs, output) -> None:
        if not (module.training and torch.is_grad_enabled()) or self._handles:
            return
        if self._is_round():
            self.communicator.next_round()
            for bucket, window in zip(self.buckets, self.windows, strict=True):
                bucket.pack()
                self._handles.append(
                    window.put(dst_weights=self._dst_weights(window), async_op=True)
                )

    def synchronize(self) -> None:
        """Wait for this rank's puts in flight."""
        handles, self._handles = self._handles, []
        for handle in handles:
            if handle is not None:
                handle.wait()

    def step(self, closure=None):
        """Combine the window buffers into the parameters, then the wrapped step."""
        if self._handles:
            self.synchronize()
            for bucket, window in zip(self.buckets, self.windows, strict=True):
                bucket.unpack(window.update(require_mutex=True), lambda p: p.data)
        self.steps += 1
        return self.optimizer.step(closure)


class PushSum(_WindowOptimizer):
    r"""Asynchronous push-sum SGD over windows (works on directed graphs).

    The windows hold :math:`x_i = p_i z_i`; the parameters hold :math:`z_i`, which the
    wrapped optimizer steps. Moving :math:`x_i` by :math:`p_i \Delta_i` (rather than
    SGP's :math:`\Delta_i`, whose effective step :math:`\eta / p_i` diverges when a fast
    rank's :math:`p_i` shrinks) keeps every rank's step size as given. The price: when ranks
    run at different speeds their :math:`p_i` drift apart and the consensus leans toward
    the ranks with larger :math:`p_i`; with equal speeds :math:`p_i \approx 1`.

    Example:
        >>> opt = PushSum(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()       # local step, push shares of (x, p), add what arrived
    """

    push_sum = True

    def step(self, closure=None):
        """Local step, then (on communication steps) push shares and collect."""
        loss = self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication or context.size() == 1:
            return loss
        self.communicator.next_round()
        for bucket, window in zip(self.buckets, self.windows, strict=True):
            x = window.tensor
            torch.mul(bucket.pack(), window.p, out=x)
            share = 1.0 / (len(self._dst_weights(window)) + 1)
            window.accumulate(self_weight=share, dst_weights=self._dst_weights(window, share))
            window.update_then_collect(require_mutex=True)
            bucket.unpack(x / window.p, lambda p: p.data)
        return loss

    def _comm_state(self) -> dict:
        return {**super()._comm_state(), "p": [w.p for w in self.windows]}

    def _load_comm_state(self, state: dict) -> None:
        super()._load_comm_state(state)
        for window, p in zip(self.windows, state.get("p", []), strict=False):
            window.p = float(p)
