r"""CoCoFL: constrained ranks freeze some layers and run them quantized, the rest train.

Pfeiffer, Khalili and Henkel, "CoCoFL: Communication- and Computation-Aware Federated
Learning via Partial NN Freezing and Quantization", TMLR 2023. A device too slow to train the
whole model freezes some of its layers: a frozen layer needs no weight gradient and no
optimizer state, and its forward pass can run in int8. Every device keeps the full model;
the trained layers are averaged over the devices that trained them, and frozen layers are
refreshed from that average.

What this implementation does, per parameter tensor :math:`p` and rank :math:`i` with mask
:math:`m_i(p) = 0` when :math:`i` is constrained and :math:`p` belongs to one of its frozen
layers, else 1:

- **local step**: the wrapped torch optimizer's step; frozen parameters have
  ``requires_grad=False``, get no gradient, and so are not updated (torch optimizers skip
  parameters without gradients);
- **forward of a frozen layer** on a constrained rank: ``torch.ao.nn.quantized.dynamic.Linear``
  built with ``from_float`` from the float layer (int8 weights, per-tensor scale; activations
  quantized dynamically per call, output in float);
- **averaging**, every ``num_steps_per_communication`` steps. With ``masked=True`` (the
  default for the global average) a layer is averaged over the ranks that train it, as the
  CoCoFL server does:

  .. math:: p_i \leftarrow \frac{\sum_j w_{ji}\, m_j(p)\, p_j}{\sum_j w_{ji}\, m_j(p)}

  with :math:`w` the uniform global average (``topology=None``: one allreduce) or a
  topology's weights (one neighbour allreduce); where no rank in the sum trains :math:`p`
  it is left as is. The denominators are fixed and computed once, at construction. With
  ``masked=False`` (the default on a graph) every rank averages every layer as usual,
  :math:`p_i \leftarrow \sum_j w_{ji} p_j`: a constrained rank's frozen copy (the average
  it last received) relays the layer between its neighbours. On a graph the masked rule can
  cut a layer off: on a ring where every other rank is constrained, a trainer's neighbours
  are all constrained, its masked average is itself, and the trainers never mix;
- **refresh**: after each averaging a constrained rank re-quantizes its frozen layers from
  their (averaged) float weights.

What is **not** quantized or saved: only ``nn.Linear`` layers can be frozen (dynamic
quantization; convolutions would need static quantization with calibration, not built);
trainable layers, activations between layers and everything communicated stay float32 (the
allreduce carries zeros for frozen layers, so a constrained rank saves computation and
memory, not bytes). A quantized layer passes no gradient to its input, so frozen layers must
come before every trainable layer in the forward pass; a frozen layer whose input requires a
gradient raises instead of silently cutting the gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
from torch import nn
from torch.ao.nn.quantized import dynamic as qdynamic
from torch.ao.quantization import default_dynamic_qconfig

from gossamer import context, ops
from gossamer.optim.agreement import agreed
from gossamer.optim.base import check_torch_optimizer, take_loss_scale
from gossamer.topology import Topology

__all__ = ["CoCoFL", "quantize_frozen"]


def quantize_frozen(linear: nn.Linear) -> nn.Module:
    """The int8 dynamic-quantized copy of ``linear`` (``torch.ao`` ``from_float``)."""
    if not isinstance(linear, nn.Linear):
        raise TypeError(f"only nn.Linear layers can be frozen and quantized; got {linear!r}")
    saved = getattr(linear, "qconfig", None)
    linear.qconfig = default_dynamic_qconfig
    try:
        with warnings.catch_warnings():
            # torch 2.13 marks torch.ao quantization deprecated (for torchao, which is not a
            # dependency); it is still the quantization torch ships.
            warnings.simplefilter("ignore", UserWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            return qdynamic.Linear.from_float(linear)
    finally:
        linear.qconfig = saved


class CoCoFL:
    """Partial freezing with quantized frozen layers, and masked averaging of the rest.

    Args:
        optimizer (torch.optim.Optimizer): the local optimizer (over all or only the
            trainable parameters).
        model (nn.Module): the full model, the same architecture on every rank.
        frozen (Sequence[str]): names (``model.named_modules()``) of the ``nn.Linear`` layers
            this rank freezes when ``constrained``; ignored otherwise.
        constrained (bool): whether this rank freezes ``frozen``.
        topology (Topology, optional): average with these neighbour weights; default: the
            global average (allreduce).
        num_steps_per_communication (int): average every this many steps.
        masked (bool, optional): average each layer only over the ranks that train it;
            default: True for the global average, False on a topology (see the module).

    Raises:
        TypeError: a frozen name is not an ``nn.Linear`` or an argument has the wrong type.
        ValueError: a frozen name is not in the model, or (constrained) its layer is not
            float32 on the CPU, a count is out of range, or the optimizer has parameters the
            model does not own.

    Example:
        >>> sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> opt = CoCoFL(sgd, model, frozen=["1"], constrained=gossamer.rank() % 2 == 1)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()   # trains the rest; averages every num_steps_per_communication steps
    """

    @agreed()
    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        frozen: Sequence[str] = (),
        constrained: bool = False,
        topology: Topology | None = None,
        num_steps_per_communication: int = 1,
        masked: bool | None = None,
    ) -> None:
        check_torch_optimizer(optimizer)
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module; got {model!r}")
        if (
            isinstance(frozen, str)
            or not isinstance(frozen, Sequence | set | frozenset)
            or not all(isinstance(n, str) for n in frozen)
        ):
            raise TypeError(f"frozen must be a sequence of module names; got {frozen!r}")
        if not isinstance(constrained, bool):
            raise TypeError(f"constrained must be a bool; got {constrained!r}")
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer Topology or None; got {topology!r}")
        if masked is not None and not isinstance(masked, bool):
            raise TypeError(f"masked must be a bool or None; got {masked!r}")
        period = num_steps_per_communication
        if isinstance(period, bool) or not isinstance(period, int) or period < 1:
            raise ValueError(f"num_steps_per_communication must be an int >= 1; got {period!r}")
        if topology is not None and topology.size != context.size():
            raise ValueError(f"topology has {topology.size} ranks; the world has {context.size()}")
        owned = set(model.parameters())
        strangers = [
            tuple(p.shape) for g in optimizer.param_groups for p in g["params"] if p not in owned
        ]
        if strangers:  # the model averaged would not be the one trained
            raise ValueError(
                f"the optimizer has parameters that are not in the model (shapes {strangers})"
            )
        modules = dict(model.named_modules())
        missing = [n for n in frozen if n not in modules]
        if missing:
            raise ValueError(f"frozen names {missing} are not modules of the model")
        for name in frozen:
            if not isinstance(modules[name], nn.Linear):
                raise TypeError(
                    f"frozen layer {name!r} is a {type(modules[name]).__name__}; only nn.Linear "
                    "layers can be frozen (dynamic int8 quantization)"
                )
            weight = modules[name].weight
            if constrained and (weight.device.type != "cpu" or weight.dtype != torch.float32):
                raise ValueError(
                    f"frozen layer {name!r} is {weight.dtype} on {weight.device}; torch's "
                    "dynamic int8 quantization, which runs a frozen layer, takes float32 "
                    "layers on the CPU only"
                )
        self.optimizer = optimizer
        self.model = model
        self.topology = topology
        self.constrained = constrained
        self.frozen = tuple(frozen) if constrained else ()
        self.masked = topology is None if masked is None else masked
        self.num_steps_per_communication = period
        self.steps = 0
        self._closed = False
        self.rounds = 0
        self.params = [p for _, p in model.named_parameters()]
        frozen_params = {id(p) for n in self.frozen for p in modules[n].parameters()}
        unmasked = not self.masked
        self.mask = [1.0 if unmasked or id(p) not in frozen_params else 0.0 for p in self.params]
        self.quantized: dict[str, nn.Module] = {}
        self._layers = {name: modules[name] for name in self.frozen}
        # what close() gives back: the user's own choice, which may be frozen already
        self._requires_grad = {
            p: p.requires_grad for layer in self._layers.values() for p in layer.parameters()
        }
        for p in self._requires_grad:
            p.requires_grad_(False)
            p.grad = None
        self._refresh()
        # Made at the first round, a collective: after the build's settings check.
        self._weights: torch.Tensor | None = None

    # ------------------------------------------------------------ frozen layers
    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built).

        Not ``frozen`` and ``constrained``: ranks differ in what they can train.
        """
        return {
            "topology": self.topology,
            "num_steps_per_communication": self.num_steps_per_communication,
            "masked": self.masked,
        }

    def _refresh(self) -> None:
        """Re-quantize every frozen layer from its float weights and route forward to it."""
        for name, layer in self._layers.items():
            self.quantized[name] = quantize_frozen(layer)
            layer.forward = self._frozen_forward(name)

    def _frozen_forward(self, name: str):
        def forward(x: torch.Tensor) -> torch.Tensor:
            if torch.is_grad_enabled() and x.requires_grad:
                raise ValueError(
                    f"CoCoFL: frozen layer {name!r} got an input that requires a gradient: a "
                    "trainable layer runs before it, and a quantized layer passes no "
                    "gradient back; freeze only layers before every trainable one"
                )
            return self.quantized[name](x)

        return forward

    # ------------------------------------------------------------ averaging
    def _flat_mask(self) -> torch.Tensor:
        return torch.cat(
            [
                torch.full((p.numel(),), m, dtype=p.dtype, device=p.device)
                for p, m in zip(self.params, self.mask, strict=True)
            ]
        )

    def _mix(self, flat: torch.Tensor) -> torch.Tensor:
        if self.topology is None:
            return ops.allreduce(flat)
        return ops.neighbor_allreduce(flat, topology=self.topology)

    def _denominators(self) -> torch.Tensor:
        """Per element: the weight of the ranks that train it in this rank's average."""
        if context.size() == 1:
            return self._flat_mask()
        return self._mix(torch.tensor(self.mask, dtype=torch.float64))

    def average(self) -> None:
        """The masked average of every parameter (collective), then the refresh."""
        self.rounds += 1
        if context.size() > 1:
            with torch.no_grad():
                flat = torch.cat([p.detach().flatten() for p in self.params])
                mask = self._flat_mask()
                mixed = self._mix(flat * mask)
                sizes = [p.numel() for p in self.params]
                counts = torch.tensor(sizes, device=flat.device)
                if self._weights is None:
                    self._weights = self._denominators()
                weight = torch.repeat_interleave(self._weights.to(flat), counts)
                trained = weight > 0
                flat[trained] = mixed[trained] / weight[trained]
                for p, part in zip(self.params, torch.split(flat, sizes), strict=True):
                    p.copy_(part.view_as(p))
        self._refresh()

    # ------------------------------------------------------------ optimizer surface
    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups."""
        return self.optimizer.param_groups

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    #: a loss scaler hands over its scale (:func:`~gossamer.optim.base.take_loss_scale`)
    _step_supports_amp_scaling = True

    def step(self, closure=None):
        """The local step of the trainable layers; the masked average on schedule."""
        if self._closed:  # its frozen layers train again: the masks no longer hold
            raise RuntimeError("CoCoFL was closed; build a new optimizer")
        # A loss scaler's inf skips the local step only: the averages stay on schedule.
        skip = take_loss_scale(self, self.params)
        loss = None if skip else self.optimizer.step(closure)
        self.steps += 1
        if self.steps % self.num_steps_per_communication == 0:
            self.average()
        return loss

    def synchronize(self) -> None:
        """Nothing is in flight: averaging is synchronous (for a uniform optimizer API)."""

    def state_dict(self) -> dict:
        """``{"optimizer": <the torch optimizer's>, "cocofl": {"steps", "rounds", "frozen"}}``."""
        return {
            "optimizer": self.optimizer.state_dict(),
            "cocofl": {
                "steps": self.steps,
                "rounds": self.rounds,
                "frozen": list(self.frozen),
                "masked": self.masked,
            },
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output; the model's weights are loaded separately.

        Raises:
            ValueError: ``state`` is not from :meth:`state_dict`, or froze other layers, or
                was saved with another ``masked``.
        """
        if not isinstance(state, dict) or {"optimizer", "cocofl"} - set(state):
            raise ValueError("state must be a dict from CoCoFL.state_dict()")
        ours = state["cocofl"]
        if not isinstance(ours, dict) or {"steps", "rounds", "frozen"} - set(ours):
            raise ValueError(
                f"state['cocofl'] must hold steps, rounds and frozen (CoCoFL.state_dict()); "
                f"got {ours!r}"
            )
        if ours.get("masked", self.masked) != self.masked:
            raise ValueError(
                f"state was saved with masked={ours['masked']}; this optimizer has "
                f"masked={self.masked}"
            )
        if list(ours["frozen"]) != list(self.frozen):
            raise ValueError(
                f"state froze layers {ours['frozen']}; this optimizer freezes {list(self.frozen)}"
            )
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps, self.rounds = int(ours["steps"]), int(ours["rounds"])
        self._refresh()  # the model's float weights may have been loaded since

    def close(self) -> None:
        """Give the frozen layers back their float forward and their ``requires_grad``."""
        for layer in self._layers.values():
            layer.__dict__.pop("forward", None)
        for p, required in self._requires_grad.items():
            p.requires_grad_(required)
        self._layers, self.quantized, self._requires_grad = {}, {}, {}
        self._closed = True

    def __repr__(self) -> str:
        return (
            f"CoCoFL({type(self.optimizer).__name__}, constrained={self.constrained}, "
            f"frozen={list(self.frozen)}, masked={self.masked})"
        )
