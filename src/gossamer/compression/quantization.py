"""Unbiased stochastic quantizers: QSGD, natural compression and natural dithering."""

from __future__ import annotations

import abc
import math
from dataclasses import dataclass, field
from typing import ClassVar

import torch

from gossamer.compression._common import Reader, block_slices, check_int, compute_dtype
from gossamer.compression._random import Seeded, generator
from gossamer.compression.packing import pack_bits, packed_nbytes, unpack_bits

__all__ = ["QSGD", "Natural", "NaturalDithering"]

_MAX_LEVELS = 127  # codes in [0, 2 * levels] then fit in one byte


def _exponent_mask(dtype: torch.dtype) -> tuple[torch.dtype, int, int]:
    """Return the integer view dtype, exponent-field mask and mantissa width of ``dtype``."""
    if dtype == torch.float64:
        return torch.int64, 0x7FF0000000000000, 52
    return torch.int32, 0x7F800000, 23


@dataclass(frozen=True, repr=False)
class _NormQuantizer(Seeded):
    """Sign, plus a level of ``|x_i| / ||x_B||_2`` rounded stochastically between two levels.

    ``x_B`` is the bucket of ``bucket`` consecutive elements holding ``x_i``. Payload: the
    bucket norms in the compute dtype, then codes ``levels + sign(x_i) * k_i`` in
    ``[0, 2 * levels]`` packed in ``ceil(log2(2 * levels + 1))`` bits each.
    """

    unbiased: ClassVar[bool] = True

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
    def _split(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Return the index of the level below each ``r`` in [0, 1] and the chance to go up.

        The index comes back as a float tensor; ``r`` may be overwritten.
        """

    @abc.abstractmethod
    def _levels(self, dtype: torch.dtype) -> torch.Tensor:
        """Return the ``levels + 1`` level values in [0, 1], ascending, index 0 being 0."""

    def _table(self, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Return the value ``sign * level`` of every code ``levels + sign * index``."""
        levels = self._levels(dtype).to(device)
        return torch.cat([-levels.flip(0)[:-1], levels])

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel, cdt = flat.numel(), compute_dtype(flat.dtype)
        width = min(self.bucket, numel)
        head = -(-numel // width) * cdt.itemsize
        buffer = torch.empty(
            head + packed_nbytes(numel, self.bits), dtype=torch.uint8, device=flat.device
        )
        norms_out, codes_out = buffer[:head].view(cdt), buffer[head:]
        gen = generator(self.seed, self._next_step(), flat.device)
        for block in block_slices(numel, flat.device, math.lcm(width, 8)):
            x = _buckets(flat[block].to(cdt), width)
            norms = torch.linalg.vector_norm(x, dim=1, keepdim=True)
            first = block.start // width
            norms_out[first : first + x.shape[0]] = norms.view(-1)
            r = x.abs().div_(torch.where(norms > 0, norms, 1.0)).clamp_(max=1.0)
            level, chance = self._split(r)
            level += torch.rand(r.shape, generator=gen, dtype=cdt, device=r.device) < chance
            level.clamp_(max=self.levels)  # only reachable through rounding of r near 1
            codes = torch.copysign(level, x).add_(self.levels).view(-1)[: block.stop - block.start]
            start = block.start * self.bits // 8
            packed = pack_bits(codes.int(), self.bits)
            codes_out[start : start + packed.numel()] = packed
        return buffer

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        cdt = compute_dtype(dtype)
        width = min(self.bucket, numel)
        reader = Reader(buffer)
        norms = reader.take(-(-numel // width), cdt)
        codes = reader.rest()
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
        table = self._table(cdt, buffer.device)
        for block in block_slices(numel, buffer.device, math.lcm(width, 8)):
            count = block.stop - block.start
            start = block.start * self.bits // 8
            indices = unpack_bits(codes[start:], self.bits, count).int()
            values = torch.index_select(table, 0, indices)  # 5x faster than table[indices]
            first = block.start // width
            scaled = _buckets(values, width).mul_(
                norms[first : first + -(-count // width)].view(-1, 1)
            )
            out[block] = scaled.view(-1)[:count]
        return out


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

    def _split(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        scaled = r.mul_(self.levels)
        level = torch.floor(scaled)
        return level, scaled.sub_(level)

    def _levels(self, dtype: torch.dtype) -> torch.Tensor:
        return torch.arange(self.levels + 1, dtype=dtype) / self.levels


@dataclass(frozen=True, repr=False)
class NaturalDithering(_NormQuantizer):
    """Natural dithering (Horvath et al. 2019): QSGD with levels ``0, 2^(1-s), ..., 1/2, 1``.

    QSGD with levels spaced geometrically instead of uniformly: ``r_i = |x_i| / ||x||_2``
    falling between consecutive levels ``a < b`` is rounded to ``b`` with probability
    ``(r_i - a) / (b - a)``, else to ``a``, so ``E[Q(x)] = x`` (unbiased). Small entries keep
    relative precision with few levels; the variance factor is
    ``1/8 + min(sqrt(d) / 2^(s-1), d / 2^(2(s-1)))`` for ``d`` elements (p = 2). Payload:
    the norm and ``ceil(log2(2s + 1))`` bits per element.

    Registry name: ``"natural_dithering:<levels>"``.

    Args:
        levels: ``s`` in ``[1, 127]``, the number of non-zero levels.
        seed: Seed of the rounding noise (keyword only).
    """

    spec_name: ClassVar[str] = "natural_dithering"

    def _split(self, r: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        view, mask, shift = _exponent_mask(r.dtype)
        smallest = 2.0 ** (1 - self.levels)
        # Clearing the mantissa bits of r gives 2^floor(log2 r), the level below r, unless r
        # is below the smallest level: then it rounds between 0 and 2^(1-s).
        low = (r.view(view) & mask).view(r.dtype)
        low.masked_fill_(r < smallest, 0.0)
        high = torch.clamp(low * 2.0, min=smallest)
        chance = r.sub_(low).div_(high.sub_(low))
        bias = (mask >> shift) // 2  # the exponent bias, 127 or 1023
        index = ((low.view(view) >> shift) - (bias - self.levels)).clamp_(min=0)
        return index.to(r.dtype), chance

    def _levels(self, dtype: torch.dtype) -> torch.Tensor:
        levels = torch.pow(2.0, torch.arange(-self.levels, 1, dtype=torch.float64)).to(dtype)
        levels[0] = 0.0
        return levels


@dataclass(frozen=True, repr=False)
class Natural(Seeded):
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
        gen = generator(self.seed, self._next_step(), flat.device)
        for block in block_slices(numel, flat.device):
            bits = flat[block].to(torch.float32).view(torch.int32)
            exponent = (bits >> 23) & 0xFF
            mantissa = bits & 0x7FFFFF
            # rand() draws multiples of 2^-24, so u * 2^23 < m has probability m / 2^23 exactly.
            draws = torch.rand(bits.shape, generator=gen, device=flat.device).mul_(2.0**23)
            up = draws < mantissa
            up &= exponent < 0xFF  # infinities and NaNs keep their exponent
            buffer[block] = exponent.add_(up)
            signs = pack_bits(bits < 0, 1)
            start = numel + block.start // 8
            buffer[start : start + signs.numel()] = signs
        return buffer

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(numel, dtype=dtype, device=buffer.device)
        for block in block_slices(numel, buffer.device):
            bits = buffer[block].int() << 23
            negative = unpack_bits(buffer[numel + block.start // 8 :], 1, block.stop - block.start)
            bits |= negative.int() * -(2**31)  # the sign bit
            out[block] = bits.view(torch.float32)
        return out
