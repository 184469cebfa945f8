"""BlueFog's distributed optimizers and training utilities, on :mod:`gossamer.optim`.

Each ``Distributed*Optimizer`` here is a subclass of the matching core optimizer
(:class:`~gossamer.optim.AdaptWithCombine`, :class:`~gossamer.optim.AdaptThenCombine`,
:class:`~gossamer.optim.GradientAllreduce`, :class:`~gossamer.optim.WindowPut`): the core
does the algorithm, and this module only translates BlueFog's names and knobs.

* ``communication_type`` (:class:`CommunicationType`) picks the core communication.
* BlueFog's writable knobs ``self_weight``, ``src_weights``, ``dst_weights``,
  ``src_machine_weights``, ``dst_machine_weights`` and ``enable_topo_check`` are read at
  the start of every communication round, exactly as BlueFog passes them to
  ``neighbor_allreduce`` / ``hierarchical_neighbor_allreduce``: all None is the static
  default topology; ``self_weight`` and ``src_weights`` alone are static with those weights;
  with ``dst_weights`` too the round is dynamic. So a program that sets them before each
  forward pass (BlueFog's ``GetDynamicOnePeerSendRecvRanks`` pattern) runs a dynamic
  topology.
* ``synchronize()``, ``skip_synchronize()``, ``turn_on_timeline()`` and
  ``turn_off_timeline()`` behave as BlueFog's.

Unlike BlueFog, the objects are not instances of the user's optimizer class: the wrapped
``torch.optim`` optimizer is ``opt.optimizer`` (give that to learning-rate schedulers). The
differences are listed in ``docs/bluefog-migration.md``.

Example:
    >>> opt = bf.DistributedAdaptWithCombineOptimizer(
    ...     torch.optim.SGD(model.parameters(), lr=0.1), model)
    >>> send, recv = next(one_peer)      # bf.GetDynamicOnePeerSendRecvRanks(...)
    >>> opt.dst_weights = send
    >>> opt.src_weights = {r: 1 / (len(recv) + 1) for r in recv}
    >>> opt.self_weight = 1 / (len(recv) + 1)
    >>> loss_fn(model(x), y).backward()
    >>> opt.step()
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

import gossamer
from gossamer.bluefog._compat import check_weight_types, plain_weights
from gossamer.bluefog.timeline import parameter_activities
from gossamer.communicators import make
from gossamer.optim import (
    AdaptThenCombine,
    AdaptWithCombine,
    DecentralizedOptimizer,
    GradientAllreduce,
    WindowPut,
)
from gossamer.optim.base import evaluate
from gossamer.profiling import timeline

__all__ = [
    "CommunicationType",
    "DistributedAdaptThenCombineOptimizer",
    "DistributedAdaptWithCombineOptimizer",
    "DistributedAllreduceOptimizer",
    "DistributedGradientAllreduceOptimizer",
    "DistributedHierarchicalNeighborAllreduceOptimizer",
    "DistributedNeighborAllreduceOptimizer",
    "DistributedWinPutOptimizer",
]


class CommunicationType(enum.Enum):
    """What the combine of :class:`DistributedAdaptWithCombineOptimizer` and ATC does."""

    neighbor_allreduce = "neighbor.allreduce"
    hierarchical_neighbor_allreduce = "hierarchical.neighbor.allreduce"
    allreduce = "allreduce"
    empty = "empty"


_TO_CORE = {
    CommunicationType.neighbor_allreduce: "neighbor_allreduce",
    CommunicationType.hierarchical_neighbor_allreduce: "hierarchical_neighbor_allreduce",
    CommunicationType.allreduce: "allreduce",
    CommunicationType.empty: "none",
}
_FROM_CORE = {name: kind for kind, name in _TO_CORE.items()}


def _core_communication(value: object) -> str:
    """The core communication name for a :class:`CommunicationType` (or its value)."""
    if not isinstance(value, CommunicationType):
        try:
            value = CommunicationType(value)
        except (ValueError, TypeError):
            raise ValueError(
                f"communication_type must be a CommunicationType; got {value!r}"
            ) from None
    return _TO_CORE[value]


class _BlueFogOptimizer(DecentralizedOptimizer):
    """BlueFog's common methods on a core optimizer (a mixin placed before the core class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._should_synchronize = True
        self._timeline_handles: list[Any] = []
        # BlueFog turns its timeline hooks on when BLUEFOG_TIMELINE is set (bf.init starts it).
        if timeline.timeline_enabled():
            self.turn_on_timeline()

    # ------------------------------------------------------------------ synchronization
    def _in_flight(self) -> bool:
        """Whether communication was started that :meth:`synchronize` has not finished."""
        return bool(self._pending)

    def synchronize(self) -> None:
        """Wait for the communication in flight and write its results; no-op if none."""
        if self._in_flight():
            super().synchronize()

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Declare that :meth:`step` inside needs no synchronization (BlueFog's, Horovod's).

        For the pattern ``synchronize()``, change the gradients or parameters,
        ``with skip_synchronize(): step()``. :meth:`synchronize` is a no-op when nothing is
        in flight, so the step does no second communication. If communication *is* in flight
        at such a step, it is still waited for (BlueFog would step without it), with a
        one-time ``Unexpected behavior`` warning.
        """
        previous, self._should_synchronize = self._should_synchronize, False
        try:
            yield
        finally:
            self._should_synchronize = previous

    def _check_skip(self) -> None:
        if not self._should_synchronize and self._in_flight():
            self._warn_once(
                "step() inside skip_synchronize() with communication in flight; it is waited "
                "for. Call synchronize() before the skip_synchronize() block."
            )

    def step(self, closure: Any = None) -> Any:
        """The core step (it synchronizes first, unless nothing is in flight)."""
        self._check_skip()
        return super().step(closure)

    # ------------------------------------------------------------------ state
    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output, or a plain ``torch.optim`` state dict.

        The latter is what a BlueFog checkpoint holds (its optimizer *was* the torch
        optimizer); it is loaded into the wrapped optimizer and the counters are kept.
        """
        if isinstance(state, dict) and "param_groups" in state and "optimizer" not in state:
            self.synchronize()
            self.optimizer.load_state_dict(state)
            return
        super().load_state_dict(state)

    # ------------------------------------------------------------------ timeline
    def turn_on_timeline(self) -> None:
        """Record ``FORWARD`` and ``GRADIENT COMPT.`` activities per parameter.

        Rows are named by the parameters' names. The spans are written only while gossamer's
        timeline is on (``BLUEFOG_TIMELINE``, ``GOSSAMER_TIMELINE`` or ``start_timeline``);
        the optimizer turns this on by itself when the timeline is on at its creation.
        """
        if not self._timeline_handles:
            self._timeline_handles = parameter_activities(self.param_names, self.models)

    def turn_off_timeline(self) -> None:
        """Stop recording the per-parameter activities."""
        handles, self._timeline_handles = self._timeline_handles, []
        for handle in handles:
            handle.remove()


