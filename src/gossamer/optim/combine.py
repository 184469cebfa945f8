r"""Adapt-with-combine and adapt-then-combine: neighbour averaging of the parameters.

Both wrap any ``torch.optim`` optimizer. With a mixing matrix :math:`W` and the base
optimizer's update :math:`u(\cdot)` (for SGD, :math:`u(g) = -\eta g`):

- adapt-with-combine (AWC): :math:`x^{+} = W x + u(\nabla f(x))`; the averaging of
  :math:`x` starts before the forward pass and overlaps forward and backward.
- adapt-then-combine (ATC, diffusion; Sayed 2014): :math:`x^{+} = W (x + u(\nabla f(x)))`;
  each bucket is stepped and its averaging started as soon as the backward pass has
  produced its gradients, and each module waits for its own buckets' results before its
  next forward pass (or :meth:`synchronize`).

With a constant step size both settle at an :math:`O(\eta)` distance from the optimum of
:math:`\sum_i f_i` when the local optima differ; a decaying step size removes the bias.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Container

import torch

from gossamer import transport
from gossamer.optim.base import TIMELINE_ROW, DecentralizedOptimizer, evaluate
from gossamer.optim.overlap import BucketwiseOptimizer, module_buckets
from gossamer.profiling import timeline

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
    params_in_buckets = True

    def __init__(self, optimizer: torch.optim.Optimizer, model, **kwargs) -> None:
        super().__init__(optimizer, model, **kwargs)
        self._started = False
        self._forwarded: set[int] = set()  # ids of the models run since the round started
        # Eager: under torch.compile, Dynamo would trace the hook into the round's Python
        # (the topology, the communication thread) and fail.
        hook = torch.compiler.disable(self._before_forward)
        self._hooks = [m.register_forward_pre_hook(hook) for m in self.models]

    def _before_forward(self, module, inputs) -> None:
        # The exchange only reads x_t (the parameters live in the buckets), so it runs while
        # forward and backward read x_t too: the whole step hides the wire time.
        if not (module.training and torch.is_grad_enabled()):
            return
        if self._started:
            # Several models (an encoder, then a decoder) each run once: no second forward.
            if self.warn_on_second_forward and id(module) in self._forwarded:
                self._warn_once(
                    "the model ran forward more than once before step(); only the "
                    "first forward of a step starts communication"
                )
            self._forwarded.add(id(module))
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
            self._forwarded = {id(module)}

    @property
    def step_in_progress(self) -> bool:
        """Whether a forward pass started this step's combine and :meth:`step` has not run."""
        return self._started

    def step(self, closure=None):
        """Write the combined parameters, then take the wrapped optimizer's step.

        A ``closure`` is evaluated first (see :func:`~gossamer.optim.base.evaluate`): its
        forward starts the round.
        """
        loss = evaluate(closure)
        if self._is_round() and not self._started:
            self._warn_once(
                "step() of a communication step, but no training-mode forward of the "
                "wrapped model (with gradients enabled) started its round: nothing was averaged"
            )
        try:
            self.synchronize()
        finally:
            # A round that failed is over too: the next forward must start (and fail at
            # once, after a rank loss), not skip communication as a second forward would.
            self._started = False
        self._update()
        self.steps += 1
        return loss


