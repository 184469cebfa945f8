"""Bagua's tensor helpers (``bagua.torch_api.utils``): flattening and flattened calls.

``flatten`` and ``unflatten`` do what torch's private dense-tensor helpers, which Bagua
exports under these names, do. Bagua's autotune statistics (``StatisticalAverage``,
``average_by_removing_extreme_values``) are not ported: there is no autotune service.

Example:
    >>> import torch
    >>> from gossamer.bagua.utils import flatten, unflatten
    >>> a, b = torch.ones(2), torch.zeros(1, 2)
    >>> flat = flatten([a, b])
    >>> [t.shape for t in unflatten(flat, [a, b])]
    [torch.Size([2]), torch.Size([1, 2])]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "apply_flattened_call",
    "apply_flattened_call_all",
    "check_contiguous",
    "flatten",
    "get_flattened_tensor",
    "to_bagua_datatype",
    "unflatten",
]

_DATATYPES = {torch.float32: "f32", torch.float16: "f16", torch.uint8: "u8", torch.int64: "i64"}


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One new 1-d tensor holding ``tensors`` one after another."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflatten(flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """Views of ``flat`` cut and shaped as ``tensors`` (the inverse of :func:`flatten`)."""
    parts = flat.split([t.numel() for t in tensors])
    return tuple(part.view_as(t) for part, t in zip(parts, tensors, strict=True))


def apply_flattened_call(
    bucket: Sequence[torch.Tensor],
    call: Callable[..., Any],
    extra_args: Sequence[Any] | None = None,
) -> None:
    r"""Run ``call(flat, *extra_args)`` on the tensors flattened into one; write the result back.

    As in Bagua, when ``call`` is ``torch.distributed.all_reduce`` the sum is divided by the
    world size, so the tensors end as the average :math:`\frac1n \sum_r x_r`.
    """
    flat = flatten(list(bucket))
    call(flat, *(extra_args or ()))
    if call is dist.all_reduce:
        flat /= dist.get_world_size()
    for tensor, synced in zip(bucket, unflatten(flat, list(bucket)), strict=True):
        tensor.copy_(synced)


def apply_flattened_call_all(tensors: Sequence[torch.Tensor], call: Callable[..., Any]) -> None:
    """:func:`apply_flattened_call` once per tensor type (dtype and device), in first-seen order."""
    groups: dict[str, list[torch.Tensor]] = {}
    for tensor in tensors:
        groups.setdefault(tensor.type(), []).append(tensor)
    for group in groups.values():
        apply_flattened_call(group, call)


def check_contiguous(tensors: Sequence[torch.Tensor]) -> bool:
    """True when each tensor's storage starts where the previous one's ends."""
    end = None
    for tensor in tensors:
        if end is not None and tensor.data_ptr() != end:
            return False
        end = tensor.data_ptr() + tensor.numel() * tensor.element_size()
    return True


def get_flattened_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """A new 1-d tensor of the tensors one after another, with the first one's dtype and device.

    None for no tensors.
    """
    if not tensors:
        return None
    return flatten([t.to(tensors[0]) for t in tensors])


def to_bagua_datatype(datatype: torch.dtype) -> str:
    """Bagua's name for ``datatype``: ``"f32"``, ``"f16"``, ``"u8"`` or ``"i64"``.

    Raises:
        ValueError: any other dtype.
    """
    if datatype not in _DATATYPES:
        raise ValueError(f"unsupported data type {datatype}.")
    return _DATATYPES[datatype]