class _Passes(_BlueFogOptimizer):
    """BlueFog's local aggregation: ``num_steps_per_communication`` counts passes, not steps.

    A step communicates once ``J = num_steps_per_communication`` passes (forward passes for
    AWC and win-put, backward passes for ATC, as BlueFog counts) have run since the last
    step that communicated. One pass per :meth:`step` communicates every J-th step; J passes
    per :meth:`step` (BlueFog's FAQ: accumulate J mini-batches) communicate at every step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._passes: int | None = None  # None: derived from steps (fresh, or after a resize)
        super().__init__(*args, **kwargs)

    def _pass_count(self) -> int:
        """Passes since the last step that communicated."""
        if self._passes is None:  # one pass per step so far
            return self.steps % self.num_steps_per_communication
        return self._passes

    def _count_pass(self) -> None:
        self._passes = self._pass_count() + 1

    def _is_round(self) -> bool:
        return self._pass_count() >= self.num_steps_per_communication

    def step(self, closure: Any = None) -> Any:
        """The core step; a step that communicated starts the pass count again.

        A ``closure`` is evaluated first (its passes count toward this step).
        """
        loss = evaluate(closure)
        communicated = self._is_round()
        super().step()
        if communicated:
            self._passes = 0
        return loss

    def _comm_state(self) -> dict:
        return {**super()._comm_state(), "passes": self._pass_count()}

    def _load_comm_state(self, state: dict) -> None:
        passes = state.get("passes")
        if passes is not None and (
            isinstance(passes, bool) or not isinstance(passes, int) or passes < 0
        ):
            raise ValueError(f"state['communication']['passes'] must be an int >= 0; got {passes}")
        super()._load_comm_state(state)
        self._passes = passes


class _ForwardPasses(_Passes):
    """Count the training-mode forward passes (gradients enabled) of the first model."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Before the core's own pre-hook, which asks _is_round() whether to start the round.
        self._hooks.append(
            self.models[0].register_forward_pre_hook(
                torch.compiler.disable(self._count_forward), prepend=True
            )
        )

    def _count_forward(self, module: nn.Module, inputs: Any) -> None:
        if module.training and torch.is_grad_enabled():
            self._count_pass()