class AdaptThenCombine(BucketwiseOptimizer):
    r"""ATC: take the local step bucket by bucket, starting each bucket's combine at once.

    With ``overlap=True`` (the default) the work follows the backward pass: as soon as the
    gradients of every parameter of a bucket have been accumulated (a
    ``register_post_accumulate_grad_hook`` on each parameter), the wrapped optimizer steps
    that bucket's parameters (its own update rule, on a subset of its parameter groups, so
    momentum, Adam's moments and weight decay are exactly torch's) and the bucket's neighbour
    exchange is queued on the communication thread. Its wire time then hides behind the rest
    of the backward pass. Buckets are queued in a fixed order, the same on every rank
    (``send_order``: index order, the reverse registration order, by default; see
    :class:`~gossamer.optim.overlap.BucketwiseOptimizer`); a bucket ready early waits for
    the ones before it. A module's forward pre-hook waits only for the combines of its own
    buckets (and of the buckets queued before them, which are done by then) and writes them
    into the parameters. :meth:`step` takes the local step of the buckets that were never
    completed (parameters without a gradient in this step, a model with unused parameters)
    and queues them; it does not wait.

    What changes with ``overlap=True``: the gradients are consumed during ``backward()``, so
    code that changes them between ``backward()`` and ``step()`` (gradient clipping) has
    no effect on communication steps, a loss scaler (``torch.amp.GradScaler``) is refused
    at ``scaler.step(opt)``, and a
    second backward pass before ``step()`` (gradient accumulation) must run inside
    :meth:`no_sync`, except the last, or it raises ``RuntimeError``. Use ``overlap=False``
    for those: the whole local step and every exchange then start in :meth:`step` (a
    scaler's overflow skips this rank's update, not its round: see ``docs/concepts.md``,
    *Mixed precision*). Steps that
    do not communicate (``num_steps_per_communication > 1``) always step in :meth:`step`.
    Either way a parameter's combine lands in the forward pre-hook of the module that owns
    it: a forward that reads a parameter before its owner runs (a parent passing a child's
    weight to a functional call, as tied embeddings may) reads it uncombined; call
    :meth:`synchronize` before such a forward. With ``overlap=True`` the wrapped optimizer's
    ``step()`` runs once per bucket, its ``param_groups`` cut down to that bucket's
    parameters for the call, so its step hooks (an EMA, a counter) run once per bucket and
    each sees part of the model; ``overlap=False`` steps once over all of them.

    ``exact_diffusion=True`` adds the exact-diffusion correction (Yuan et al., 2019), which
    removes the constant-step bias: with :math:`\psi_k = x_k + u_k` the local step,

    .. math:: \phi_k = \psi_k + x_k - \psi_{k-1},\qquad x_{k+1} = \tfrac12 (I + W)\,\phi_k,

    and the ranks converge to the exact optimum of :math:`\sum_i f_i` with a constant step
    size. It needs a doubly stochastic :math:`W` and communication at every step.

    With ``elastic=True`` the correction restarts (:math:`\psi_{k-1} := x_k`, as at the
    first step) on every survivor in the same round after a death, the epoch's *settled
    round* (:mod:`gossamer.transport.membership`): the correction carries a dual variable
    whose sum over the ranks must be zero, and the dead rank took its share with it. The
    survivors then converge to the exact optimum of :math:`\sum_{i \text{ alive}} f_i`.

    Args:
        optimizer, model: as for every decentralized optimizer.
        exact_diffusion (bool): add the exact-diffusion correction.
        overlap (bool): step and send each bucket from the backward pass (see above).
        send_order (str | int): the order of each step's rounds: ``"backward"`` (default;
            as backward produces the buckets), ``"forward"`` (the first bucket at once, then
            the model's front first, so the next forward pass waits for less), or ``k``: only
            the last ``k`` buckets front first.
        **kwargs: the options of :class:`DecentralizedOptimizer`; ``fusion_threshold_bytes``
            is the bucket size, and so the grain of the overlap.

    Example:
        >>> opt = AdaptThenCombine(torch.optim.Adam(model.parameters()), model)
        >>> loss_fn(model(x), y).backward()  # each bucket: local Adam step, exchange starts
        >>> opt.step()                 # steps and sends what backward left (unused params)
        >>> model(x)                   # each module waits for its own averaged parameters
    """

    params_in_buckets = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        exact_diffusion: bool = False,
        overlap: bool = True,
        **kwargs,
    ) -> None:
        # Checked first: a failed constructor must leave no hooks behind.
        if not isinstance(exact_diffusion, bool):
            raise TypeError(f"exact_diffusion must be a bool; got {exact_diffusion!r}")
        if exact_diffusion and kwargs.get("num_steps_per_communication", 1) != 1:
            raise ValueError("exact_diffusion needs num_steps_per_communication=1")
        super().__init__(optimizer, model, overlap=overlap, **kwargs)
        self.exact_diffusion = exact_diffusion
        self._psi_prev: dict[int, torch.Tensor] = {}
        self._index = {bucket: i for i, bucket in enumerate(self.buckets)}
        self._hooks += [
            module.register_forward_pre_hook(
                torch.compiler.disable(
                    functools.partial(self._before_forward, self._queued_up_to(indices))
                )
            )
            for module, indices in module_buckets(self.models, self.buckets)
        ]
        self._restarted_epoch = 0

    # ------------------------------------------------------------------ hooks
    def _before_forward(self, wanted: set[int], module, inputs) -> None:
        # Rounds run in queue order on the communication thread, so the buckets queued
        # before this module's are done when its own is: writing them too costs no wait and
        # covers a parameter read outside its own module's forward.
        self._finish(wanted)

    # ------------------------------------------------------------------ per bucket
    def _step_bucket(self, index: int) -> tuple[torch.Tensor, Callable | None]:
        """The wrapped optimizer's step on bucket ``index``; what to send, and its finish."""
        bucket = self.buckets[index]
        self._finish((index,))  # the previous combine of this bucket lands first
        first = self._queued == 0 and not self._ready  # this step's first local step
        if first and self.exact_diffusion and getattr(self.communicator, "elastic", False):
            self._restart_after_death(self.communicator.rounds + 1)
        with timeline.activity(TIMELINE_ROW, "local step"):
            x = bucket.pack().clone() if self.exact_diffusion else None
            self._step_only(bucket.tensors)
            sent = bucket.pack()
            if x is None:
                return sent, None
            psi = sent.clone()
            sent = psi + x - self._psi_prev.get(index, x)
            self._psi_prev[index] = psi
            return sent, _halved_sum(sent)

    def _finish(self, indices: Container[int]) -> None:
        """Wait for the rounds in flight on the buckets ``indices``; write their results."""
        mine = [e for e in self._pending if self._index[e[0]] in indices]
        if not mine:
            return
        self._pending = [e for e in self._pending if self._index[e[0]] not in indices]
        with timeline.activity(TIMELINE_ROW, "waiting for combine"):
            for bucket, handle, finish in mine:
                if handle is not None:
                    result = handle.wait()
                    bucket.unpack(result if finish is None else finish(result), lambda p: p.data)

    def synchronize(self) -> None:
        """Wait for every combine in flight and write it into the parameters."""
        self._finish(range(len(self.buckets)))

    # ------------------------------------------------------------------ state
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

    def _restart_after_death(self, upcoming: int) -> None:
        """Restart exact diffusion's correction if round ``upcoming`` is an epoch's settled one."""
        membership = transport.get_membership()
        due = membership.settled_round
        if membership.epoch <= self._restarted_epoch or upcoming < due:
            return
        if upcoming > due:
            warnings.warn(
                f"exact diffusion restarts at round {upcoming}, after the "
                f"settled round {due} of membership epoch {membership.epoch}: the survivors "
                "restart in different rounds and converge near, not at, their optimum",
                stacklevel=3,
            )
        self._psi_prev = {}
        self._restarted_epoch = membership.epoch

    def step(self, closure=None):
        """Finish the step: on communication steps, step and queue the buckets left.

        On other steps: wait for the combines in flight, then the wrapped optimizer's step.
        A ``closure`` is evaluated first (see :func:`~gossamer.optim.base.evaluate`): its
        backward pass takes the buckets' local steps.
        """
        loss = evaluate(closure)
        if not self._is_round():
            self.synchronize()
            self._update()
        else:
            self._take_remaining_steps()
        self.steps += 1
        return loss


def _halved_sum(phi: torch.Tensor):
    """``y -> (phi + y) / 2``: applies (I + W) / 2 once ``y = W phi`` has arrived."""
    return lambda y: (phi + y) / 2
