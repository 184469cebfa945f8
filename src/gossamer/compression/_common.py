"""Helpers shared by the compressors: argument checks, compute dtypes, byte-buffer layout."""

from __future__ import annotations

import math
import threading

import numpy as np
import torch

__all__ = [
    "CPU_BLOCK",
    "KERNEL_BLOCK",
    "FusedAdd",
    "Reader",
    "block_multiple",
    "block_slices",
    "check_int",
    "check_ratio",
    "compute_dtype",
    "format_value",
    "join",
    "kept",
    "kernel_scratch",
    "kernels",
    "scratch",
    "takes_kernels",
]


# Elements per block on CPU. Encoders run several passes (and allocate temporaries) per
# element; on blocks of this size the data and the temporaries stay in cache and malloc
# reuses the same memory, instead of streaming and page-faulting a model-sized temporary
# per pass: measured 1.5-3x faster on 5 M elements. GPUs get one block, since small
# kernels there would only add launch overhead.
CPU_BLOCK = 1 << 19


_SCRATCH = threading.local()


def scratch(numel: int, dtype: torch.dtype, device: torch.device, slot: str) -> torch.Tensor:
    """A 1-d tensor of ``numel`` elements for one call's temporaries, reused on this thread.

    A fresh CPU temporary of a few MB is a fresh mapping that page-faults on every call (a
    1 M-element ``uint8`` compress took 1000 faults and 1.6 ms of system time besides its
    1.2 ms of work). So each thread keeps one per ``(slot, dtype)``, valid until its next
    use under the same key. Other devices get a new tensor (their allocators cache).
    """
    if device.type != "cpu":
        return torch.empty(numel, dtype=dtype, device=device)
    pool = _SCRATCH.__dict__.setdefault("pool", {})
    kept = pool.get((slot, dtype))
    if kept is None or kept.numel() < numel:
        kept = pool[(slot, dtype)] = torch.empty(numel, dtype=dtype)
    return kept[:numel]


def kernels():
    """The fused CPU kernels (:mod:`._kernels`), imported on first use: numba takes 0.5 s."""
    import gossamer.compression._kernels as loaded

    return loaded


KERNEL_BLOCK = 1 << 16  # elements a fused kernel codes and packs at a time (in cache)


def kernel_scratch(multiple: int, dtype: torch.dtype, slot: str) -> np.ndarray:
    """A kept temporary of about :data:`KERNEL_BLOCK` elements (a multiple of ``multiple``)."""
    size = max(multiple, KERNEL_BLOCK // multiple * multiple)
    return scratch(size, dtype, torch.device("cpu"), f"kernel.{slot}").numpy()


def block_multiple(width: int, numel: int) -> int:
    """What a kernel block's size must be a multiple of: whole buckets and whole bytes.

    At most ``numel`` rounded up to 8 (one block then holds everything): ``lcm(width, 8)``
    alone would ask 8x the tensor for one large bucket of odd width.
    """
    return min(math.lcm(width, 8), -(-numel // 8) * 8)


def takes_kernels(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``dtype`` data on ``device`` takes the fused CPU kernels: float32 on CPU."""
    return device.type == "cpu" and dtype == torch.float32


class FusedAdd:
    """``decompress_add_`` by the fused CPU kernel (``_kernel_decode``) where it applies."""

    def _decode_add(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype, target: torch.Tensor
    ) -> None:
        if takes_kernels(buffer.device, dtype) and target.is_contiguous():
            self._kernel_decode(buffer, numel, target, add=True)
        else:
            super()._decode_add(buffer, numel, dtype, target)


def block_slices(numel: int, device: torch.device, multiple: int = 8) -> list[slice]:
    """Cut ``range(numel)`` into consecutive slices whose starts are multiples of ``multiple``.

    On CPU each slice holds about :data:`CPU_BLOCK` elements; on other devices there is one.
    """
    if device.type != "cpu":
        return [slice(0, numel)]
    size = max(multiple, CPU_BLOCK // multiple * multiple)
    return [slice(start, min(start + size, numel)) for start in range(0, numel, size)]


def format_value(value: object) -> str:
    """Spell a configuration value the way the registry parses it back."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Return the dtype arithmetic runs in: float64 for float64, float32 for everything else.

    16-bit floats are widened because sums, norms and scales overflow or lose too much in
    16 bits (Bagua's kernels compute in float32 too).
    """
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_ratio(ratio: object) -> float:
    """Return ``ratio`` as a float in ``(0, 1]`` or raise naming it."""
    if isinstance(ratio, bool) or not isinstance(ratio, int | float):
        raise TypeError(f"ratio must be a float; got {ratio!r}")
    if not 0.0 < ratio <= 1.0:  # also rejects NaN
        raise ValueError(f"ratio must be in (0, 1]; got {ratio!r}")
    return float(ratio)


def check_int(value: object, name: str, low: int, high: int | None = None) -> int:
    """Return ``value`` as an int in ``[low, high]`` or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int; got {value!r}")
    if value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{name} must be {bounds}; got {value}")
    return value


def kept(numel: int, ratio: float) -> int:
    """Number of elements a sparsifier keeps: ``ceil(ratio * numel)``, at least 1."""
    return min(numel, max(1, math.ceil(ratio * numel)))


def join(*parts: torch.Tensor) -> torch.Tensor:
    """Concatenate the raw bytes of ``parts`` (any dtypes, one device) into one uint8 buffer."""
    return torch.cat([part.reshape(-1).view(torch.uint8) for part in parts])


class Reader:
    """Cut a buffer written by :func:`join` back into its parts, front to back."""

    def __init__(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer
        self._offset = 0

    def take(self, count: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """Return the next ``count`` elements of ``dtype``.

        Raises:
            ValueError: the buffer ends first (it was cut short or is not of this format).
        """
        start, end = self._offset, self._offset + count * dtype.itemsize
        if end > self._buffer.numel():
            raise ValueError(
                f"payload buffer too short: need {end} bytes, got {self._buffer.numel()}"
            )
        self._offset = end
        chunk = self._buffer[start:end]
        # A buffer cut out of a larger receive buffer may be misaligned for a wider dtype:
        # reinterpreting its bytes then needs an aligned copy.
        if chunk.storage_offset() % dtype.itemsize:
            chunk = chunk.clone()
        return chunk.view(dtype)

    def rest(self) -> torch.Tensor:
        """Return the remaining bytes."""
        chunk = self._buffer[self._offset :]
        self._offset = self._buffer.numel()
        return chunk