class _BackwardPasses(_Passes):
    """Count the backward passes that reach the parameters (each once, whatever it reaches).

    ATC takes its local step and sends in the backward pass that completes the count, so a
    further backward pass before :meth:`step` is refused: its gradient would miss the step.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.requires_grad]
        if params:  # mode "any": once per backward pass, at the first of these gradients
            self._hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    params, self._count_backward, mode="any"
                )
            )

    def _count_backward(self, grad: torch.Tensor) -> None:
        if self._no_sync:
            return
        if self._is_round():
            J = self.num_steps_per_communication
            raise RuntimeError(
                f"backward pass {self._pass_count() + 1} since the last communication, "
                f"before step(): with num_steps_per_communication={J}, ATC takes its local "
                f"step and communicates in backward pass {J}, so step() must follow it (run "
                f"a number of backward passes per step() that divides {J})"
            )
        self._count_pass()

    def _grad_ready(self, param: torch.Tensor) -> None:
        try:
            super()._grad_ready(param)
        except BaseException:
            # The core restarts the step: the next backward pass takes this one's place.
            self._passes = max(self._pass_count() - 1, 0)
            raise


def _knob(name: str, doc: str) -> property:
    """A property for BlueFog's knob ``name``, passed on to the communicator of each round."""

    def get(self: Any) -> Any:
        return self._knobs[name]

    def set_(self: Any, value: Any) -> None:
        self._knobs[name] = value
        self._apply_knobs()

    return property(get, set_, doc=doc)


# knob -> the attribute of the core communicator that takes it (per communication)
_KNOB_TARGETS = {
    "neighbor_allreduce": {
        "self_weight": "self_weight",
        "src_weights": "src_weights",
        "dst_weights": "dst_weights",
        "enable_topo_check": "check_topology",
    },
    "hierarchical_neighbor_allreduce": {
        "self_weight": "self_weight",
        "src_machine_weights": "src_machine_weights",
        "dst_machine_weights": "dst_machine_weights",
    },
}


