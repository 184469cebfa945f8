"""``torch.nn.Module.with_bagua``: what ``import gossamer.bagua`` adds to every module.

As in Bagua, importing the package patches ``torch.nn.Module`` with :meth:`with_bagua` and
the properties ``bagua_algorithm``, ``bagua_optimizers``, ``bagua_buckets`` and
``bagua_module_name``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gossamer.bagua._groups import BaguaProcessGroup, default_group
from gossamer.bagua.data_parallel.bagua_distributed import BaguaDistributedDataParallel

__all__ = ["BaguaModule", "install"]


def _ddp(module: Any) -> BaguaDistributedDataParallel:
    ddp = module.__dict__.get("bagua_ddp")
    if ddp is None:  # AttributeError keeps hasattr() and nn.Module's lookup working
        raise AttributeError(f"{type(module).__name__} is not wrapped; call with_bagua() first")
    return ddp


class BaguaModule:
    """The members :func:`install` adds to ``torch.nn.Module`` (Bagua's ``BaguaModule``)."""

    def with_bagua(
        self,
        optimizers: list[torch.optim.Optimizer],
        algorithm: Any,
        process_group: BaguaProcessGroup | None = None,
        do_flatten: bool = True,
    ) -> nn.Module:
        """Make this module train data-parallel with ``algorithm``; return it (in place).

        At this call every rank takes rank 0's parameters, buffers and optimizer state.

        Args:
            optimizers (list[torch.optim.Optimizer]): the optimizer(s) of the module.
            algorithm (Algorithm): e.g. ``GradientAllReduceAlgorithm()``.
            process_group (BaguaProcessGroup, optional): default: all ranks.
            do_flatten (bool): Bagua's bucket flattening: the parameters (or gradients) become
                slices of their bucket's flat buffer, so no packing copy is needed; False
                packs and copies back every step. Results do not depend on it.

        Returns:
            The module itself, with ``bagua_algorithm`` and the other ``bagua_*`` members.

        Note:
            To leave parameters out of communication, put their ``state_dict`` keys in
            ``module._bagua_params_and_buffers_to_ignore``.

        Example:
            >>> algorithm = GradientAllReduceAlgorithm()  # doctest: +SKIP
            >>> model = model.with_bagua([optimizer], algorithm)
        """
        group = default_group() if process_group is None else process_group
        if not hasattr(self, "_bagua_module_name"):
            self._bagua_module_name = f"{type(self).__name__}_{id(self)}"
        self.bagua_ddp = BaguaDistributedDataParallel(
            self,  # type: ignore[arg-type]
            optimizers=optimizers,
            algorithm=algorithm,
            process_group=group,
            bagua_module_name=self._bagua_module_name,
            gradient_as_bucket_view=do_flatten,
        )
        return self  # type: ignore[return-value]

    @property
    def bagua_module_name(self) -> str:
        """The module's name; Bagua tensors find their model by it."""
        name = self.__dict__.get("_bagua_module_name")
        if name is None:
            name = self._bagua_module_name = f"{type(self).__name__}_{id(self)}"
        return name

    @bagua_module_name.setter
    def bagua_module_name(self, name: str) -> None:
        self._bagua_module_name = name

    @property
    def bagua_algorithm(self) -> Any:
        """The algorithm implementation reified by :meth:`with_bagua`."""
        return _ddp(self).bagua_algorithm

    @property
    def bagua_optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given to :meth:`with_bagua`."""
        return _ddp(self).bagua_optimizers

    @property
    def bagua_buckets(self) -> list[Any]:
        """The algorithm's buckets."""
        return _ddp(self).bagua_buckets


def install() -> None:
    """Add :class:`BaguaModule`'s members to ``torch.nn.Module`` (idempotent)."""
    for name in (
        "with_bagua",
        "bagua_module_name",
        "bagua_algorithm",
        "bagua_optimizers",
        "bagua_buckets",
    ):
        setattr(nn.Module, name, vars(BaguaModule)[name])
