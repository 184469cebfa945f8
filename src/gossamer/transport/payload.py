"""Payloads as raw bytes: any dtype travels, whatever kernels the backend has.

gloo has no kernels for some dtypes (int16, the wider unsigned types) and NCCL for others
(bool, complex in point-to-point), so every operation that only *moves* data (broadcast,
allgather, point-to-point exchanges) moves a ``uint8`` view of a contiguous tensor. The
receiver knows dtype and shape from the call header and views its bytes back.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["as_bytes", "from_bytes", "nbytes_of"]


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s data (of a contiguous copy if it is not contiguous).

    Writing into the view writes into ``tensor`` when it is contiguous. 0-d tensors and
    ``bool`` work like any other.
    """
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    return tensor.reshape(-1).view(torch.uint8)


def from_bytes(data: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """``data`` (flat ``uint8``, exactly the size of the result) viewed as ``dtype[shape]``."""
    return data.view(dtype).view(tuple(shape))


def nbytes_of(dtype: torch.dtype, numel: int) -> int:
    """Bytes of ``numel`` elements of ``dtype``."""
    return numel * dtype.itemsize