class _Combine(_Passes):
    """BlueFog's AWC and ATC knobs, handed to the core communicator the enum names."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        communication_type: CommunicationType = CommunicationType.neighbor_allreduce,
        num_steps_per_communication: int = 1,
    ) -> None:
        self._knobs: dict[str, Any] = dict.fromkeys(
            ("self_weight", "src_weights", "dst_weights"), None
        )
        self._knobs.update(src_machine_weights=None, dst_machine_weights=None)
        self._knobs["enable_topo_check"] = False
        super().__init__(
            optimizer,
            model,
            communication=_core_communication(communication_type),
            num_steps_per_communication=num_steps_per_communication,
        )

    def _apply_knobs(self) -> None:
        targets = _KNOB_TARGETS.get(self.communicator.name, {})
        for knob, attribute in targets.items():
            value = self._knobs[knob]
            if knob == "self_weight":
                value = check_weight_types(value, None, knob)
            else:
                value = plain_weights(value)
            setattr(self.communicator, attribute, value)

    self_weight = _knob("self_weight", "Weight of this rank's own value (None: default).")
    src_weights = _knob("src_weights", "``{source rank: weight}`` (None: default topology).")
    dst_weights = _knob(
        "dst_weights", "``{destination rank: scale}`` or a rank list; set: a dynamic round."
    )
    src_machine_weights = _knob(
        "src_machine_weights", "``{source machine: weight}`` for hierarchical rounds."
    )
    dst_machine_weights = _knob(
        "dst_machine_weights", "``{destination machine: scale}`` for hierarchical rounds."
    )
    enable_topo_check = _knob(
        "enable_topo_check", "Check that dynamic sends match receives (default False)."
    )

    @property
    def communication_type(self) -> CommunicationType:
        """The combine operation; may be changed between steps."""
        return _FROM_CORE[self.communicator.name]

    @communication_type.setter
    def communication_type(self, value: CommunicationType) -> None:
        fresh = make(_core_communication(value))
        fresh.rounds = self.communicator.rounds
        self.communicator = fresh
        self._apply_knobs()


class DistributedAdaptWithCombineOptimizer(_ForwardPasses, _Combine, AdaptWithCombine):
    r"""BlueFog's AWC optimizer: :math:`x^{+} = W x - \eta\, g(x)`, on :class:`AdaptWithCombine`.

    The combine starts before the ``num_steps_per_communication``-th training forward pass
    since the last combine and overlaps the backward pass; :meth:`step` waits for it and
    takes the wrapped optimizer's step with the gradient of the pre-combine point.

    Args:
        optimizer (torch.optim.Optimizer): any torch optimizer of the model's parameters.
        model (nn.Module | list[nn.Module]): the model(s) owning them.
        communication_type (CommunicationType): the combine.
        num_steps_per_communication (int): combine once per this many forward
            passes (one per step: every this many steps; that many per step: every step).

    Raises:
        ValueError: a bad ``communication_type`` or count, or optimizer parameters that are
            not in the model.
    """


class DistributedAdaptThenCombineOptimizer(_BackwardPasses, _Combine, AdaptThenCombine):
    r"""BlueFog's ATC optimizer: :math:`x^{+} = W (x - \eta\, g(x))`, on :class:`AdaptThenCombine`.

    :meth:`step` takes the wrapped optimizer's own step (any torch optimizer, no
    ``register_step_function`` needed) bucket by bucket and starts each bucket's combine at
    once; the next forward pass (or :meth:`synchronize`) waits for the result.

    Args:
        optimizer (torch.optim.Optimizer): any torch optimizer of the model's parameters.
        model (nn.Module | list[nn.Module]): the model(s) owning them.
        communication_type (CommunicationType): the combine.
        num_steps_per_communication (int): combine once per this many backward
            passes (one per step: every this many steps; that many per step: every step).
    """


class DistributedGradientAllreduceOptimizer(_BlueFogOptimizer, GradientAllreduce):
    """BlueFog's (Horovod's) gradient-averaging optimizer, on :class:`GradientAllreduce`.

    Args:
        optimizer (torch.optim.Optimizer): any torch optimizer of the model's parameters.
        model (nn.Module | list[nn.Module]): the model(s) owning them.
        num_steps_per_communication (int): backward passes accumulated per :meth:`step`.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        num_steps_per_communication: int = 1,
    ) -> None:
        super().__init__(optimizer, model, num_steps_per_communication=num_steps_per_communication)

    def _in_flight(self) -> bool:
        # Gradients that arrived but whose bucket has not started count too.
        return bool(self._pending) or any(self._arrivals.values())


