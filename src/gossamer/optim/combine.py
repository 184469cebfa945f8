r"""Adapt-with-combine and adapt-then-combine: neighbour averaging of the parameters.

Both wrap any ``torch.optim`` optimizer. With a mixing matrix :math:`W` and the base
optimizer's update :math:`u(\cdot)` (for SGD, :math:`u(g) = -\eta g`):

- adapt-with-combine (AWC): :math:`x^{+} = W x + u(\nabla f(x))`; the averaging of
  :math:`x` starts before the forward pass and overlaps forward and backward.
- adapt-then-combine (ATC, diffusion; Sayed 2014): :math:`x^{+} = W (x + u(\nabla f(x)))`;
  each bucket is stepped and its averaging started before the next bucket is stepped, and
  the result is waited for at the next forward pass (or :meth:`synchronize`).

With a constant step size both settle at an :math:`O(\eta)` distance from the optimum of
:math:`\sum_i f_i` when the local optima differ; a decaying step size removes the bias.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from gossamer.optim.base import DecentralizedOptimizer

__all__ = ["AdaptThenCombine", "AdaptWithCombine"]


class AdaptWithCombine(DecentralizedOptimizer):
    """AWC: combine the parameters during forward and backward, then apply the local update.

    The combine starts from a forward pre-hook on the model, before the forward pass of every
    ``num_steps_per_communication``-th step (only while the model is training and gradients
    are enabled), and :meth:`step` waits for it before calling the wrapped optimizer, whose
    gradients were computed at the pre-combine point.

    Example:
        >>> opt = AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> loss_fn(model(x), y).backward()   # averaging overlaps forward and backward
        >>> opt.step()
    """

    #: warn when the model runs forward twice before a step (only the first communicates)
    warn_on_second_forward = True

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        super().__init__(optimizer, model, **kwargs)
        self._started = False
        self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in self.models]

    def _before_forward(self, module, inputs) -> None:
        # The exchange of x_t reads a packed copy, so it may run while forward and backward
        # read x_t itself: the whole step hides the wire time.
        if not (module.training and torch.is_grad_enabled()):
            return
        if self._started:
            if not self.warn_on_second_forward:
                return
            self._warn_once(
                "the model ran forward more than once before step(); only the "
                "first forward of a step starts communication"
            )
            return
        if self._is_round():
            try:
                self._start_rounds()
            except BaseException:
                # Nothing half started stays behind, and the next forward tries again (and
                # raises again after a rank loss) instead of skipping communication.
                self._pending.clear()
                raise
            self._started = True

    @property
    def step_in_progress(self) -> bool:
        """Whether a forward pass started this step's combine and :meth:`step` has not run."""
        return self._started

    def step(self, closure=None):
        """Write the combined parameters, then take the wrapped optimizer's step."""
        try:
            self.synchronize()
        finally:
            # A round that failed is over too: the next forward must start (and fail at
            # once, after a rank loss), not skip communication as a second forward would.
            self._started = False
        loss = self.optimizer.step(closure)
        self.steps += 1
        return loss


class AdaptThenCombine(DecentralizedOptimizer):
    r"""ATC: take the local step bucket by bucket, starting each bucket's combine at once.

    ``exact_diffusion=True`` adds the exact-diffusion correction (Yuan et al., 2019), which
    removes the constant-step bias: with :math:`\psi_k = x_k + u_k` the local step,

    .. math:: \phi_k = \psi_k + x_k - \psi_{k-1},\qquad x_{k+1} = \tfrac12 (I + W)\,\phi_k,

    and the ranks converge to the exact optimum of :math:`\sum_i f_i` with a constant step
    size. It needs a doubly stochastic :math:`W` and communication at every step.

    Example:
        >>> opt = AdaptThenCombine(torch.optim.Adam(model.parameters()), model)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()                 # local Adam step, then neighbour averaging starts
        >>> model(x)                   # waits for the averaged parameters first
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, model, *, exact_diffusion: bool = False, **kwargs
    ) -> None:
        super().__init__(optimizer, model, **kwargs)
        if not isinstance(exact_diffusion, bool):
            raise TypeError(f"exact_diffusion must be a bool; got {exact_diffusion!r}")
        if exact_diffusion and self.num_steps_per_communication != 1:
            raise ValueError("exact_diffusion needs num_steps_per_communication=1")
        self.exact_diffusion = exact_diffusion
        self._psi_prev: dict[int, torch.Tensor] = {}
        self._hooks = [m.register_forward_pre_hook(self._before_forward) for m in self.models]

    def _before_forward(self, module, inputs) -> None:
        self.synchronize()

    def _comm_state(self) -> dict:
        # Exact diffusion's next step depends on the previous local step psi.
        psi = {i: t.clone() for i, t in self._psi_prev.items()}
        return {**super()._comm_state(), "psi_prev": psi}

    def _load_comm_state(self, state: dict) -> None:
        psi = {int(i): t for i, t in state.get("psi_prev", {}).items()}
        for index, value in psi.items():
            # psi is per fusion bucket: another bucket layout would mix unrelated values.
            if not 0 <= index < len(self.buckets) or value.shape != self.buckets[index].flat.shape:
                raise ValueError(
                    f"state['psi_prev'][{index}] (shape {tuple(value.shape)}) does not fit this "
                    f"optimizer's {len(self.buckets)} buckets (another model or "
                    "fusion_threshold_bytes?)"
                )
        super()._load_comm_state(state)
        self._psi_prev = {i: t.clone() for i, t in psi.items()}

    def _step_only(self, params: Iterable[torch.Tensor], closure=None):
        """The wrapped optimizer's step restricted to ``params`` (its own update rule)."""
        wanted = set(params)
        groups = self.optimizer.param_groups
        saved = [g["params"] for g in groups]
        try:
            for g in groups:
                g["params"] = [p for p in g["params"] if p in wanted]
            return self.optimizer.step(closure)
        finally:
            for g, params_of_group in zip(groups, saved, strict=True):
                g["params"] = params_of_group

    def step(self, closure=None):
        """Local step; on communication steps, bucket by bucket with the combine started."""
        self.synchronize()
        if not self._is_round():
            loss = self.optimizer.step(closure)
        elif closure is not None:
            raise ValueError(
                "AdaptThenCombine.step does not take a closure on communication "
                "steps (the step is split per bucket)"
            )
        else:
            self.communicator.next_round()
            loss = None
            for index, bucket in enumerate(self.buckets):
                x = bucket.pack().clone() if self.exact_diffusion else None
                self._step_only(bucket.tensors)
                sent, finish = bucket.pack(), None
                if x is not None:
                    psi = sent.clone()
                    sent = psi + x - self._psi_prev.get(index, x)
                    self._psi_prev[index] = psi
                    finish = _halved_sum(sent)
                self._pending.append((bucket, self.communicator.start(sent, index), finish))
        self.steps += 1
        return loss


def _halved_sum(phi: torch.Tensor):
    """``y -> (phi + y) / 2``: applies (I + W) / 2 once ``y = W phi`` has arrived."""
    return lambda y: (phi + y) / 2
