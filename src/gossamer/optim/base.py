"""The base of every decentralized optimizer: wrap a torch optimizer, add communication.

An optimizer here owns no update rule. It holds the user's ``torch.optim`` optimizer, the
model's trainable parameters packed into fusion buckets, and a :class:`Communicator` that
says what one communication round does (which operation, which weights). Subclasses decide
*when* to communicate relative to ``optimizer.step()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

import gossamer
from gossamer import context
from gossamer.fusion import Bucket, bucketize
from gossamer.topology import Step, Topology
from gossamer.transport import Handle

__all__ = ["COMMUNICATIONS", "Communicator", "DecentralizedOptimizer"]

COMMUNICATIONS = ("neighbor_allreduce", "hierarchical_neighbor_allreduce", "allreduce", "none")
DEFAULT_FUSION_BYTES = 8 * 2**20


class Communicator:
    """What one communication round does to a flat tensor.

    Args:
        communication (str): one of :data:`COMMUNICATIONS`.
        topology (Topology, optional): static graph for ``neighbor_allreduce`` (default: the
            group's default topology).
        schedule (Iterator[Step], optional): a dynamic topology; each round takes the next
            step's send/receive ranks and weights (e.g. ``one_peer_exponential(g, rank)``).
        global_average_every (int, optional): every K-th round is a global ``allreduce``
            average instead (periodic global averaging).
    """

    def __init__(
        self,
        communication: str = "neighbor_allreduce",
        topology: Topology | None = None,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
    ) -> None:
        if communication not in COMMUNICATIONS:
            raise ValueError(
                f"communication must be one of {COMMUNICATIONS}; got {communication!r}"
            )
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
        if schedule is not None and not hasattr(schedule, "__next__"):
            raise TypeError(f"schedule must be an iterator of topology.Step; got {schedule!r}")
        if topology is not None and schedule is not None:
            raise ValueError("give topology or schedule, not both")
        if global_average_every is not None and (
            isinstance(global_average_every, bool)
            or not isinstance(global_average_every, int)
            or global_average_every < 1
        ):
            raise ValueError(
                f"global_average_every must be an int >= 1 or None; got {global_average_every!r}"
            )
        self.communication = communication
        self.topology = topology
        self.schedule = schedule
        self.global_average_every = global_average_every
        self.rounds = 0
        self.step: Step | None = None
        self._global = False

    def next_round(self) -> None:
        """Advance to the next round: pick its dynamic step or its global average."""
        self.rounds += 1
        every = self.global_average_every
        self._global = every is not None and self.rounds % every == 0
        if self.schedule is not None and not self._global:
            self.step = next(self.schedule)

    def start(self, flat: torch.Tensor) -> Handle | None:
        """Start this round's operation on ``flat``; None when there is nothing to do."""
        kind = "allreduce" if self._global else self.communication
        if kind == "none" or context.size() == 1:
            return None
        if kind == "allreduce":
            return gossamer.allreduce(flat, async_op=True)
        step = self.step
        if kind == "hierarchical_neighbor_allreduce":
            if step is None:
                return gossamer.hierarchical_neighbor_allreduce(flat, async_op=True)
            return gossamer.hierarchical_neighbor_allreduce(
                flat,
                self_weight=step.self_weight,
                src_machine_weights=step.src_weights,
                dst_machine_weights=step.dst_weights,
                async_op=True,
            )
        if step is None:
            return gossamer.neighbor_allreduce(flat, topology=self.topology, async_op=True)
        return gossamer.neighbor_allreduce(
            flat,
            self_weight=step.self_weight,
            src_weights=step.src_weights,
            dst_weights=step.dst_weights,
            async_op=True,
        )


def _models(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    models = [model] if isinstance(model, nn.Module) else list(model)
    if not models or not all(isinstance(m, nn.Module) for m in models):
        raise TypeError(f"model must be an nn.Module or a list of them; got {model!r}")
    return models


class DecentralizedOptimizer:
    """Common machinery: parameters, buckets, the communicator, counters, state.

    Args:
        optimizer (torch.optim.Optimizer): the optimizer whose ``step()`` does the update.
        model (nn.Module | Sequence[nn.Module]): the model(s) owning the optimizer's parameters.
        communication, topology, schedule, global_average_every: see :class:`Communicator`.
        num_steps_per_communication (int): communicate once every this many steps.
        fusion_threshold_bytes (int | None): bucket size; ``None`` or 0 sends every tensor
            on its own.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module | Sequence[nn.Module],
        *,
        communication: str = "neighbor_allreduce",
        topology: Topology | None = None,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
        num_steps_per_communication: int = 1,
        fusion_threshold_bytes: int | None = DEFAULT_FUSION_BYTES,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {optimizer!r}")
        if (
            isinstance(num_steps_per_communication, bool)
            or not isinstance(num_steps_per_communication, int)
            or num_steps_per_communication < 1
        ):
            raise ValueError(
                "num_steps_per_communication must be an int >= 1; got "
                f"{num_steps_per_communication!r}"
            )
        context.rank()  # NotInitializedError before gossamer.init()
        self.optimizer = optimizer
        self.models = _models(model)
        names = {p: n for m in self.models for n, p in m.named_parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
        strangers = [tuple(p.shape) for p in params if p not in names]
        if strangers:
            raise ValueError(
                f"the optimizer has parameters that are not in the model (shapes {strangers})"
            )
        self.param_names = {p: names[p] for p in params}
        # Reverse registration order approximates the order gradients become ready.
        self.params = list(reversed(params))
        self.buckets: list[Bucket] = bucketize(self.params, fusion_threshold_bytes)
        self.communicator = Communicator(communication, topology, schedule, global_average_every)
        self.num_steps_per_communication = num_steps_per_communication
        self.steps = 0
        # (bucket, handle, finish): finish maps the operation's result to the new values.
        self._pending: list[tuple[Bucket, Handle | None, Callable | None]] = []
        self._warned = False

    # -------------------------------------------------------------- torch.optim look-alike
    @property
    def param_groups(self) -> list[dict]:
        """The wrapped optimizer's parameter groups (learning-rate schedulers use these)."""
        return self.optimizer.param_groups

    @property
    def state(self) -> dict:
        """The wrapped optimizer's per-parameter state."""
        return self.optimizer.state

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (as ``torch.optim.Optimizer.zero_grad``)."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus the communication counters."""
        self.synchronize()
        return {"optimizer": self.optimizer.state_dict(), "communication": self._comm_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned."""
        if not isinstance(state, dict) or {"optimizer", "communication"} - set(state):
            raise ValueError("state must be a dict from DecentralizedOptimizer.state_dict()")
        self.optimizer.load_state_dict(state["optimizer"])
        self._load_comm_state(state["communication"])

    def _comm_state(self) -> dict:
        return {"steps": self.steps, "rounds": self.communicator.rounds}

    def _load_comm_state(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.communicator.rounds = int(state["rounds"])

    # -------------------------------------------------------------- communication
    def _is_round(self) -> bool:
        """Whether the step now under way ends with communication."""
        return (self.steps + 1) % self.num_steps_per_communication == 0

    def _start_rounds(self, buckets: Sequence[Bucket]) -> None:
        self.communicator.next_round()
        for bucket in buckets:
            self._pending.append((bucket, self.communicator.start(bucket.pack()), None))

    def synchronize(self) -> None:
        """Wait for the communication in flight and write its results into the parameters."""
        pending, self._pending = self._pending, []
        for bucket, handle, finish in pending:
            if handle is not None:
                result = handle.wait()
                bucket.unpack(result if finish is None else finish(result), lambda p: p.data)

    def _warn_once(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"Unexpected behavior: {message}", stacklevel=3)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({type(self.optimizer).__name__}, "
            f"{self.communicator.communication}, {len(self.buckets)} buckets)"
        )
