r"""SkewScout: adapt the communication period to the measured accuracy loss between ranks.

Hsieh, Phanishayee, Mutlu and Gibbons, "The Non-IID Data Quagmire of Decentralized Machine
Learning", ICML 2020. Under skewed (non-IID) data the ranks' models drift towards their own
partitions; SkewScout measures that drift as an **accuracy loss**, the accuracy a model loses
when it is evaluated on another rank's data instead of its own, and tunes how often the ranks
communicate so that the loss stays below a target:

.. math::

    \ell_i = \mathrm{acc}(x_i; D_i) - \mathrm{acc}(x_{p(i)}; D_i),
    \qquad \ell = \frac1n \sum_i \ell_i \;(\text{or } \max_i \ell_i)

where :math:`x_{p(i)}` is the model of rank :math:`i`'s probe peer and :math:`D_i` a small
sample of rank :math:`i`'s own data. On IID data the models agree, :math:`\ell \approx 0`, and
the ranks can communicate rarely; under skew :math:`\ell` grows and they must communicate
more often. The period :math:`\tau` (local steps between averaging rounds) follows

.. math::

    \tau \leftarrow \begin{cases}
        \max(\tau_{\min}, \lfloor \tau / f \rfloor) & \ell > \theta \\
        \min(\tau_{\max}, \tau \cdot f) & \ell < \rho\,\theta \\
        \tau & \text{otherwise}
    \end{cases}

with threshold :math:`\theta`, factor :math:`f` and hysteresis :math:`\rho \in [0, 1]`.

**Drift.** The accuracy loss measures skew, not the drift that a long period causes on
IID data: there a peer's model scores like one's own on one's data even when the two have
drifted apart, and :math:`\ell \approx 0` at every period. So each probe also measures the
**local drift in step units**: the disagreement that the local steps between two averaging
rounds add. Each rank keeps :math:`\Delta_i = x_i^{\text{pre}} - x_i^{\text{post}}`, from
the model a round leaves (:math:`x_i^{\text{post}}`) to the model the next round starts
from (:math:`x_i^{\text{pre}}`), over the :math:`\tau - 1` steps without communication
between them (:math:`\Delta_i = 0` at :math:`\tau = 1`); the probe sends it with the model
(as a count sketch of ``sketch_size`` numbers where the model is larger, see
:class:`SkewScout`) and

.. math::

    D = \frac{\frac1n\sum_i \lVert \Delta_i - \Delta_{p(i)} \rVert^2}
             {\frac1n\sum_i \overline{\textstyle\sum_g \eta_g^2 \lVert g_{i,g} \rVert^2}},

the squared distance between the two ranks' local displacements over the mean squared
plain gradient step (:math:`\eta_g` the learning rate of parameter group :math:`g`,
averaged over the steps since the last probe): how many gradient steps apart, squared, the
local steps of one period carry the models. All ranks take their rounds at the same steps,
so both displacements cover the same steps. :math:`D` does not depend on the graph: the
spread that a round leaves behind (which a slowly mixing graph carries over from round to
round) cancels in :math:`\Delta_i - \Delta_{p(i)}`, and so does the phase of the probe
within the period. The distance :math:`\lVert x_i - x_{p(i)} \rVert^2` at the probe, used
before, did depend on both: on a ring of 8 under IID data the spread a round leaves is
about half the spread before it, on exp-2 a sixth, so at periods 8 and 16 that distance
was about 4 times smaller on exp-2 while the models' accuracy suffered as much.

With a drift threshold :math:`\delta` both signals drive the rule: the period shrinks when
:math:`\ell > \theta` or :math:`D > \delta` and grows only when :math:`\ell < \rho\theta`
and the drift that the longer period would bring stays in the band,

.. math::

    \hat D = D\,\frac{f\tau - 1}{\tau - 1} < \rho\delta
    \qquad (\hat D = D \text{ at } \tau = 1),

:math:`D` extrapolated linearly from the :math:`\tau - 1` local steps it was measured over
to the :math:`f\tau - 1` of the longer period. The drift grows at least that fast with the
local steps (on the benchmark's IID digits, on either graph: 13 to 20 over 1 step, 25 to 60
over 3, 95 to 190 over 7, about 300 over 15), so a plain band :math:`D < \rho\delta` would
let the period grow into a drift above :math:`\delta` and come back at the next probe,
again and again.

The paper tunes the communication knob of each algorithm (Gaia's significance threshold,
FedAvg's local steps, DGC's sparsity); here the knob is the period of any
:class:`~gossamer.optim.DecentralizedOptimizer` (its ``num_steps_per_communication``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable

import torch
from torch import nn

from gossamer import context, ops
from gossamer.optim.agreement import agreed
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.optim.gradient_allreduce import GradientAllreduce

__all__ = ["PeriodController", "SkewScout"]

_REDUCTIONS = ("mean", "max")
# The controller's settings, which every rank's must share (they decide the period).
_RULE = (
    "period",
    "threshold",
    "drift_threshold",
    "min_period",
    "max_period",
    "factor",
    "hysteresis",
)


def _real(value: object, name: str, alternative: str = "") -> float:
    """``value`` as a float: a Python, NumPy or 0-d tensor number that is not NaN."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_complex():
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or math.isnan(value):
        raise TypeError(f"{name} must be a number{alternative}; got {value!r}")
    return float(value)


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int >= {minimum}; got {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}; got {value!r}")
    return value


