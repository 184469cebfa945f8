"""Lossless pass-through and half-precision casts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from gossamer.compression.base import Compressor

__all__ = ["BF16", "FP16", "NoCompression"]


@dataclass(frozen=True, repr=False)
class NoCompression(Compressor):
    """Send the tensor's own bytes: ``D(C(x)) = x`` exactly, for every dtype.

    The payload is a view of the tensor's memory (no copy when it is contiguous), and the
    decompressed tensor a view of the buffer. Unlike the other compressors it accepts any
    dtype, integer and bool included. Registry name: ``"none"`` (also what ``None`` gives).
    """

    spec_name: ClassVar[str] = "none"
    unbiased: ClassVar[bool] = True

    def _check_dtype(self, dtype: object, argument: str) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"{argument} must be a torch.dtype; got {dtype!r}")

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.view(torch.uint8)

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if buffer.storage_offset() % dtype.itemsize:  # misaligned slice of a larger buffer
            buffer = buffer.clone()
        return buffer.view(dtype)

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel * dtype.itemsize


@dataclass(frozen=True, repr=False)
class _Cast(Compressor):
    """Send ``x`` rounded to ``wire_dtype`` (round to nearest even); decode by casting back."""

    wire_dtype: ClassVar[torch.dtype]

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        return flat.to(self.wire_dtype).view(torch.uint8)

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if buffer.storage_offset() % 2:
            buffer = buffer.clone()
        return buffer.view(self.wire_dtype).to(dtype)

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * numel


@dataclass(frozen=True, repr=False)
class FP16(_Cast):
    """IEEE half precision: ``D(C(x)) = fp16(x)``, 2 bytes per element.

    10 mantissa bits (relative error <= 2**-11) but a narrow range: magnitudes above 65504
    become infinite and below about 6e-8 become zero, so scale gradients first (torch's
    ``fp16_compress_hook`` divides by the world size before casting for this reason).
    Deterministic rounding, hence biased; the error is tiny, but error feedback is still
    the default (:func:`default_error_feedback`). Registry name: ``"fp16"``.
    """

    spec_name: ClassVar[str] = "fp16"
    wire_dtype: ClassVar[torch.dtype] = torch.float16


@dataclass(frozen=True, repr=False)
class BF16(_Cast):
    """bfloat16: ``D(C(x)) = bf16(x)``, 2 bytes per element.

    float32's exponent range (no overflow) with 7 mantissa bits (relative error <=
    2**-8): the safe cast for gradients and weights of any scale. Deterministic rounding,
    hence biased. Registry name: ``"bf16"``.
    """

    spec_name: ClassVar[str] = "bf16"
    wire_dtype: ClassVar[torch.dtype] = torch.bfloat16
