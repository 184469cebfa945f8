"""Bit packing of small unsigned integers and Rice (power-of-two Golomb) coding, in torch ops.

Everything here is vectorised: the Python loops run over bit positions or over the 8
members of a packing group, never over elements, so the same code runs on CPU and CUDA.
On CPU the Rice code runs as compiled loops (:mod:`._kernels`), which write the same bytes:
its torch form spreads the unary stream to a byte per bit.
"""

from __future__ import annotations

import math

import torch

from gossamer.compression._common import kernels, scratch

__all__ = [
    "pack_bits",
    "packed_nbytes",
    "rice_decode",
    "rice_encode",
    "rice_nbytes_bound",
    "rice_parameter",
    "unpack_bits",
]

_MAX_BITS = 63  # values travel as non-negative int64


def packed_nbytes(count: int, bits: int) -> int:
    """Return ``ceil(count * bits / 8)``: the size of :func:`pack_bits`'s output."""
    return (count * bits + 7) // 8


def _check_bits(bits: int) -> None:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 1 <= bits <= _MAX_BITS:
        raise ValueError(f"bits must be an int in [1, {_MAX_BITS}]; got {bits!r}")


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integers in ``[0, 2**bits)`` into ``ceil(n * bits / 8)`` bytes.

    Widths up to 8 bits form groups of 8 values, each group a little-endian word of
    ``bits`` bytes (value ``j`` of a group holds bits ``[j*bits, (j+1)*bits)``), so for
    these widths the output is the plain LSB-first bit stream. Wider values are split into a
    byte plane of their low 8 bits followed by the packing of the rest, ``values >> 8``.

    Args:
        values: Integer or bool tensor of any shape (read flattened); entries outside
            ``[0, 2**bits)`` are not checked and corrupt their neighbours.
        bits: Width in ``[1, 63]``.

    Returns:
        1-D uint8 tensor on the device of ``values``.

    Example:
        >>> pack_bits(torch.tensor([1, 0, 1, 1]), 1)
        tensor([13], dtype=torch.uint8)
    """
    _check_bits(bits)
    flat = values.reshape(-1)
    if bits > 8:
        flat = flat.long()
        low = (flat & 0xFF).to(torch.uint8)
        return torch.cat([low, pack_bits(flat >> 8, bits - 8)])
    if bits == 8:
        return flat.to(torch.uint8)
    count = flat.numel()
    groups = -(-count // 8)
    # Each group of 8 values becomes one int64 word holding them in its 8 bytes (this
    # relies on little-endian memory, as torch does), then three halving steps squeeze
    # the fields together: 8 x b bits -> 4 x 2b -> 2 x 4b -> 8b bits at the bottom.
    # The temporaries are kept per thread: fresh ones page-faulted on every call.
    padded = scratch(groups * 8, torch.uint8, flat.device, "pack_bits.padded")
    padded[:count] = flat
    padded[count:] = 0
    word = padded.view(torch.int64)
    high = scratch(groups, torch.int64, flat.device, "pack_bits.high")
    for lane, field in ((16, bits), (32, 2 * bits), (64, 4 * bits)):
        low = _lane_mask(lane, lane // 2)
        torch.bitwise_and(word, ~low, out=high)
        high >>= lane // 2 - field
        word &= low
        word |= high
    unit = _unit(bits)
    fields = word.view(unit).view(groups, 8 // unit.itemsize)[:, : bits // unit.itemsize]
    out = torch.empty(fields.shape, dtype=unit, device=flat.device)  # never a view of scratch
    return out.copy_(fields).view(-1).view(torch.uint8)[: packed_nbytes(count, bits)]


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """Invert :func:`pack_bits`: return ``count`` values of ``bits`` bits each.

    The values come back as uint8 for widths up to 8 (a view into ``packed`` for width 8)
    and as int64 above.

    Args:
        packed: 1-D uint8 tensor of at least ``packed_nbytes(count, bits)`` bytes (extra
            trailing bytes are ignored).
        bits: Width in ``[1, 63]``, as packed.
        count: Number of values.

    Raises:
        ValueError: ``packed`` is shorter than ``packed_nbytes(count, bits)``.
    """
    _check_bits(bits)
    need = packed_nbytes(count, bits)
    if packed.numel() < need:
        raise ValueError(
            f"packed must hold {need} bytes for {count} values of {bits} bits; got {packed.numel()}"
        )
    if bits > 8:
        high = unpack_bits(packed[count:], bits - 8, count).long() << 8
        return high | packed[:count]
    if bits == 8:
        return packed[:count]
    groups = -(-count // 8)
    source = scratch(groups * bits, torch.uint8, packed.device, "unpack_bits.source")
    source[:need] = packed[:need]
    source[need:] = 0
    word = torch.zeros(groups, dtype=torch.int64, device=packed.device)  # returned: not kept
    unit = _unit(bits)
    size = unit.itemsize
    word.view(unit).view(groups, 8 // size)[:, : bits // size] = source.view(unit).view(
        groups, bits // size
    )
    high = scratch(groups, torch.int64, packed.device, "unpack_bits.high")
    for lane, field in ((64, 4 * bits), (32, 2 * bits), (16, bits)):
        low = _lane_mask(lane, field)
        torch.bitwise_and(word, low << field, out=high)
        high <<= lane // 2 - field
        word &= low
        word |= high
    return word.view(torch.uint8)[:count]


def _unit(bits: int) -> torch.dtype:
    """The widest integer dtype whose size divides ``bits`` bytes (a packed group's size).

    A group's bytes are copied between its int64 word and the packed stream as elements of
    this dtype: a strided copy costs per element, and 6-bit groups move as three int16
    instead of six bytes.
    """
    return {0: torch.int32, 2: torch.int16}.get(bits % 4, torch.uint8)


def _lane_mask(lane: int, width: int) -> int:
    """Return the int64 whose every ``lane``-bit lane has its low ``width`` bits set."""
    pattern = sum(((1 << width) - 1) << start for start in range(0, 64, lane))
    return pattern - (1 << 64) if pattern >= 1 << 63 else pattern


def rice_parameter(density: float) -> int:
    """Return the Rice parameter ``b`` that STC uses for gaps between kept positions.

    For positions kept independently with probability ``p``, gaps are geometric and the
    Golomb parameter ``2**b`` minimising the expected length is (Sattler et al. 2019, eq. 9)

    ``b* = 1 + floor(log2(log(phi - 1) / log(1 - p)))``,  ``phi = (1 + sqrt(5)) / 2``,

    clamped at 0 (dense positions need no remainder bits).

    Args:
        density: ``p = k / n`` in ``(0, 1]``.
    """
    if not 0.0 < density < 1.0:
        return 0
    golden = (1.0 + math.sqrt(5.0)) / 2.0
    return max(0, 1 + math.floor(math.log2(math.log(golden - 1.0) / math.log1p(-density))))


def rice_encode(values: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rice-code non-negative integers with parameter ``b`` (Golomb code of modulus ``2**b``).

    Each value ``v`` is the quotient ``q = v >> b`` in unary (``q`` one-bits then a zero)
    and the remainder ``v & (2**b - 1)`` in ``b`` bits. The remainders and the unary
    quotients are returned as two separate streams (same total length as interleaving them)
    so that both code and decode are vectorised: the remainders are fixed-width, and the
    quotients are the distances between the zeros of the unary stream.

    Args:
        values: 1-D int64 tensor of non-negative integers.
        b: Rice parameter, ``>= 0``.

    Returns:
        ``(remainders, unary)``: ``pack_bits`` of the remainders (empty when ``b == 0``) and
        the packed unary stream of ``sum(q) + n`` bits.
    """
    values = values.long()
    if values.device.type == "cpu":
        remainders, unary = kernels().rice_encode(values.contiguous().numpy(), b)
        return torch.from_numpy(remainders), torch.from_numpy(unary)
    return _rice_encode_by_tensors(values, b)


def _rice_encode_by_tensors(values: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rice_encode` in torch ops, for any device (the unary stream a byte per bit)."""
    quotients = values >> b
    # The unary stream length is data-dependent: one host sync per call, not per element.
    length = int(quotients.sum()) + values.numel()
    stream = torch.ones(length, dtype=torch.uint8, device=values.device)
    stream[torch.cumsum(quotients + 1, 0) - 1] = 0
    if b == 0:
        remainders = torch.empty(0, dtype=torch.uint8, device=values.device)
    else:
        remainders = pack_bits(values & ((1 << b) - 1), b)
    return remainders, pack_bits(stream, 1)


def rice_decode(remainders: torch.Tensor, unary: torch.Tensor, b: int, count: int) -> torch.Tensor:
    """Invert :func:`rice_encode` for ``count`` values (int64).

    Raises:
        ValueError: the streams hold fewer than ``count`` codes.
    """
    need = packed_nbytes(count, b)
    if remainders.numel() < need:
        raise ValueError(
            f"remainders must hold {need} bytes for {count} values of {b} bits; "
            f"got {remainders.numel()}"
        )
    if unary.device.type == "cpu":
        values = torch.empty(count, dtype=torch.int64)
        found = kernels().rice_decode(remainders.numpy(), unary.numpy(), b, values.numpy())
    else:
        values, found = _rice_decode_by_tensors(remainders, unary, b, count)
    if found < count:
        raise ValueError(f"Rice stream holds {found} codes; expected {count}")
    return values


def _rice_decode_by_tensors(
    remainders: torch.Tensor, unary: torch.Tensor, b: int, count: int
) -> tuple[torch.Tensor, int]:
    """:func:`rice_decode` in torch ops: the values, and how many codes the stream held."""
    stream = unpack_bits(unary, 1, unary.numel() * 8)
    ends = torch.nonzero(stream == 0).view(-1)[:count]
    quotients = torch.diff(ends, prepend=ends.new_tensor([-1])) - 1
    values = quotients << b
    if b and ends.numel() == count:
        values |= unpack_bits(remainders, b, count)
    return values, ends.numel()


def rice_nbytes_bound(count: int, total: int, b: int) -> tuple[int, int]:
    """Return the byte sizes ``(remainders, unary bound)`` of Rice-coding ``count`` values.

    The unary stream has ``sum(v >> b) + count <= (total >> b) + count`` bits when the values
    sum to at most ``total``.
    """
    return packed_nbytes(count, b), packed_nbytes((total >> b) + count, 1)