def _check_fraction(value: object, name: str, *, upper: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name} must be a number; got {value!r}")
    if not 0 <= value <= upper or math.isnan(value):
        raise ValueError(f"{name} must be in [0, {upper}]; got {value!r}")
    return float(value)


def _write(flat: torch.Tensor, params: list[nn.Parameter]) -> None:
    """Copy ``flat``'s slices into ``params`` in place.

    Unlike ``vector_to_parameters``, which rebinds ``p.data`` to views of ``flat``, the
    parameters keep their own storage, so nothing that holds it (fusion buffers, windows,
    CUDA graphs) is cut off by a probe.
    """
    offset = 0
    with torch.no_grad():
        for p in params:
            p.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


class PeriodController:
    r"""The decision rule of SkewScout: a period that shrinks under loss and grows without.

    Pure: it never communicates, so every rank that feeds it the same losses (SkewScout
    feeds it the allreduced loss) holds the same period.

    Args:
        threshold (float): :math:`\theta`, the accuracy loss (a fraction in ``[0, 1]``) above
            which the period shrinks.
        drift_threshold (float, optional): :math:`\delta > 0`, the local drift in step
            units (see the module) above which the period shrinks, and below
            :math:`\rho\delta` of which the drift extrapolated to the longer period must stay
            for it to grow; ``None`` (the default) ignores the drift.
        min_period (int): :math:`\tau_{\min} \ge 1`.
        max_period (int): :math:`\tau_{\max} \ge` ``min_period``.
        initial_period (int, optional): the first period; default ``min_period``.
        factor (int): :math:`f \ge 2`, the multiplicative step of the period.
        hysteresis (float): :math:`\rho \in [0, 1]`: the period grows only when the loss is
            below :math:`\rho\theta` (1: grow whenever it is not above the threshold).

    Example:
        >>> c = PeriodController(threshold=0.05, min_period=1, max_period=8)
        >>> [c.update(loss) for loss in (0.0, 0.0, 0.0, 0.0, 0.2, 0.03)]
        [2, 4, 8, 8, 4, 4]
    """

    def __init__(
        self,
        *,
        threshold: float = 0.05,
        drift_threshold: float | None = None,
        min_period: int = 1,
        max_period: int = 32,
        initial_period: int | None = None,
        factor: int = 2,
        hysteresis: float = 0.5,
    ) -> None:
        self.threshold = _check_fraction(threshold, "threshold", upper=1.0)
        if drift_threshold is not None:
            if isinstance(drift_threshold, bool) or not isinstance(drift_threshold, int | float):
                raise TypeError(f"drift_threshold must be a number; got {drift_threshold!r}")
            if not drift_threshold > 0 or math.isinf(drift_threshold):
                raise ValueError(f"drift_threshold must be > 0 and finite; got {drift_threshold!r}")
            drift_threshold = float(drift_threshold)
        self.drift_threshold = drift_threshold
        self.min_period = _check_int(min_period, "min_period", 1)
        self.max_period = _check_int(max_period, "max_period", 1)
        if self.max_period < self.min_period:
            raise ValueError(f"max_period must be >= min_period ({min_period}); got {max_period!r}")
        start = self.min_period if initial_period is None else initial_period
        start = _check_int(start, "initial_period", 1)
        if not self.min_period <= start <= self.max_period:
            raise ValueError(
                f"initial_period must be in [{min_period}, {max_period}]; got {initial_period!r}"
            )
        self.factor = _check_int(factor, "factor", 2)
        self.hysteresis = _check_fraction(hysteresis, "hysteresis", upper=1.0)
        self.period = start
        self.history: list[tuple[float, int]] = []  # (loss, period after it)
        self.drifts: list[float] = []  # the drift fed with each loss (nan: none)

    @staticmethod
    def _level(value: float, threshold: float, hysteresis: float) -> int:
        """1 above the threshold, -1 below the hysteresis band, 0 inside it."""
        if value > threshold:
            return 1
        if value < hysteresis * threshold or (hysteresis == 1.0 and value <= threshold):
            return -1
        return 0

    def _drift_level(self, drift: float) -> int:
        """The drift's vote: 1 above the threshold, -1 if the longer period's stays in band."""
        if drift > self.drift_threshold:
            return 1
        local_steps = self.period - 1  # the steps between two rounds the drift covers
        if local_steps:
            drift *= (self.factor * self.period - 1) / local_steps
        return min(0, self._level(drift, self.drift_threshold, self.hysteresis))

    def update(self, loss: float, drift: float | None = None) -> int:
        """Feed one measured accuracy loss (and drift, used with a drift threshold).

        Returns:
            int: the new period.
        """
        loss = _real(loss, "loss")
        if drift is not None:
            drift = _real(drift, "drift", " or None")
        level = self._level(loss, self.threshold, self.hysteresis)
        if self.drift_threshold is not None and drift is not None:
            # Either signal above its threshold shrinks; both below their bands grow.
            level = max(level, self._drift_level(drift))
        if level > 0:
            self.period = max(self.min_period, self.period // self.factor)
        elif level < 0:
            self.period = min(self.max_period, self.period * self.factor)
        self.history.append((float(loss), self.period))
        self.drifts.append(math.nan if drift is None else float(drift))
        return self.period

    def state_dict(self) -> dict:
        """``{"period", "history", "drifts"}``: what the next decisions depend on, the record."""
        return {"period": self.period, "history": list(self.history), "drifts": list(self.drifts)}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` is not from :meth:`state_dict`, or its period lies
                outside ``[min_period, max_period]``.
        """
        if not isinstance(state, dict) or "period" not in state:
            raise ValueError(
                f"state must be a dict from PeriodController.state_dict(); got {state!r}"
            )
        period = int(state["period"])
        if not self.min_period <= period <= self.max_period:
            raise ValueError(
                f"state['period'] = {period} is outside [{self.min_period}, {self.max_period}]"
            )
        self.period = period
        self.history = [(float(a), int(b)) for a, b in state.get("history", [])]
        self.drifts = [float(d) for d in state.get("drifts", [math.nan] * len(self.history))]

    def __repr__(self) -> str:
        return (
            f"PeriodController(period={self.period}, threshold={self.threshold}, "
            f"drift_threshold={self.drift_threshold}, range=[{self.min_period}, {self.max_period}])"
        )


class SkewScout:
    r"""Wrap a decentralized optimizer and set its period from probes of the accuracy loss.

    Every ``probe_every`` steps each rank sends its model (one flat vector of the trainable
    parameters) to its probe peer and receives the model of another rank: at the ``k``-th
    probe rank :math:`i` receives from :math:`(i - s) \bmod n` and sends to
    :math:`(i + s) \bmod n` with :math:`s = 1 + (k \bmod (n-1))`, so over :math:`n-1` probes
    every rank sees every other one. ``evaluate(model)`` (given by the user: the accuracy of
    ``model`` on a small sample of this rank's data, a fraction in ``[0, 1]``) is called on
    the rank's own model and on the received one (loaded into the same module for the call
    and restored after), the losses :math:`\ell_i` are allreduced (mean or max), and the
    :class:`PeriodController` turns that into the wrapped optimizer's
    ``num_steps_per_communication``. Every rank holds the same period, so rounds still pair.
    The same probe gives the drift :math:`D` (see the module): :meth:`step` adds up
    :math:`\sum_g \eta_g^2 \lVert g \rVert^2` of the gradients each step leaves and keeps
    the local displacement :math:`\Delta_i` of the last period (a copy of the parameters
    after each round, taken at the next step, after the wrapped optimizer has written the
    round's result); the probe sends :math:`\Delta_i` with the model, and the squared
    distance between the two displacements is set against the mean step; it is reduced with
    the loss in the same allreduce and used where the controller has a ``drift_threshold``.
    Where the model has more than ``sketch_size`` trainable numbers, :math:`\Delta_i` travels
    as a count sketch :math:`C\Delta_i`, :math:`(C v)_b = \sum_{j: h(j) = b} s_j v_j`, with
    buckets :math:`h(j)` uniform in ``[0, sketch_size)`` and signs :math:`s_j = \pm 1` drawn
    from a generator seeded with the probe's index (the same on every rank), so
    :math:`\lVert C\Delta_i - C\Delta_{p(i)} \rVert^2` estimates the squared distance
    without bias (relative standard deviation about :math:`\sqrt{2/\text{sketch\_size}}` per
    rank, less in the mean over ranks) for a few kilobytes instead of a second model.

    A new period takes effect at the next multiple of it (the wrapped optimizer communicates
    when its step count is a multiple of the period). A probe costs one model's bytes per
    rank plus :math:`\Delta_i` (``sketch_size`` numbers, or a second model's bytes where the
    model is smaller) plus an allreduce of three floats; buffers (BatchNorm statistics) are
    not exchanged, so ``evaluate`` sees the peer's parameters with this rank's buffers.

    Args:
        optimizer (DecentralizedOptimizer): the averaging optimizer whose period is tuned
            (``AdaptThenCombine``, ``AdaptWithCombine``, ...). Not ``GradientAllreduce``
            (its period means gradient accumulation, and its models never differ) nor
            exact diffusion (it needs a period of 1).
        evaluate (Callable[[nn.Module], float]): accuracy of a model on this rank's probe
            sample; called with the optimizer's model, in evaluation mode, without gradients.
        controller (PeriodController, optional): the rule; default ``PeriodController()``.
        probe_every (int): steps between probes.
        reduce (str): ``"mean"`` or ``"max"`` of the ranks' losses.
        sketch_size (int, optional): the count sketch's size for :math:`\Delta_i`; ``None``
            sends :math:`\Delta_i` in full (an exact drift for a second model's bytes).

    Example:
        >>> atc = AdaptThenCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
        >>> opt = SkewScout(atc, lambda m: accuracy(m, x_probe, y_probe))
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()     # a local step; averaging only every opt.period steps
    """

    @agreed()
    def __init__(
        self,
        optimizer: DecentralizedOptimizer,
        evaluate: Callable[[nn.Module], float],
        *,
        controller: PeriodController | None = None,
        probe_every: int = 20,
        reduce: str = "mean",
        sketch_size: int | None = 256,
    ) -> None:
        if not isinstance(optimizer, DecentralizedOptimizer):
            raise TypeError(
                f"optimizer must be a gossamer DecentralizedOptimizer; got {optimizer!r}"
            )
        if isinstance(optimizer, GradientAllreduce) or getattr(optimizer, "exact_diffusion", False):
            raise ValueError(
                f"SkewScout tunes the averaging period of a gossip optimizer; {optimizer!r} "
                "cannot change its period (gradient allreduce, or exact diffusion)"
            )
        if not callable(evaluate):
            raise TypeError(f"evaluate must be callable; got {evaluate!r}")
        if controller is None:
            controller = PeriodController()
        elif not isinstance(controller, PeriodController):
            raise TypeError(f"controller must be a PeriodController; got {controller!r}")
        if len(optimizer.models) != 1:
            raise ValueError(
                f"SkewScout probes one model; the optimizer holds {len(optimizer.models)}"
            )
        self.probe_every = _check_int(probe_every, "probe_every", 1)
        if reduce not in _REDUCTIONS:
            raise ValueError(f"reduce must be one of {_REDUCTIONS}; got {reduce!r}")
        self.reduce = reduce
        self.sketch_size = (
            None if sketch_size is None else _check_int(sketch_size, "sketch_size", 1)
        )
        self.inner = optimizer
        self.model = optimizer.models[0]
        self.evaluate = evaluate
        self.controller = controller
        self.probes = 0
        self.probe_bytes = 0  # model bytes this rank sent for probes
        self.last_loss: float | None = None
        self.last_drift: float | None = None
        self._step_sizes = [0.0, 0]  # sum of sum_g lr_g^2 |g|^2 since the last probe, count
        self._params = [p for p in self.model.parameters() if p.requires_grad]
        # The model the last round left (at first: the model as given), the displacement
        # from it to the model the next round started from, and whether a round just ended.
        self._anchor = self._flat()
        self._delta = torch.zeros_like(self._anchor)
        self._round_ended = False
        optimizer.num_steps_per_communication = controller.period

    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built).

        Ranks probe and change their period together, so their rules must be the same.
        """
        return {
            "probe_every": self.probe_every,
            "reduce": self.reduce,
            "sketch_size": self.sketch_size,
            **{name: getattr(self.controller, name) for name in _RULE},
        }

    # ------------------------------------------------------------ torch.optim look-alike
    @property
    def period(self) -> int:
        """Steps between averaging rounds now."""
        return self.controller.period

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer inside the wrapped one (for a learning-rate scheduler)."""
        return self.inner.optimizer

    @property
    def steps(self) -> int:
        """The wrapped optimizer's step count."""
        return self.inner.steps

    @property
    def param_groups(self) -> list[dict]:
        """The wrapped torch optimizer's parameter groups."""
        return self.inner.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients."""
        self.inner.zero_grad(set_to_none=set_to_none)

    def synchronize(self) -> None:
        """Finish the wrapped optimizer's communication in flight."""
        self.inner.synchronize()

    #: a loss scaler's ``grad_scale`` and ``found_inf`` go on to the wrapped optimizer
    _step_supports_amp_scaling = True

    def _inner_step(self, closure):
        scaler = {k: getattr(self, k) for k in ("grad_scale", "found_inf") if hasattr(self, k)}
        vars(self.inner).update(scaler)
        try:
            return self.inner.step(closure)
        finally:
            for key in scaler:
                delattr(self.inner, key)

    def step(self, closure=None):
        """The wrapped optimizer's step; every ``probe_every`` steps, a probe (collective)."""
        is_round = self._next_is_round()
        if self._round_ended and not is_round:
            # The first step without communication after a round: the round's result is in
            # the parameters once synchronized (ATC writes it in the forward pass: no wait).
            # A step that is a round itself is skipped, so period 1 keeps its overlap.
            self.inner.synchronize()
            self._anchor = self._flat()
        loss = self._inner_step(closure)
        self._record_step_size()
        if self.inner.steps % self.probe_every == 0:
            self.probe()
        if self._next_is_round():  # at the new period, if the probe changed it
            # The next step ends with a round: this step's model is the one it starts from.
            # (Zero when no step without communication lies between the two rounds.)
            if is_round:
                self._delta.zero_()  # in place: at period 1 this runs every step
            else:
                self._delta = self._flat() - self._anchor
        self._round_ended = is_round
        return loss

    def _next_is_round(self) -> bool:
        return (self.inner.steps + 1) % self.inner.num_steps_per_communication == 0

    def _flat(self) -> torch.Tensor:
        return nn.utils.parameters_to_vector(self._params).detach().clone()

    # ------------------------------------------------------------ the probe
    def _record_step_size(self) -> None:
        """Add this step's squared plain gradient step, sum_g lr_g^2 |g|^2 (the drift's unit)."""
        total = 0.0
        with torch.no_grad():
            for group in self.inner.param_groups:
                grads = [p.grad for p in group["params"] if p.grad is not None]
                if grads:
                    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
                    total += float(group.get("lr", 0.0)) ** 2 * float(norm) ** 2
        self._step_sizes[0] += total
        self._step_sizes[1] += 1

    def _peers(self) -> tuple[int, int]:
        n, me = context.size(), context.rank()
        shift = 1 + self.probes % (n - 1)
        return (me - shift) % n, (me + shift) % n

    def probe(self) -> float:
        """Measure the accuracy loss against a peer, update the period; return the loss.

        Collective: every rank must call it at the same step (:meth:`step` does).
        """
        self.inner.synchronize()
        params = self._params
        own = self._flat()
        if context.size() == 1:
            peer, peer_delta, own_delta = own, self._delta, self._delta
        else:
            src, dst = self._peers()
            delta = self._sketch(self._delta)
            sent = torch.cat([own, delta])
            received = ops.neighbor_allreduce(
                sent, self_weight=0.0, src_weights={src: 1.0}, dst_weights=[dst]
            )
            peer, peer_delta = received[: own.numel()], received[own.numel() :]
            self.probe_bytes += sent.numel() * sent.element_size()
            own_delta = delta
        mine = self._accuracy()
        _write(peer, params)
        try:
            theirs = self._accuracy()
        finally:
            _write(own, params)
        total, count = self._step_sizes
        self._step_sizes = [0.0, 0]
        distance = float((own_delta.double() - peer_delta.double()).pow(2).sum())
        step_size = total / count if count else 0.0
        local = torch.tensor([mine - theirs, distance, step_size], dtype=torch.float64)
        if context.size() > 1:
            if self.reduce == "mean":
                local = ops.allreduce(local)
            else:  # max over ranks = the max of each rank's values, gathered
                local = ops.allgather(local.reshape(1, 3)).max(dim=0).values
        self.probes += 1
        self.last_loss = float(local[0])
        # The ratio of the (mean or max) drift and step size: one number on every rank.
        self.last_drift = float(local[1] / local[2]) if local[2] > 0 else 0.0
        self.inner.num_steps_per_communication = self.controller.update(
            self.last_loss, self.last_drift
        )
        return self.last_loss

    def _sketch(self, delta: torch.Tensor) -> torch.Tensor:
        """``delta``'s count sketch for this probe (``delta`` itself where it is no larger)."""
        size = self.sketch_size
        if size is None or delta.numel() <= size:
            return delta
        generator = torch.Generator().manual_seed(self.probes)
        buckets = torch.randint(size, (delta.numel(),), generator=generator)
        signs = torch.randint(2, (delta.numel(),), generator=generator).to(delta.dtype) * 2 - 1
        sketch = torch.zeros(size, dtype=delta.dtype, device=delta.device)
        return sketch.index_add_(0, buckets.to(delta.device), signs.to(delta.device) * delta)

    def _accuracy(self) -> float:
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                value = self.evaluate(self.model)
        finally:
            self.model.train(was_training)
        if isinstance(value, torch.Tensor):
            value = float(value)
        if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
            raise TypeError(f"evaluate must return a number; got {value!r}")
        return float(value)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """``{"optimizer": <the wrapped one's>, "skewscout": {"probes", "controller", ...}}``."""
        return {
            "optimizer": self.inner.state_dict(),
            "skewscout": {
                "probes": self.probes,
                "probe_bytes": self.probe_bytes,
                "last_loss": self.last_loss,
                "last_drift": self.last_drift,
                "step_sizes": list(self._step_sizes),
                "anchor": self._anchor.clone(),
                "delta": self._delta.clone(),
                "round_ended": self._round_ended,
                "controller": self.controller.state_dict(),
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (the period included).

        Raises:
            ValueError: ``state`` is not a dict from :meth:`state_dict`.
        """
        if not isinstance(state, dict) or {"optimizer", "skewscout"} - set(state):
            raise ValueError("state must be a dict from SkewScout.state_dict()")
        ours = state["skewscout"]
        if not isinstance(ours, dict) or {"probes", "controller"} - set(ours):
            raise ValueError(
                "state['skewscout'] must hold probes and controller (SkewScout.state_dict()); "
                f"got {ours!r}"
            )
        self.inner.load_state_dict(state["optimizer"])
        self.controller.load_state_dict(ours["controller"])
        self.probes = int(ours["probes"])
        self.probe_bytes = int(ours.get("probe_bytes", 0))
        self.last_loss = ours.get("last_loss")
        self.last_drift = ours.get("last_drift")
        total, count = ours.get("step_sizes", (0.0, 0))
        self._step_sizes = [float(total), int(count)]
        for name in ("anchor", "delta"):
            if name in ours:
                value = torch.as_tensor(ours[name])
                if value.shape != self._anchor.shape:
                    raise ValueError(
                        f"state['skewscout']['{name}'] has shape {tuple(value.shape)}; this "
                        f"model's trainable parameters have {self._anchor.numel()} elements"
                    )
                setattr(self, f"_{name}", value.to(self._anchor).clone())
        self._round_ended = bool(ours.get("round_ended", False))
        self.inner.num_steps_per_communication = self.controller.period

    def close(self) -> None:
        """Close the wrapped optimizer."""
        self.inner.close()

    def __repr__(self) -> str:
        return f"SkewScout({self.inner!r}, {self.controller!r})"
