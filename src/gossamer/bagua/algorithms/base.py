"""Bagua's algorithm abstraction: declarative algorithms, implementations with hooks.

An :class:`Algorithm` holds hyper-parameters; ``reify(process_group)`` binds it to a group
as an :class:`AlgorithmImpl`, whose hooks drive the communication.

================================  ===========================================================
hook                              default
================================  ===========================================================
``need_reset()``                  False; True re-runs tensor, bucket and operation set-up
``init_tensors(ddp)``             the parameters' gradients, in reverse order
``tensors_to_buckets(ts, flat)``  one bucket per suggested group
``init_forward_pre_hook(ddp)``    nothing
``init_backward_hook(ddp)``       mark the parameter's gradient ready
``init_post_backward_hook(ddp)``  wait for the buckets' operations
``init_post_optimizer_step_hook`` nothing
``init_operations(ddp, bucket)``  nothing (algorithms append operations to the bucket)
================================  ===========================================================

A custom algorithm subclasses both and registers its name::

    class MyAlgorithm(Algorithm):
        def reify(self, process_group):
            return MyAlgorithmImpl(process_group)

    GlobalAlgorithmRegistry.register("mine", MyAlgorithm, description="...")
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import Any

import torch

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua.bucket import BaguaBucket

__all__ = ["Algorithm", "AlgorithmImpl", "GlobalAlgorithmRegistry"]


class Algorithm(abc.ABC):
    """The base of every Bagua algorithm: hyper-parameters only, no process state."""

    @abc.abstractmethod
    def reify(self, process_group: BaguaProcessGroup) -> AlgorithmImpl:
        """Create this algorithm's implementation for ``process_group``."""

    def check_optimizers(self, optimizers: list[Any]) -> None:  # noqa: B027 (an optional hook)
        """Raise ``ValueError`` if the algorithm cannot drive ``optimizers`` (any, here)."""

    @classmethod
    def init(cls, name: str, **kwargs: Any) -> Algorithm:
        """The registered algorithm ``name``, created with ``kwargs``.

        Example:
            >>> Algorithm.init("gradient_allreduce", hierarchical=True)  # doctest: +ELLIPSIS
            <gossamer.bagua.algorithms.gradient_allreduce.GradientAllReduceAlgorithm object at ...>
        """
        return GlobalAlgorithmRegistry.get(name)(**kwargs)


class AlgorithmImpl:
    """The base of every algorithm implementation.

    Each hook receives the engine,
    :class:`~gossamer.bagua.data_parallel.bagua_distributed.BaguaDistributedDataParallel`.

    Args:
        process_group (BaguaProcessGroup): the ranks the algorithm runs on.
    """

    def __init__(self, process_group: BaguaProcessGroup) -> None:
        self.process_group = process_group

    def need_reset(self) -> bool:
        """True when the tensors, buckets and operations must be set up again."""
        return False

    def init_tensors(self, bagua_ddp: Any) -> list[torch.Tensor]:
        """The Bagua tensors to communicate: the parameters' gradients, reversed."""
        parameters = bagua_ddp.bagua_build_params()
        tensors = [
            param.bagua_ensure_grad().ensure_bagua_tensor(
                name,
                bagua_ddp.bagua_module_name,
                getter_closure=lambda p: p.grad,
                setter_closure=lambda p, t: setattr(p, "grad", t),
            )
            for name, param in reversed(parameters)
        ]
        self._communication_tensor_names = {name for name, _ in parameters}
        return tensors

    def tensors_to_buckets(
        self, tensors: list[list[torch.Tensor]], do_flatten: bool
    ) -> list[BaguaBucket]:
        """One bucket per group of the suggested split."""
        return [
            BaguaBucket(group, flatten=do_flatten, name=str(i)) for i, group in enumerate(tensors)
        ]

    def init_forward_pre_hook(self, bagua_ddp: Any) -> Callable[[Any], None]:
        """The function run before each training forward pass (with its inputs)."""

        def hook(input: Any) -> None:
            pass

        return hook

    def init_backward_hook(self, bagua_ddp: Any) -> Callable[[str, torch.Tensor], None]:
        """The function run when a parameter's gradient is ready: mark it ready."""

        def hook(parameter_name: str, parameter: torch.Tensor) -> None:
            if parameter_name in getattr(self, "_communication_tensor_names", ()):
                parameter.bagua_mark_communication_ready()

        return hook

    def init_post_backward_hook(self, bagua_ddp: Any) -> Callable[[], None]:
        """The function run at the end of the backward pass: wait for the buckets."""

        def hook() -> None:
            bagua_ddp._bagua_backend.wait_pending_comm_ops()

        return hook

    def init_post_optimizer_step_hook(
        self, bagua_ddp: Any
    ) -> Callable[[torch.optim.Optimizer], None]:
        """The function run after each ``optimizer.step()`` (with the optimizer)."""

        def hook(optimizer: torch.optim.Optimizer) -> None:
            pass

        return hook

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """Append this algorithm's operations to ``bucket``."""


class _AlgorithmRegistry(dict):
    """Algorithms by name: ``{"name": {"algorithm": cls, "description": str}}``."""

    def register(self, name: str, algorithm: Callable, description: str | None = None) -> None:
        """Register ``algorithm`` (a class) under ``name``.

        Raises:
            TypeError: ``name`` is not a str. ValueError: ``name`` is taken.
        """
        if not isinstance(name, str):
            raise TypeError(f"name must be a str; got {name!r}")
        if name in self:
            raise ValueError(f"{name!r} is already present in the registry")
        self[name] = {"algorithm": algorithm, "description": description or ""}

    def get(self, name: str) -> Callable:  # type: ignore[override]
        """The algorithm class registered as ``name``.

        Raises:
            KeyError: no such name (the message lists the registered ones).
        """
        if name in self:
            return self[name]["algorithm"]
        available = ", ".join(sorted(self)) or "none"
        raise KeyError(f"{name!r} not found in registry. Available names: {available}")

    def available_algorithms(self) -> list[str]:
        """The registered names."""
        return list(self)

    def __str__(self) -> str:
        return "Registered Algorithms: " + ", ".join(self)


#: every algorithm by name (``Algorithm.init(name, ...)`` looks here)
GlobalAlgorithmRegistry = _AlgorithmRegistry()