class DistributedWinPutOptimizer(_ForwardPasses, WindowPut):
    """BlueFog's asynchronous win-put optimizer, on :class:`WindowPut`.

    After the forward pass the parameters are put into the out-neighbours' windows (to
    ``dst_weights``, when set, with those scales); :meth:`synchronize` (and so :meth:`step`)
    waits for the puts and combines the window buffers into the parameters; then the wrapped
    optimizer steps. The windows are made per fusion bucket, collectively, here.

    Args:
        optimizer (torch.optim.Optimizer): any torch optimizer of the model's parameters.
        model (nn.Module | list[nn.Module]): the model(s) owning them.
        num_steps_per_communication (int): put once per this many forward passes
            (one per step: every this many steps; that many per step: every step).
        window_prefix (str, optional): accepted for compatibility; the core names the
            windows (``gossamer.live_windows()`` lists them).

    Attributes:
        dst_weights: ``{out-neighbour: scale}`` or a list of out-neighbours for the next puts
            (None: every out-neighbour, scale 1).
        force_barrier (bool): :meth:`step` starts with a barrier (default False).
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        num_steps_per_communication: int = 1,
        window_prefix: str | None = None,
    ) -> None:
        if window_prefix is not None and not isinstance(window_prefix, str):
            raise TypeError(f"window_prefix must be a str or None; got {window_prefix!r}")
        super().__init__(optimizer, model, num_steps_per_communication=num_steps_per_communication)
        self.window_prefix = window_prefix
        self.dst_weights = None
        self.force_barrier = False

    @property
    def dst_weights(self) -> Mapping[int, float] | Sequence[int] | None:
        """``{out-neighbour: scale}`` or a list of out-neighbours for the next puts."""
        return self._dst_weights

    @dst_weights.setter
    def dst_weights(self, value: Mapping[int, float] | Sequence[int] | None) -> None:
        self._dst_weights = value
        weights = plain_weights(value)
        if weights is not None and not isinstance(weights, Mapping):
            weights = dict.fromkeys(weights, 1.0)  # type: ignore[arg-type]
        self.communicator.dst_weights = (
            None if weights is None else {int(d): float(w) for d, w in weights.items()}
        )

    def synchronize(self) -> None:
        """Wait for this rank's puts, then combine the window buffers into the parameters."""
        if self._in_flight():
            DecentralizedOptimizer.synchronize(self)

    def step(self, closure: Any = None) -> Any:
        """Optional barrier, :meth:`synchronize`, then the wrapped optimizer's step.

        A ``closure`` is evaluated first: its forward starts the puts.
        """
        loss = evaluate(closure)
        self._check_skip()
        if self.force_barrier:
            gossamer.barrier()
        self.synchronize()
        super().step()  # nothing in flight now: the local step
        return loss

    def unregister_window(self) -> None:
        """Free the optimizer's windows (collective); it cannot communicate afterwards."""
        self.free()


class _DeprecatedAdaptWithCombine(DistributedAdaptWithCombineOptimizer):
    """BlueFog's old optimizer names: AWC with a fixed communication, and a warning."""

    _kind: CommunicationType

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        num_steps_per_communication: int = 1,
    ) -> None:
        warnings.warn(
            f"{type(self).__name__} will be deprecated; use DistributedAdaptWithCombineOptimizer"
            f"(optimizer, model, communication_type=CommunicationType.{self._kind.name}) "
            "instead.",
            PendingDeprecationWarning,
            stacklevel=3,  # past the build's settings check (optim.agreement.agreed)
        )
        super().__init__(optimizer, model, self._kind, num_steps_per_communication)


class DistributedAllreduceOptimizer(_DeprecatedAdaptWithCombine):
    """Deprecated: AWC with :attr:`CommunicationType.allreduce`."""

    _kind = CommunicationType.allreduce


class DistributedNeighborAllreduceOptimizer(_DeprecatedAdaptWithCombine):
    """Deprecated: AWC with :attr:`CommunicationType.neighbor_allreduce`."""

    _kind = CommunicationType.neighbor_allreduce


class DistributedHierarchicalNeighborAllreduceOptimizer(_DeprecatedAdaptWithCombine):
    """Deprecated: AWC with :attr:`CommunicationType.hierarchical_neighbor_allreduce`."""

    _kind = CommunicationType.hierarchical_neighbor_allreduce
