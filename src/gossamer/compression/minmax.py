"""Min-max quantization: Bagua's MinMaxUInt8 (8-bit codes per chunk) and packed narrower codes."""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch

from gossamer.compression._common import (
    CPU_BLOCK,
    Reader,
    check_int,
    compute_dtype,
    join,
    kernels,
    scratch,
    takes_kernels,
)
from gossamer.compression.base import Compressor
from gossamer.compression.packing import pack_bits, packed_nbytes, unpack_bits

__all__ = ["MinMaxCodes", "MinMaxUInt8"]

_EPS = 1e-7  # Bagua's `const float eps`


@dataclass(frozen=True, repr=False)
class MinMaxUInt8(Compressor):
    """Bagua's MinMaxUInt8: per chunk, one byte per element between the chunk's min and max.

    The flat tensor is cut into ``chunks`` chunks of ``L = ceil(n / chunks)`` elements (the
    last one shorter; fewer chunks when ``n < chunks``). For a chunk with minimum ``lo`` and
    maximum ``hi``, in float32 (float64 for float64 tensors), with ``rint`` rounding half to
    even exactly as Bagua's ``compress_float_to_uint8`` kernel:

    - ``scale = 255 / (hi - lo + eps)``, ``eps = 1e-7``;
    - ``upper = rint(hi * scale)``, ``lower = upper - 255``;
    - code ``q = sat_uint8(rint(x * scale) - lower)``  (Bagua's ``min(., upper)`` is
      implied: ``x <= hi``);
    - decoded ``(q + lower) / scale``, rounded to the tensor's dtype.

    The error is at most about ``(hi - lo) / 510`` per element; the rounding is
    deterministic, so the compressor is biased. Codes and decoded values are bit-exact with
    Bagua's for float32 and float16; the layout differs: all ``(lo, hi)`` pairs (in the
    tensor's dtype) come first, then the ``n`` codes, with no padding (Bagua pads each
    chunk's header to 32 bytes and needs ``n`` divisible by the chunk count).

    Bagua's ByteGrad uses one chunk per rank (each rank reduces one chunk) and its
    low-precision decentralized algorithm one chunk per bucket; more chunks track the local
    range better for ``2 * itemsize`` bytes each. Bagua runs it without error feedback.

    Registry names: ``"uint8"`` (one chunk), ``"uint8:<chunks>"``.

    Args:
        chunks: Number of chunks, ``>= 1``.

    Example:
        >>> c = MinMaxUInt8()
        >>> c.payload_nbytes(100)  # 100 codes + one float32 (min, max) pair
        108
        >>> c.decompress(c.compress(torch.tensor([0.0, 0.5, 1.0])))
        tensor([0.0000, 0.4980, 1.0000])
    """

    spec_name: ClassVar[str] = "uint8"

    chunks: int = 1

    def __post_init__(self) -> None:
        check_int(self.chunks, "chunks", 1)

    def _layout(self, numel: int) -> tuple[int, int, int]:
        """Return ``(chunk length, full chunks, elements in the short last chunk)``."""
        length = math.ceil(numel / self.chunks)
        full, tail = divmod(numel, length)
        return length, full, tail

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        _, full, tail = self._layout(numel)
        return (full + (tail > 0)) * 2 * dtype.itemsize + numel

    def _parts(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Return the chunks as 2-D views: the full chunks, then the short last one."""
        length, full, tail = self._layout(flat.numel())
        parts = [flat[: full * length].view(full, length)] if full else []
        if tail:
            parts.append(flat[full * length :].view(1, tail))
        return parts

    def _encode(self, flat: torch.Tensor, add_to: torch.Tensor | None = None) -> torch.Tensor:
        cdt = compute_dtype(flat.dtype)
        parts = self._parts(flat)
        header = torch.cat([_min_max(part) for part in parts])
        hsize = header.numel() * flat.element_size()
        buffer = torch.empty(hsize + flat.numel(), dtype=torch.uint8, device=flat.device)
        buffer[:hsize].view(flat.dtype).copy_(header.view(-1))
        scale, lower = _scale_lower(header, cdt)
        codes, row = buffer[hsize:], 0
        if takes_kernels(flat.device, flat.dtype):  # one pass, not torch's six per block
            add = add_to is not None
            kernels().minmax_encode(
                flat.detach().numpy(),
                self._layout(flat.numel())[0],
                scale.view(-1).numpy(),
                lower.view(-1).numpy(),
                codes.numpy(),
                (add_to if add else flat).detach().numpy(),
                add,
            )
            return buffer
        targets = self._parts(add_to) if add_to is not None else [None] * len(parts)
        for part, target in zip(parts, targets, strict=True):
            rows, cols = part.shape
            out = codes[: rows * cols].view(rows, cols)
            codes = codes[rows * cols :]
            sl = slice(row, row + rows)
            _quantize(part, scale[sl], lower[sl], out, cdt, target)
            row += rows
        return buffer

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
        self._decode_into(buffer, out, add=False)
        return out

    def _decode_add(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype, target: torch.Tensor
    ) -> None:
        if dtype != compute_dtype(dtype):  # decoded values round to dtype before the sum
            return super()._decode_add(buffer, numel, dtype, target)
        self._decode_into(buffer, target, add=True)

    def _decode_into(self, buffer: torch.Tensor, out: torch.Tensor, add: bool) -> None:
        """Write (or with ``add``, add) the decoded values into the flat ``out``."""
        cdt = compute_dtype(out.dtype)
        _, full, tail = self._layout(out.numel())
        reader = Reader(buffer)
        header = reader.take(2 * (full + (tail > 0)), out.dtype).view(-1, 2)
        scale, lower = _scale_lower(header, cdt)
        codes, row = reader.rest(), 0
        if takes_kernels(out.device, out.dtype):
            length = self._layout(out.numel())[0]
            columns = (scale.view(-1).numpy(), lower.view(-1).numpy())
            kernels().minmax_decode(codes.numpy(), length, *columns, out.detach().numpy(), add)
            return
        for part, codes_part in zip(self._parts(out), self._parts(codes), strict=True):
            rows = part.shape[0]
            sl = slice(row, row + rows)
            _dequantize(codes_part, scale[sl], lower[sl], part, cdt, add)
            row += rows

    def _encode_add(self, flat: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # Each block is decoded while in cache from the float codes, which equal the uint8
        # codes: the sum is bit for bit that of decompress_add_.
        if flat.dtype != compute_dtype(flat.dtype):
            return super()._encode_add(flat, target)
        return self._encode(flat, target)


def _min_max(part: torch.Tensor) -> torch.Tensor:
    """Return the ``(rows, 2)`` minima and maxima of the rows of ``part``."""
    if part.shape[0] == 1:  # one pass; torch's aminmax along a dim is much slower than this
        return torch.stack(torch.aminmax(part)).view(1, 2)
    return torch.stack([part.amin(dim=1), part.amax(dim=1)], dim=1)


def _scale_lower(header: torch.Tensor, cdt: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return per-chunk ``scale`` and ``lower`` as ``(chunks, 1)`` columns, in ``cdt``."""
    lo, hi = header[:, 0].to(cdt), header[:, 1].to(cdt)
    # torch computes `number / tensor` as `reciprocal(tensor) * number`, which rounds
    # twice; Bagua divides once.
    scale = torch.full_like(hi, 255.0).div_(hi - lo + _EPS)
    lower = torch.round(hi * scale) - 255.0
    return scale.unsqueeze(1), lower.unsqueeze(1)


def _blocks(rows: int, cols: int, device: torch.device) -> Iterator[tuple[slice, slice]]:
    """Yield (row, column) slices covering a ``rows x cols`` matrix in cache-sized blocks."""
    if device.type != "cpu":
        yield slice(0, rows), slice(0, cols)
        return
    if cols >= CPU_BLOCK:
        for r in range(rows):
            for c in range(0, cols, CPU_BLOCK):
                yield slice(r, r + 1), slice(c, c + CPU_BLOCK)
    else:
        step = max(1, CPU_BLOCK // cols)
        for r in range(0, rows, step):
            yield slice(r, r + step), slice(0, cols)


def _block_numel(x: torch.Tensor) -> int:
    """The most elements one of :func:`_blocks`'s blocks of ``x`` holds."""
    return min(x.numel(), CPU_BLOCK) if x.device.type == "cpu" else x.numel()


def _quantize(
    x: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor,
    out: torch.Tensor,
    cdt: torch.dtype,
    add_to: torch.Tensor | None = None,
) -> None:
    """Write ``sat_uint8(rint(x * scale) - lower)`` into ``out`` (same shape as ``x``).

    ``add_to`` (of dtype ``cdt``), if given, gets the decoded values added.
    """
    size = _block_numel(x)
    work = scratch(size, cdt, x.device, "quantize")
    whole = scratch(size, torch.int32, x.device, "quantize")
    for rs, cs in _blocks(*x.shape, x.device):
        xb = x[rs, cs]
        tb = work[: xb.numel()].view(xb.shape)
        ib = whole[: xb.numel()].view(xb.shape)
        # `scale` is a (rows, 1) tensor, not 0-d, so 16-bit inputs are multiplied in cdt.
        torch.mul(xb, scale[rs], out=tb)
        tb.round_().sub_(lower[rs]).clamp_(0.0, 255.0)
        # float -> int32 -> uint8 is faster than torch's direct float -> uint8 cast.
        ib.copy_(tb)
        out[rs, cs].copy_(ib)
        if add_to is not None:
            add_to[rs, cs].addcdiv_(tb.add_(lower[rs]), scale[rs])


def _dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    lower: torch.Tensor,
    out: torch.Tensor,
    cdt: torch.dtype,
    add: bool = False,
) -> None:
    """Write ``(codes + lower) / scale`` into ``out`` (``add``: add it), computed in ``cdt``."""
    direct = out.dtype == cdt and not add
    work = None if direct else scratch(_block_numel(out), cdt, out.device, "dequantize")
    for rs, cs in _blocks(*out.shape, out.device):
        ob = out[rs, cs]
        tb = ob if work is None else work[: ob.numel()].view(ob.shape)
        tb.copy_(codes[rs, cs])
        tb.add_(lower[rs])
        if add:
            ob.addcdiv_(tb, scale[rs])
        else:
            tb.div_(scale[rs])
            if work is not None:
                ob.copy_(tb)


@dataclass(frozen=True, repr=False)
class MinMaxCodes(Compressor):
    r"""``bits``-bit codes between the tensor's minimum and maximum, packed.

    MinMaxUInt8's rounding (one chunk) with :math:`L = 2^b - 1` levels in place of 255,
    for :math:`b` = ``bits``: ``scale = L / (hi - lo + eps)``, ``upper = rint(hi * scale)``,
    ``lower = upper - L``, code ``q = clamp(rint(x * scale) - lower, 0, L)``, decoded
    ``(q + lower) / scale``. The error is at most about ``(hi - lo) / (2L)`` per element.
    The payload is the ``(lo, hi)`` pair in the tensor's dtype, then the codes packed
    LSB first (:func:`~gossamer.compression.packing.pack_bits`): ``ceil(n b / 8)`` bytes.
    ``bits=8`` gives MinMaxUInt8's codes and bytes.

    Not in the registry: it is random-k's codec for its kept values
    (``randomk:<ratio>:quantize=true:bits=<b>``), in torch operations on every device.

    Args:
        bits: Code width, in ``[1, 8]``.
    """

    spec_name: ClassVar[str] = "minmax"

    bits: int = 8

    def __post_init__(self) -> None:
        check_int(self.bits, "bits", 1, 8)

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return 2 * dtype.itemsize + packed_nbytes(numel, self.bits)

    def _scale_lower(self, header: torch.Tensor, cdt: torch.dtype):
        levels = float(2**self.bits - 1)
        lo, hi = header[0].to(cdt), header[1].to(cdt)
        scale = torch.full_like(hi, levels).div_(hi - lo + _EPS)
        return scale, torch.round(hi * scale) - levels, levels

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        cdt = compute_dtype(flat.dtype)
        header = torch.stack(torch.aminmax(flat))
        scale, lower, levels = self._scale_lower(header, cdt)
        codes = (flat.to(cdt) * scale).round_().sub_(lower).clamp_(0.0, levels)
        packed = pack_bits(codes.to(torch.uint8), self.bits)
        return join(header, packed)

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        cdt = compute_dtype(dtype)
        reader = Reader(buffer)
        header = reader.take(2, dtype)
        scale, lower, _ = self._scale_lower(header, cdt)
        codes = unpack_bits(reader.rest(), self.bits, numel)
        return codes.to(cdt).add_(lower).div_(scale).to(dtype)
