"""Bookkeeping of hook-driven overlap: which buckets are ready, which modules read which.

An optimizer that works bucket by bucket during the backward pass (adapt-then-combine)
needs two maps: from a parameter's gradient hook to the bucket it completes
(:class:`Arrivals`), and from a module's forward pre-hook to the buckets whose combine the
module must wait for (:func:`module_buckets`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from gossamer.fusion import Bucket

__all__ = ["Arrivals", "module_buckets"]


class Arrivals:
    """The parameters whose gradient arrived during the step under way, per bucket.

    Args:
        buckets (Sequence[Bucket]): the optimizer's buckets.
        names (Mapping[torch.Tensor, str]): each parameter's name, for error messages.
    """

    def __init__(self, buckets: Sequence[Bucket], names: Mapping[torch.Tensor, str]) -> None:
        self._bucket_of = {p: i for i, b in enumerate(buckets) for p in b.tensors}
        self._sizes = [len(b.tensors) for b in buckets]
        self._names = names
        self.reset()

    def reset(self) -> None:
        """Forget the arrivals: a new step begins."""
        self._seen: set[torch.Tensor] = set()
        self._missing = list(self._sizes)

    @property
    def any(self) -> bool:
        """Whether a gradient arrived since the last :meth:`reset`."""
        return bool(self._seen)

    def arrive(self, param: torch.Tensor) -> int | None:
        """Record ``param``'s gradient; the index of its bucket if that completed the bucket.

        Raises:
            RuntimeError: ``param``'s gradient already arrived in this step: a second
                backward pass before ``step()`` (the first already stepped with a partial
                gradient, which cannot be undone).
        """
        if param in self._seen:
            raise RuntimeError(
                f"the gradient of {self._names.get(param, 'a parameter')!r} arrived twice "
                "before step(): with overlap=True the local step of each bucket is taken in "
                "the backward pass that completes its gradients, so a second backward pass "
                "(gradient accumulation) must run inside optimizer.no_sync(), except the last; "
                "or construct the optimizer with overlap=False"
            )
        self._seen.add(param)
        index = self._bucket_of[param]
        self._missing[index] -= 1
        return index if self._missing[index] == 0 else None


def module_buckets(
    models: Sequence[nn.Module], buckets: Sequence[Bucket]
) -> list[tuple[nn.Module, list[int]]]:
    """Each module that owns parameters of ``buckets`` directly, with those buckets' indices.

    Only a module's own parameters count (``recurse=False``), so a module's forward pre-hook
    waits for exactly the buckets its forward reads; modules owning none are left out.
    """
    index_of = {p: i for i, b in enumerate(buckets) for p in b.tensors}
    found: list[tuple[nn.Module, list[int]]] = []
    seen: set[int] = set()
    for model in models:
        for module in model.modules():
            if id(module) in seen:
                continue
            seen.add(id(module))
            indices = sorted(
                {index_of[p] for p in module.parameters(recurse=False) if p in index_of}
            )
            if indices:
                found.append((module, indices))
    return found
