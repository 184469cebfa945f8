"""Bagua's DDP-style wrapper: ``DistributedDataParallel(module, optimizers=..., algorithm=...)``.

It keeps torch DDP's constructor (``device_ids``, ``process_group``, ``bucket_cap_mb``,
``find_unused_parameters``, ...) plus Bagua's ``optimizers`` and ``algorithm``, and runs
the algorithm with the same engine as ``with_bagua``. Like Bagua, options it does not
support (``output_device``, ``dim != 0``, ``broadcast_buffers=False``,
``check_reduction=True``, several ``device_ids``) fall back to torch's own
``DistributedDataParallel`` (gradient allreduce) with a warning.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gossamer.bagua._groups import BaguaProcessGroup, default_group, from_torch_group
from gossamer.bagua.algorithms.base import Algorithm
from gossamer.bagua.algorithms.gradient_allreduce import GradientAllReduceAlgorithm
from gossamer.bagua.data_parallel.bagua_distributed import BaguaDistributedDataParallel

__all__ = ["DistributedDataParallel", "DistributedDataParallel_V1_9_0", "to_bagua_process_group"]


def to_bagua_process_group(process_group: Any = None) -> BaguaProcessGroup:
    """The Bagua group for a torch group, a Bagua group, or None (the default group).

    Raises:
        TypeError: anything else.
    """
    if process_group is None:
        return default_group()
    if isinstance(process_group, BaguaProcessGroup):
        return process_group
    if isinstance(process_group, dist.ProcessGroup):
        return from_torch_group(process_group)
    raise TypeError(f"process_group must be a torch or Bagua process group; got {process_group!r}")


def _check_module(module: nn.Module, device_ids: list[int | torch.device] | None) -> None:
    """Raise ValueError unless ``device_ids`` and the module's devices can be wrapped.

    The engine refuses a module without trainable parameters (for ``with_bagua`` too).
    """
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError(
            f"device_ids can only be None or contain a single element; got {device_ids}"
        )
    devices = sorted({p.device.type for p in module.parameters()})
    if len(devices) != 1:
        raise ValueError(f"the module's parameters must be on one type of device; got {devices}")


class DistributedDataParallel_V1_9_0(nn.Module):
    """A module that trains ``module`` data-parallel with a Bagua algorithm.

    Built by :func:`DistributedDataParallel`; ``forward`` calls the wrapped module.
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        dim: int = 0,
        broadcast_buffers: bool = True,
        process_group: Any = None,
        bucket_cap_mb: int = 25,
        find_unused_parameters: bool = False,
        check_reduction: bool = False,
        gradient_as_bucket_view: bool = True,
        optimizers: list[torch.optim.Optimizer] | None = None,
        algorithm: Algorithm | None = None,
    ) -> None:
        super().__init__()

        def checks() -> None:
            _check_module(module, device_ids)

        group = to_bagua_process_group(process_group)
        name = getattr(module, "_bagua_module_name", None) or f"{type(self).__name__}_{id(module)}"
        # Kept out of the module tree (a plain attribute), as the engine is not a module.
        # The checks above run inside the engine's one meeting of the ranks, so a rank that
        # rejects its module or device_ids makes its peers raise PeerArgumentError at once.
        self.__dict__["inner"] = BaguaDistributedDataParallel(
            module,
            list(optimizers or []),
            algorithm if algorithm is not None else GradientAllReduceAlgorithm(),
            process_group=group,
            bagua_module_name=name,
            gradient_as_bucket_view=gradient_as_bucket_view,
            find_unused_parameters=find_unused_parameters,
            extra_checks=checks,
            caller="DistributedDataParallel",
        )
        module._bagua_module_name = name
        self.module = module
        self.device = next(module.parameters()).device
        self.broadcast_buffers = broadcast_buffers
        self.find_unused_parameters = find_unused_parameters

    @property
    def inner(self) -> BaguaDistributedDataParallel:
        """The engine."""
        return self.__dict__["inner"]

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """The wrapped module's forward."""
        return self.module(*inputs, **kwargs)

    @property
    def require_backward_grad_sync(self) -> bool:
        """Whether backward passes communicate (False inside :meth:`no_sync`)."""
        return self.inner.require_backward_grad_sync

    @property
    def parameters_to_ignore(self) -> list[str]:
        """Names of parameters left out of communication."""
        return self.inner.parameters_to_ignore

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        old = self.inner.require_backward_grad_sync
        self.inner.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.inner.require_backward_grad_sync = old

    @property
    def bagua_algorithm(self) -> Any:
        """The algorithm implementation."""
        return self.inner.bagua_algorithm

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers."""
        return self.inner.bagua_optimizers

    @property
    def bagua_buckets(self) -> list[Any]:
        """The algorithm's buckets."""
        return self.inner.bagua_buckets


