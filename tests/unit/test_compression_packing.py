"""Bit packing and Rice coding against plain-Python references; error feedback's identities."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from gossamer.compression import (
    QSGD,
    STC,
    ErrorFeedback,
    MinMaxUInt8,
    NoCompression,
    RandomK,
    Sign,
    TopK,
    packing,
)
from gossamer.compression.packing import (
    pack_bits,
    packed_nbytes,
    rice_decode,
    rice_encode,
    rice_parameter,
    unpack_bits,
)


def _bitstream(values: list[int], bits: int) -> bytes:
    """LSB-first bit stream, value i at bits [i * bits, (i + 1) * bits): the reference."""
    stream = 0
    for i, value in enumerate(values):
        stream |= value << (i * bits)
    return stream.to_bytes(packed_nbytes(len(values), bits), "little")


BITS = [1, 2, 3, 5, 6, 7, 8, 9, 12, 16, 23, 33]
COUNTS = [0, 1, 7, 8, 9, 63, 1001]


@pytest.mark.parametrize("bits", BITS, ids=lambda b: f"{b}bits")
@pytest.mark.parametrize("count", COUNTS, ids=lambda n: f"n{n}")
def test_pack_unpack_round_trip(bits, count):
    gen = torch.Generator().manual_seed(bits * 1000 + count)
    values = torch.randint(0, 2**bits, (count,), generator=gen)
    values[: min(count, 2)] = 2**bits - 1  # the widest value
    packed = pack_bits(values, bits)
    assert packed.dtype == torch.uint8 and packed.numel() == packed_nbytes(count, bits)
    unpacked = unpack_bits(packed, bits, count)
    assert unpacked.dtype == (torch.uint8 if bits <= 8 else torch.int64)
    assert torch.equal(unpacked.long(), values)
    if bits <= 8:  # the plain bit stream
        assert bytes(packed.tolist()) == _bitstream(values.tolist(), bits)


@pytest.mark.parametrize("bits", [1, 4, 6], ids=lambda b: f"{b}bits")
@pytest.mark.parametrize("count", [5, 1000], ids=lambda n: f"n{n}")
def test_packed_results_survive_later_calls(bits, count):
    # The packers keep their temporaries per thread; what they return must not be one.
    first = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(1))
    packed = pack_bits(first, bits)
    unpacked = unpack_bits(packed, bits, count)
    expected = (packed.clone(), unpacked.clone())
    for seed in (2, 3):
        other = torch.randint(0, 2**bits, (count,), generator=torch.Generator().manual_seed(seed))
        unpack_bits(pack_bits(other, bits), bits, count)
    assert torch.equal(packed, expected[0]) and torch.equal(unpacked, expected[1])


def test_pack_bits_accepts_bools_and_ignores_trailing_bytes():
    flags = torch.tensor([True, False, True, True, False, False, False, False, True])
    packed = pack_bits(flags, 1)
    assert packed.tolist() == [0b00001101, 0b1]
    padded = torch.cat([packed, torch.tensor([255], dtype=torch.uint8)])
    assert unpack_bits(padded, 1, 9).bool().tolist() == flags.tolist()


def test_packing_errors():
    with pytest.raises(ValueError, match=r"bits must be an int in \[1, 63\]; got 0"):
        pack_bits(torch.zeros(3, dtype=torch.int64), 0)
    with pytest.raises(ValueError, match="packed must hold 2 bytes for 3 values of 5 bits; got 1"):
        unpack_bits(torch.zeros(1, dtype=torch.uint8), 5, 3)


def _rice_reference(values: list[int], b: int) -> tuple[int, int]:
    """Bit lengths of the remainder and unary streams of a Rice code of parameter b."""
    return len(values) * b, sum((v >> b) + 1 for v in values)


def _packed_reference(values: list[int], bits: int) -> bytes:
    """pack_bits' layout: above 8 bits a plane of the low bytes, then the rest packed."""
    if bits > 8:
        return bytes(v & 0xFF for v in values) + _packed_reference(
            [v >> 8 for v in values], bits - 8
        )
    return _bitstream(values, bits) if bits else b""


def _unary_reference(values: list[int], b: int) -> bytes:
    """Each v as v >> b one-bits then a zero, one LSB-first stream."""
    stream, at = 0, 0
    for v in values:
        stream |= ((1 << (v >> b)) - 1) << at
        at += (v >> b) + 1
    return stream.to_bytes(packed_nbytes(at, 1), "little")


