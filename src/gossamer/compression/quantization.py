"""Unbiased stochastic quantizers: QSGD, natural compression and natural dithering."""

from __future__ import annotations

import abc
import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gossamer.compression._common import (
    FusedAdd,
    Reader,
    block_multiple,
    block_slices,
    check_int,
    compute_dtype,
    kernel_scratch,
    kernels,
    scratch,
)
from gossamer.compression._random import RandomWords, Seeded, stream_keys
from gossamer.compression.packing import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QSGD", "Natural", "NaturalDithering"]

_MAX_LEVELS = 127  # codes in [0, 2 * levels] then fit in one byte


@dataclass(frozen=True, repr=False)
class _NormQuantizer(FusedAdd, Seeded):
    """Sign, plus a level of ``|x_i| / ||x_B||_2`` rounded stochastically between two levels.

    ``x_B`` is the bucket of ``bucket`` consecutive elements holding ``x_i``. Payload: the
    bucket norms in the compute dtype, then codes ``levels + sign(x_i) * k_i`` in
    ``[0, 2 * levels]`` packed in ``ceil(log2(2 * levels + 1))`` bits each.
    """

    unbiased: ClassVar[bool] = True
    _dithering: ClassVar[bool]  # which rounding the fused CPU kernel runs

    levels: int
    bucket: int = field(default=512, kw_only=True)

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int(self.levels, "levels", 1, _MAX_LEVELS)
        check_int(self.bucket, "bucket", 1)

    @property
    def bits(self) -> int:
        """Bits per element: ``ceil(log2(2 * levels + 1))``."""
        return (2 * self.levels).bit_length()

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        buckets = -(-numel // self.bucket)
        return buckets * compute_dtype(dtype).itemsize + packed_nbytes(numel, self.bits)

    @abc.abstractmethod
    def _codes(self, x: torch.Tensor, norms: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        """Return the int32 codes ``levels + sign(x_i) * k_i`` of the rows ``x``.

        ``norms`` holds the rows' norms as a column, ``words`` one random word per element
        (:class:`~gossamer.compression._random.RandomWords`).
        """

    @abc.abstractmethod
    def _values(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        """Write ``sign * level`` in [-1, 1] of each (uint8) code into ``out``."""

    def _table(self) -> torch.Tensor:
        """The float32 value ``sign * level`` of every code ``0 .. 2 * levels``."""
        out = torch.empty(2 * self.levels + 1)
        self._values(torch.arange(2 * self.levels + 1, dtype=torch.uint8), out)
        return out

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel, cdt = flat.numel(), compute_dtype(flat.dtype)
        width = min(self.bucket, numel)
        head = -(-numel // width) * cdt.itemsize
        buffer = torch.empty(
            head + packed_nbytes(numel, self.bits), dtype=torch.uint8, device=flat.device
        )
        norms_out, codes_out = buffer[:head].view(cdt), buffer[head:]
        step = self._next_step()
        if _fused(flat, flat.dtype):
            multiple = block_multiple(width, numel)
            kernels().norm_encode(
                flat.detach().to(torch.float32).contiguous().numpy(),
                *stream_keys(self.seed, step),
                self.levels,
                width,
                self.bits,
                self._dithering,
                norms_out.numpy(),
                codes_out.numpy(),
                kernel_scratch(multiple, torch.uint8, "codes"),
            )
            return buffer
        words = RandomWords(self.seed, step, flat.device)
        for block in block_slices(numel, flat.device, math.lcm(width, 8)):
            x = _buckets(flat[block].to(cdt), width)
            # Summed in float64: float32 squares overflow from |x_i| ~ 1.8e19.
            norms = torch.linalg.vector_norm(x, dim=1, keepdim=True, dtype=torch.float64)
            norms = norms.to(cdt)
            first = block.start // width
            norms_out[first : first + x.shape[0]] = norms.view(-1)
            codes = self._codes(x, norms, words.take(x.numel()).view(x.shape))
            start = block.start * self.bits // 8
            packed = pack_bits(codes.view(-1)[: block.stop - block.start], self.bits)
            codes_out[start : start + packed.numel()] = packed
        return buffer

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if _fused(buffer, dtype):
            out = torch.empty(numel)
            self._kernel_decode(buffer, numel, out, add=False)
            return out.to(dtype)
        cdt = compute_dtype(dtype)
        width = min(self.bucket, numel)
        reader = Reader(buffer)
        norms = reader.take(-(-numel // width), cdt)
        codes = reader.rest()
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
        for block in block_slices(numel, buffer.device, math.lcm(width, 8)):
            count = block.stop - block.start
            start = block.start * self.bits // 8
            # Decoded straight into `out` where its dtype and the buckets allow.
            direct = dtype == cdt and count % width == 0
            values = out[block] if direct else _like(out[block], cdt, "values")
            self._values(unpack_bits(codes[start:], self.bits, count), values)
            first = block.start // width
            scaled = _buckets(values, width).mul_(
                norms[first : first + -(-count // width)].view(-1, 1)
            )
            if not direct:
                out[block] = scaled.view(-1)[:count]
        return out

    def _kernel_decode(self, buffer: torch.Tensor, numel: int, out: torch.Tensor, add: bool):
        """Decode (or with ``add``, add) a float32 payload into float32 ``out`` on CPU."""
        width = min(self.bucket, numel)
        reader = Reader(buffer)
        norms = reader.take(-(-numel // width), torch.float32)
        kernels().norm_decode(
            _aligned(reader.rest()).numpy(),
            norms.numpy(),
            self._table().numpy(),
            width,
            self.bits,
            out.detach().numpy(),
            kernel_scratch(block_multiple(width, numel), torch.uint8, "codes"),
            add,
        )


def _fused(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether a tensor of ``dtype`` on ``tensor``'s device takes the fused CPU kernels."""
    return tensor.device.type == "cpu" and compute_dtype(dtype) == torch.float32


def _aligned(codes: torch.Tensor) -> torch.Tensor:
    """``codes``, copied if needed so that the kernels may read it as 4-byte words."""
    return codes if codes.data_ptr() % 4 == 0 else codes.clone()


def _like(x: torch.Tensor, dtype: torch.dtype, slot: str) -> torch.Tensor:
    """A temporary shaped like ``x``, kept for this thread (:func:`scratch`)."""
    return scratch(x.numel(), dtype, x.device, f"quantization.{slot}").view(x.shape)


def _buckets(x: torch.Tensor, width: int) -> torch.Tensor:
    """View ``x`` as rows of ``width``, zero-padding the last row (which keeps its norm)."""
    short = -x.numel() % width
    if short:
        x = torch.cat([x, x.new_zeros(short)])
    return x.view(-1, width)


@dataclass(frozen=True, repr=False)
class QSGD(_NormQuantizer):
    """QSGD (Alistarh et al., NeurIPS 2017): ``levels`` uniform levels of ``|x_i| / ||x||_2``.

    With ``s = levels`` and ``r_i = |x_i| / ||x||_2``, let ``l = floor(s * r_i)``; then

    ``Q(x)_i = ||x||_2 * sign(x_i) * xi_i / s``,  ``xi_i = l + 1`` with probability
    ``s * r_i - l``, else ``l``,

    so ``E[Q(x)] = x`` (unbiased) and ``E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2``
    for ``d`` elements. Payload: the norm (float32; float64 for float64 tensors) and
    ``ceil(log2(2s + 1))`` bits per element (6 for ``s = 16``, 8 for ``s = 127``).

    Registry name: ``"qsgd:<levels>"``. Each call draws from the stream of ``(seed, step)``:
    give each rank its own ``seed`` so that the rounding noise averages out across ranks.

    Args:
        levels: ``s`` in ``[1, 127]``.
        seed: Seed of the rounding noise (keyword only).
    """

    spec_name: ClassVar[str] = "qsgd"
    _dithering: ClassVar[bool] = False

    def _codes(self, x: torch.Tensor, norms: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        # Rounding t = s x_i / ||x|| to floor(t + u), u uniform in [0, 1), is QSGD's rounding
        # of |t| with the sign kept: floor(t + u) = l + 1 exactly when u >= 1 - (t - l).
        # Shifted by s it is non-negative, so int() truncates as floor() would.
        # Temporaries are kept per thread (see scratch): fresh ones page-faulted each call.
        shift = torch.tensor(float(self.levels), dtype=x.dtype, device=x.device)
        u = _like(x, x.dtype, "u")  # s + u, u uniform on the multiples of 2^-24 in [0, 1)
        torch.add(shift, words.bitwise_and_(0xFFFFFF), alpha=2.0**-24, out=u)
        u.addcmul_(x, torch.where(norms > 0, self.levels / norms, 0.0))
        return words.copy_(u).clamp_(0, 2 * self.levels)  # past 2s only by rounding

    def _values(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(codes).sub_(self.levels).div_(self.levels)


@dataclass(frozen=True, repr=False)
class NaturalDithering(_NormQuantizer):
    """Natural dithering (Horvath et al. 2019): QSGD with levels ``0, 2^(1-s), ..., 1/2, 1``.

    QSGD with levels spaced geometrically instead of uniformly: ``r_i = |x_i| / ||x||_2``
    falling between consecutive levels ``a < b`` is rounded to ``b`` with probability
    ``(r_i - a) / (b - a)``, else to ``a``, so ``E[Q(x)] = x`` (unbiased). Small entries keep
    relative precision with few levels; the variance factor is
    ``1/8 + min(sqrt(d) / 2^(s-1), d / 2^(2(s-1)))`` for ``d`` elements (p = 2). Payload:
    the norm and ``ceil(log2(2s + 1))`` bits per element. The rounding runs on ``r_i`` in
    float32, also for float64 tensors (a relative error of at most ``2^-24`` in ``r_i``).

    Registry name: ``"natural_dithering:<levels>"``.

    Args:
        levels: ``s`` in ``[1, 127]``, the number of non-zero levels.
        seed: Seed of the rounding noise (keyword only).
    """

    spec_name: ClassVar[str] = "natural_dithering"
    _dithering: ClassVar[bool] = True

    def _codes(self, x: torch.Tensor, norms: torch.Tensor, words: torch.Tensor) -> torch.Tensor:
        # r in [2^e, 2^(e+1)) goes up with probability r / 2^e - 1, its float32 mantissa
        # bits m / 2^23: adding a uniform 23-bit draw to the mantissa carries into the
        # exponent exactly with that chance (as in Natural). Below the smallest level
        # 2^(1-s), r + 2^(1-s) lies in [2^(1-s), 2^(2-s)) and carries with chance r / 2^(1-s):
        # exponent 1 - s then means level 0, and 2 - s the smallest level.
        r = torch.abs(x, out=_like(x, x.dtype, "r")).div_(torch.where(norms > 0, norms, 1.0))
        r = r.to(torch.float32)
        small = torch.lt(r, 2.0 ** (1 - self.levels), out=_like(x, torch.bool, "small"))
        r.add_(small, alpha=2.0 ** (1 - self.levels))
        words.bitwise_and_(0x7FFFFF).add_(r.view(torch.int32))
        words >>= 23  # the biased exponent: r >= 0 has no sign bit
        index = words.add_(self.levels - 128).add_(small.logical_not_()).clamp_(0, self.levels)
        negative = torch.mul(index, torch.lt(x, 0, out=small), out=_like(x, torch.int32, "neg"))
        return index.sub_(negative, alpha=2).add_(self.levels)  # s + sign(x) index

    def _values(self, codes: torch.Tensor, out: torch.Tensor) -> None:
        table = _dithering_table(self.levels, out.dtype, out.device)
        indices = _like(codes, torch.int32, "indices").copy_(codes)
        torch.index_select(table, 0, indices, out=out)  # 5x faster than table[codes]


@functools.lru_cache(maxsize=64)
def _dithering_table(levels: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The value ``sign * 2^(k - s)`` (0 for ``k = 0``) of every code ``s + sign * k``.

    Built once per configuration, not once per block decoded; callers only read it.
    """
    powers = torch.pow(2.0, torch.arange(-levels, 1, dtype=torch.float64))
    powers[0] = 0.0
    return torch.cat([-powers.flip(0)[:-1], powers]).to(device, dtype)


@dataclass(frozen=True, repr=False)
class Natural(FusedAdd, Seeded):
    """Natural compression (Horvath et al. 2019): round ``|x_i|`` to a neighbouring power of two.

    ``|x_i|`` in ``[2^e, 2^(e+1))`` becomes ``2^(e+1)`` with probability
    ``|x_i| / 2^e - 1``, else ``2^e``; the sign is kept. Unbiased, with
    ``E[(C(x)_i - x_i)^2] <= x_i^2 / 8``, hence ``E||C(x)||^2 <= 9/8 ||x||^2``. The result is
    a float32 with a zero mantissa, sent as its sign bit and its 8-bit exponent: 9 bits per
    element (the mantissa bits are the rounding probability, so one uniform 23-bit draw
    decides exactly).

    Range: float32's. Magnitudes below ``2^-126`` round between 0 and ``2^-126`` (still
    unbiased), values in ``[2^127, 2^128)`` may round to infinity, infinities stay and NaNs
    become infinities; float64 tensors are first rounded to float32, float16 values near
    65504 may round to infinity on the way back.

    Registry name: ``"natural"``.

    Args:
        seed: Seed of the rounding noise (keyword only).
    """

    spec_name: ClassVar[str] = "natural"
    unbiased: ClassVar[bool] = True

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        return numel + packed_nbytes(numel, 1)

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel = flat.numel()
        buffer = torch.empty(self._nbytes(numel, flat.dtype), dtype=torch.uint8, device=flat.device)
        step = self._next_step()
        if flat.device.type == "cpu":
            kernels().natural_encode(
                flat.detach().to(torch.float32).contiguous().numpy(),
                *stream_keys(self.seed, step),
                buffer[:numel].numpy(),
                buffer[numel:].numpy(),
                kernel_scratch(8, torch.uint8, "codes"),
            )
            return buffer
        words = RandomWords(self.seed, step, flat.device)
        for block in block_slices(numel, flat.device):
            bits = flat[block].to(torch.float32).view(torch.int32)
            # A uniform 23-bit r added to the mantissa m carries into the exponent exactly
            # when r >= 2^23 - m: with probability m / 2^23, the chance to round up.
            magnitude = torch.bitwise_and(bits, 0x7FFFFFFF, out=_like(bits, torch.int32, "m"))
            magnitude.add_(words.take(bits.numel()).bitwise_and_(0x7FFFFF))
            magnitude >>= 23
            # Infinities (mantissa 0) never carry; NaNs may, to 0x100: clamped to infinity.
            buffer[block] = magnitude.clamp_(max=0xFF)
            negative = torch.bitwise_right_shift(bits, 31, out=_like(bits, torch.int32, "sign"))
            signs = pack_bits(negative.neg_(), 1)  # bits >> 31 is -1 where the sign bit is set
            start = numel + block.start // 8
            buffer[start : start + signs.numel()] = signs
        return buffer

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if buffer.device.type == "cpu":
            out = torch.empty(numel)
            self._kernel_decode(buffer, numel, out, add=False)
            return out.to(dtype)
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
        for block in block_slices(numel, buffer.device):
            # Built in place in `out` for float32, else in a temporary kept per thread.
            direct = dtype == torch.float32
            bits = out[block] if direct else _like(out[block], torch.float32, "bits")
            bits = bits.view(torch.int32).copy_(buffer[block])
            bits <<= 23
            negative = unpack_bits(buffer[numel + block.start // 8 :], 1, block.stop - block.start)
            sign = _like(bits, torch.int32, "sign").copy_(negative)
            sign <<= 31
            bits |= sign
            if not direct:
                out[block] = bits.view(torch.float32)
        return out

    def _kernel_decode(self, buffer: torch.Tensor, numel: int, out: torch.Tensor, add: bool):
        """Decode (or with ``add``, add) a payload into float32 ``out`` on CPU."""
        kernels().natural_decode(
            buffer[:numel].numpy(),
            buffer[numel:].numpy(),
            out.detach().numpy(),
            kernel_scratch(8, torch.uint8, "codes"),
            kernel_scratch(8, torch.float32, "r"),
            add,
        )