def DistributedDataParallel(
    module: nn.Module,
    device_ids: list[int | torch.device] | None = None,
    output_device: int | torch.device | None = None,
    dim: int = 0,
    broadcast_buffers: bool = True,
    process_group: Any = None,
    bucket_cap_mb: int = 25,
    find_unused_parameters: bool = False,
    check_reduction: bool = False,
    gradient_as_bucket_view: bool = True,
    optimizers: list[torch.optim.Optimizer] = [],  # noqa: B006 - Bagua's signature
    algorithm: Algorithm = GradientAllReduceAlgorithm(),  # noqa: B008 - Bagua's signature
) -> nn.Module:
    """Torch DDP's interface plus Bagua's ``optimizers`` and ``algorithm``.

    Args:
        module (nn.Module): the model, on its device.
        device_ids (list, optional): at most one device (the module's).
        output_device (int | torch.device, optional): must be None.
        dim (int): must be 0.
        broadcast_buffers (bool): must be True (buffers are broadcast once, at wrap time).
        process_group (ProcessGroup | BaguaProcessGroup, optional): default: all ranks.
        bucket_cap_mb (int): not used: buckets are Bagua's 10 MiB.
        find_unused_parameters (bool): accepted; unused parameters always work.
        check_reduction (bool): must be False.
        gradient_as_bucket_view (bool): Bagua's ``do_flatten``: the communicated tensors
            become slices of their bucket's flat buffer (no packing copy).
        optimizers (list[torch.optim.Optimizer]): the model's optimizers.
        algorithm (Algorithm): the Bagua algorithm (default: gradient allreduce).

    Returns:
        A :class:`DistributedDataParallel_V1_9_0` module, or torch's
        ``DistributedDataParallel`` for options Bagua does not support.

    Example:
        >>> algorithm = ByteGradAlgorithm()  # doctest: +SKIP
        >>> ddp = DistributedDataParallel(model, optimizers=[opt], algorithm=algorithm)
        >>> loss_fn(ddp(x), y).backward()
    """
    supported = [
        device_ids is None or len(device_ids) <= 1,
        output_device is None,
        dim == 0,
        broadcast_buffers is True,
        check_reduction is False,
    ]
    if not all(supported):
        warnings.warn(
            "some arguments of DistributedDataParallel are not supported by Bagua's "
            "algorithms; falling back to torch.nn.parallel.DistributedDataParallel",
            stacklevel=2,
        )
        return nn.parallel.DistributedDataParallel(
            module,
            device_ids=device_ids,
            output_device=output_device,
            dim=dim,
            broadcast_buffers=broadcast_buffers,
            process_group=process_group if isinstance(process_group, dist.ProcessGroup) else None,
            bucket_cap_mb=bucket_cap_mb,
            find_unused_parameters=find_unused_parameters,
            gradient_as_bucket_view=gradient_as_bucket_view,
        )
    return DistributedDataParallel_V1_9_0(
        module,
        device_ids=device_ids,
        output_device=output_device,
        dim=dim,
        broadcast_buffers=broadcast_buffers,
        process_group=process_group,
        bucket_cap_mb=bucket_cap_mb,
        find_unused_parameters=find_unused_parameters,
        check_reduction=check_reduction,
        gradient_as_bucket_view=gradient_as_bucket_view,
        optimizers=optimizers,
        algorithm=algorithm,
    )