# The compiled coder (CPU) and the torch one (other devices) write the same bytes.
RICE_CODERS = {
    "compiled": (rice_encode, rice_decode),
    "tensors": (packing._rice_encode_by_tensors, packing._rice_decode_by_tensors),
}


@pytest.mark.parametrize("coder", RICE_CODERS)
@pytest.mark.parametrize("b", [0, 1, 3, 6, 9, 17], ids=lambda b: f"b{b}")
@pytest.mark.parametrize("count", [0, 1, 504], ids=lambda n: f"n{n}")
def test_rice_code_is_its_definition_byte_for_byte(coder, b, count):
    encode, decode = RICE_CODERS[coder]
    gen = torch.Generator().manual_seed(b * 7 + count)
    special = torch.tensor([0, 1, 2**b, 5000, 2**b - 1, 255 << b])[:count]
    values = torch.cat(
        [special, torch.randint(0, 300 << b, (count - special.numel(),), generator=gen)]
    )
    remainders, unary = encode(values, b)
    mask = (1 << b) - 1
    assert bytes(remainders.tolist()) == _packed_reference([v & mask for v in values.tolist()], b)
    assert bytes(unary.tolist()) == _unary_reference(values.tolist(), b)
    remainder_bits, unary_bits = _rice_reference(values.tolist(), b)
    assert remainders.numel() == packed_nbytes(remainder_bits, 1)
    assert unary.numel() == packed_nbytes(unary_bits, 1)
    decoded = decode(remainders, unary, b, count)
    if coder == "tensors":
        decoded, found = decoded
        assert found == count
    assert torch.equal(decoded, values)


def test_rice_decode_detects_a_short_stream():
    remainders, unary = rice_encode(torch.tensor([3, 900, 2]), 2)
    with pytest.raises(ValueError, match="Rice stream holds 1 codes; expected 3"):
        rice_decode(remainders, unary[:10], 2, 3)
    with pytest.raises(ValueError, match="remainders must hold 1 bytes for 3 values of 2 bits"):
        rice_decode(remainders[:0], unary, 2, 3)
    assert packing._rice_decode_by_tensors(remainders, unary[:10], 2, 3)[1] == 1


def test_rice_parameter_is_stc_optimal():
    # b* = 1 + floor(log2(log(phi - 1) / log(1 - p))) (Sattler et al. 2019).
    assert [rice_parameter(p) for p in (0.5, 0.1, 0.01, 0.001)] == [0, 3, 6, 9]
    assert rice_parameter(1.0) == 0
    # Geometric gaps of mean 1/p - 1 cost the least near b*.
    gen = torch.Generator().manual_seed(0)
    positions = torch.nonzero(torch.rand(200_000, generator=gen) < 0.01).view(-1)
    gaps = torch.diff(positions, prepend=positions.new_tensor([-1])) - 1
    lengths = {b: sum(_rice_reference(gaps.tolist(), b)) for b in range(3, 10)}
    assert min(lengths, key=lengths.get) in (5, 6, 7)


# --- Error feedback -----------------------------------------------------------------------------

EF_COMPRESSORS = {
    "topk": TopK(0.1),
    "stc": STC(0.1),
    "sign": Sign(),
    "uint8": MinMaxUInt8(),
    "randomk": RandomK(0.2, seed=3),
    "randomk-quantize": RandomK(0.2, seed=3, quantize=True),
    "randomk-quantize-4bits": RandomK(0.2, seed=3, quantize=True, bits=4),
    "qsgd": QSGD(2, seed=3),
}


def _inputs(steps, seed=0, shape=(6, 50)):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen, dtype=torch.float64) for _ in range(steps)]


@pytest.mark.parametrize("compressor", EF_COMPRESSORS.values(), ids=EF_COMPRESSORS.keys())
def test_error_feedback_loses_nothing_it_only_delays(compressor):
    ef = ErrorFeedback(compressor)
    xs = _inputs(25)
    sent = sum(ef.decompress(ef.compress(x, key="w")) for x in xs)
    torch.testing.assert_close(sent + ef.residual("w"), sum(xs), rtol=0, atol=1e-10)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # fused kernels, torch
