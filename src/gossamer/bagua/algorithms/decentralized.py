r"""Decentralized SGD: ranks average their *weights* with peers instead of gradients.

``DecentralizedAlgorithm`` (D-PSGD, adapt-with-combine): on a communication step the
weights are handed to the communication thread in the forward pre-hook, so averaging
overlaps the forward and backward passes; after the backward pass the averaged weights
replace the local ones and the optimizer applies the gradient taken *before* averaging:

.. math:: x_{t+1} = W x_t - \eta\, \nabla f_i(x_t)

``"all"``: :math:`W = \frac1n \mathbf{1}\mathbf{1}^\top`; ``"shift_one"``: each rank
averages with one peer, 1/2 each (:func:`~gossamer.bagua.communicators.shift_one_peer`).
Communication happens at steps :math:`1, 1+k, 1+2k, \dots` for ``communication_interval``
:math:`k` (local steps in between).

``LowPrecisionDecentralizedAlgorithm``: after each optimizer step, the compressed
difference ring (:class:`~gossamer.bagua.compressed.LowPrecisionGossip`): with replicas
:math:`\hat w` (own), :math:`\hat x_l, \hat x_r` (neighbours), all starting at :math:`x_0`,

.. math:: d = x + \tfrac13(\hat x_l + \hat x_r) - \tfrac53 \hat w,\qquad
    \hat x_l \mathrel{+}= D(C(d_l)),\ \hat x_r \mathrel{+}= D(C(d_r)),\
    \hat w \mathrel{+}= D(C(d)),\ x \leftarrow \hat w.
"""

from __future__ import annotations

from typing import Any

import torch

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl
from gossamer.bagua.algorithms.gradient_allreduce import check_bool
from gossamer.bagua.bucket import BaguaBucket
from gossamer.bagua.communicators import PEER_SELECTION_MODES
from gossamer.bagua.compressed import resolve_compressor
from gossamer.topology import Topology

__all__ = [
    "DecentralizedAlgorithm",
    "DecentralizedAlgorithmImpl",
    "LowPrecisionDecentralizedAlgorithm",
    "LowPrecisionDecentralizedAlgorithmImpl",
]