@pytest.mark.parametrize("compressor", EF_COMPRESSORS.values(), ids=EF_COMPRESSORS.keys())
def test_error_feedback_residual_is_exactly_the_difference(compressor, dtype):
    # Fresh copies of the configuration: both draw the same streams from the start.
    ef, replica = ErrorFeedback(dataclasses.replace(compressor)), dataclasses.replace(compressor)
    residual = torch.zeros(6, 50, dtype=dtype)
    for x in (x.to(dtype) for x in _inputs(4, seed=2)):
        kept = x.clone()
        corrected = x + residual
        residual = corrected - replica.decompress(replica.compress(corrected))
        ef.compress(x, key="w")
        assert torch.equal(x, kept)  # the input is not touched
        assert torch.equal(ef.residual("w"), residual)


def test_error_feedback_residual_is_the_compression_error():
    ef = ErrorFeedback(TopK(0.5))
    payload = ef.compress(torch.tensor([1.0, -3.0, 0.5, 2.0]), key="w")
    assert ef.decompress(payload).tolist() == [0.0, -3.0, 0.0, 2.0]
    assert ef.residual("w").tolist() == [1.0, 0.0, 0.5, 0.0]
    # The next call sends what was held back: 1 + 1 beats the others.
    payload = ef.compress(torch.tensor([1.0, 0.0, 0.0, 0.1]), key="w")
    assert ef.decompress(payload).tolist() == [2.0, 0.0, 0.5, 0.0]


@pytest.mark.parametrize("compressor", EF_COMPRESSORS.values(), ids=EF_COMPRESSORS.keys())
def test_error_feedback_state_dict_resumes_identically(compressor):
    xs = _inputs(6, seed=1)
    ef = ErrorFeedback(dataclasses.replace(compressor))  # same configuration, fresh state
    for x in xs[:3]:
        ef.compress(x, key="a")
        ef.compress(2 * x, key=("b", 1))
    state = ef.state_dict()
    resumed = ErrorFeedback(dataclasses.replace(compressor))
    resumed.load_state_dict(state)
    for x in xs[3:]:
        for key, value in (("a", x), (("b", 1), 2 * x)):
            assert torch.equal(
                ef.compress(value, key=key).buffer, resumed.compress(value, key=key).buffer
            )
    # The snapshot was not changed by the later steps, and the copies are independent.
    assert state["residuals"]["a"] is not ef.residual("a")


def test_error_feedback_keys_reset_and_errors():
    ef = ErrorFeedback(Sign())
    ef.compress(torch.ones(3), key=0)
    ef.compress(torch.ones(2, 2), key=1)
    assert repr(ef) == "ErrorFeedback(Sign(bucket=0), residuals=2)"
    with pytest.raises(
        ValueError, match=r"tensor for key=0 must match its residual \(\(3,\), torch.float32"
    ):
        ef.compress(torch.ones(4), key=0)
    with pytest.raises(ValueError, match="tensor for key=1 must match"):
        ef.compress(torch.ones(2, 2, dtype=torch.float64), key=1)
    ef.reset(0)
    assert ef.residual(0) is None and ef.residual(1) is not None
    ef.compress(torch.ones(4), key=0)  # a new shape is fine after a reset
    ef.reset()
    assert ef.state_dict()["residuals"] == {}
    with pytest.raises(TypeError, match="compressor must be a Compressor; got str"):
        ErrorFeedback("sign")
    for dtype in (torch.bool, torch.int8):  # `none` passes them, but a residual cannot
        with pytest.raises(TypeError, match=f"must be a floating tensor; got {dtype}"):
            ErrorFeedback(NoCompression()).compress(torch.ones(3, dtype=dtype), key=0)
    with pytest.raises(ValueError, match="state must hold 'compressor' and 'residuals'"):
        ef.load_state_dict({"residuals": {}})
    with pytest.raises(ValueError, match=r"state\['residuals'\] must map keys to tensors; got 'w'"):
        ef.load_state_dict({"compressor": {}, "residuals": {"w": [1.0]}})


def test_error_feedback_with_a_lossless_compressor_keeps_zero_residuals():
    ef = ErrorFeedback(NoCompression())
    ef.compress(torch.arange(5.0), key="w")
    assert torch.equal(ef.residual("w"), torch.zeros(5))