def check_interval(value: object) -> int:
    """``communication_interval`` if it is an int >= 1, else ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"communication_interval must be an int >= 1; got {value!r}")
    return value


def _check_mode(mode: object) -> str:
    if mode not in PEER_SELECTION_MODES:
        raise ValueError(f"peer_selection_mode must be one of {PEER_SELECTION_MODES}; got {mode!r}")
    return mode  # type: ignore[return-value]


def _weights(bagua_ddp: Any) -> list[torch.Tensor]:
    return [
        param.ensure_bagua_tensor(name, bagua_ddp.bagua_module_name)
        for name, param in reversed(bagua_ddp.bagua_build_params())
    ]


class _Interval(AlgorithmImpl):
    communication_interval = 1

    def _should_communicate(self, bagua_ddp: Any) -> bool:
        return (bagua_ddp.bagua_train_step_counter - 1) % self.communication_interval == 0


class DecentralizedAlgorithmImpl(_Interval):
    """:class:`DecentralizedAlgorithm` bound to a process group."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.peer_selection_mode = _check_mode(peer_selection_mode)
        self.communication_interval = check_interval(communication_interval)

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """The weights themselves."""
        self.tensors = _weights(bagua_ddp)
        return self.tensors

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        """All weights in one bucket."""
        return [BaguaBucket([t for group in tensors for t in group], flatten=do_flatten, name="0")]

    def init_forward_pre_hook(self, bagua_ddp: Any):
        """On communication steps, start averaging the weights."""

        def hook(input: Any) -> None:
            if self._should_communicate(bagua_ddp):
                for tensor in self.tensors:
                    tensor.bagua_mark_communication_ready()

        return hook

    def init_backward_hook(self, bagua_ddp: Any):
        """Nothing: gradients are not communicated."""

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            return

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any):
        """On communication steps, wait and write the averaged weights."""

        def hook() -> None:
            if self._should_communicate(bagua_ddp):
                bagua_ddp._bagua_backend.wait_pending_comm_ops()
                for bucket in bagua_ddp.bagua_buckets:
                    bucket._decentralized_op.swap_in_peer_weight(bucket)

        return hook

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Averaging into a peer-weight buffer."""
        bucket.clear_ops()
        # The op owns peer_weight: it trades it with the weights' buffer every round.
        bucket._decentralized_op = bucket.append_decentralized_synchronous_op(
            peer_weight=bucket.flattened_tensor(),
            hierarchical=self.hierarchical,
            peer_selection_mode=self.peer_selection_mode,
            group=self.process_group,
        )


class LowPrecisionDecentralizedAlgorithmImpl(_Interval):
    """:class:`LowPrecisionDecentralizedAlgorithm` bound to a process group."""

    def __init__(
        self,
        process_group: BaguaProcessGroup,
        hierarchical: bool = True,
        communication_interval: int = 1,
        *,
        compression: Any = "MinMaxUInt8",
        topology: Topology | None = None,
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.communication_interval = check_interval(communication_interval)
        self.compression = compression
        self.topology = topology

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """The weights; every one must be stepped by an optimizer.

        Raises:
            RuntimeError: a parameter that no optimizer holds (name it in
                ``_bagua_params_and_buffers_to_ignore`` to leave it out).
        """
        held = {
            id(p)
            for opt in bagua_ddp.bagua_optimizers
            for g in opt.param_groups
            for p in g["params"]
        }
        for name, param in bagua_ddp.bagua_build_params():
            if id(param) not in held:
                raise RuntimeError(
                    f"module parameter {name} is not used by your optimizer(s); exclude it by "
                    "adding its name to the module's _bagua_params_and_buffers_to_ignore"
                )
        self.tensors = _weights(bagua_ddp)
        return self.tensors

    def init_backward_hook(self, bagua_ddp: Any):
        """Nothing: gradients are not communicated."""

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            pass

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any):
        """Nothing to wait for."""

        def hook() -> None:
            pass

        return hook

    def init_post_optimizer_step_hook(self, bagua_ddp: Any):
        """On communication steps, run the ring on the stepped weights and wait for it.

        A posted ring returns once its payloads are sent: the new weights need only this
        rank's difference (see :class:`~gossamer.bagua.compressed.LowPrecisionGossip`).
        """

        def hook(optimizer: torch.optim.Optimizer) -> None:
            if self._should_communicate(bagua_ddp):
                for group in optimizer.param_groups:
                    for param in group["params"]:
                        if param.is_bagua_tensor():
                            param.bagua_mark_communication_ready()
                bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """The ring with its three replicas, all starting at the current weights."""
        bucket.clear_ops()
        bucket._weight = bucket.flattened_tensor()
        bucket._left_peer_weight = bucket.flattened_tensor()
        bucket._right_peer_weight = bucket.flattened_tensor()
        bucket.append_low_precision_decentralized_synchronous_op(
            weight=bucket._weight,
            left_peer_weight=bucket._left_peer_weight,
            right_peer_weight=bucket._right_peer_weight,
            hierarchical=self.hierarchical,
            compression=self.compression,
            group=self.process_group,
            topology=self.topology,
        )


class DecentralizedAlgorithm(Algorithm):
    """Decentralized SGD: average weights with all ranks or with one peer per step.

    Args:
        hierarchical (bool): average inside each machine first; peers are then machines
            (``shift_one`` pairs machines).
        peer_selection_mode (str): ``"all"`` (global average) or ``"shift_one"`` (one
            rotating peer; any number of ranks, see
            :func:`~gossamer.bagua.communicators.shift_one_peer`).
        communication_interval (int): communicate every this many steps.
    """

    def __init__(
        self,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        communication_interval: int = 1,
    ) -> None:
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.peer_selection_mode = _check_mode(peer_selection_mode)
        self.communication_interval = check_interval(communication_interval)

    def reify(self, process_group: BaguaProcessGroup) -> DecentralizedAlgorithmImpl:
        """The implementation for ``process_group``."""
        return DecentralizedAlgorithmImpl(
            process_group, self.hierarchical, self.peer_selection_mode, self.communication_interval
        )


class LowPrecisionDecentralizedAlgorithm(Algorithm):
    """Decentralized SGD with 8-bit compressed differences on a ring (Bagua's DCD-PSGD).

    Args:
        hierarchical (bool): average inside each machine first; the ring joins machines.
        communication_interval (int): communicate every this many steps.
        compression (str | Compressor): keyword only, beyond Bagua: ``"MinMaxUInt8"`` or any
            compressor of :mod:`gossamer.compression` (an instance or a name).
        topology (Topology, optional): keyword only, beyond Bagua: mix over this gossamer
            topology (its weights) instead of the ring with weights 1/3.
    """

    def __init__(
        self,
        hierarchical: bool = True,
        communication_interval: int = 1,
        *,
        compression: Any = "MinMaxUInt8",
        topology: Topology | None = None,
    ) -> None:
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.communication_interval = check_interval(communication_interval)
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
        resolve_compressor(compression)  # a bad name fails here, not at with_bagua
        self.compression = compression
        self.topology = topology

    def reify(self, process_group: BaguaProcessGroup) -> LowPrecisionDecentralizedAlgorithmImpl:
        """The implementation for ``process_group``."""
        return LowPrecisionDecentralizedAlgorithmImpl(
            process_group,
            self.hierarchical,
            self.communication_interval,
            compression=self.compression,
            topology=self.topology,
        )
