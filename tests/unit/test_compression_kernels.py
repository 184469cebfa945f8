"""The fused CPU kernels against numpy references of the formulas, element by element."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gossamer.compression import QSGD, STC, Natural, NaturalDithering
from gossamer.compression._random import RandomWords, hashed_words, stream_keys
from gossamer.compression.packing import unpack_bits
from gossamer.compression.sparsification import _at_least

F32 = np.float32
# Sizes around the kernels' blocks (65,536 elements) and packing groups (8).
SIZES = [1, 7, 9, 512, 1000, 65536 * 2 + 13]


def _lowbias32(v: int) -> int:
    mask = 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & mask
    v ^= v >> 15
    v = (v * 0x846CA68B) & mask
    return v ^ (v >> 16)


def test_hashed_words_are_the_documented_hash_of_the_counter():
    k1, k2 = stream_keys(3, 5)
    start = 2**32 - 3  # the counter wraps mod 2^32
    expect = [
        _lowbias32((_lowbias32((i + int(k1)) & 0xFFFFFFFF) + int(k2)) & 0xFFFFFFFF)
        for i in range(start, start + 6)
    ]
    assert hashed_words((k1, k2), start, 6).tolist() == [e & 0xFFFFFFFF for e in expect]


def test_random_words_continue_the_stream_block_after_block():
    words = RandomWords(9, 4)
    taken = torch.cat([words.take(5), words.take(11)]).numpy().view(np.uint32)
    assert np.array_equal(taken, hashed_words(stream_keys(9, 4), 0, 16))


def test_hashed_words_look_uniform():
    words = hashed_words(stream_keys(1, 0), 0, 1 << 16)
    bits = (words[:, None] >> np.arange(32, dtype=np.uint32)) & 1
    assert np.abs(bits.mean(0) - 0.5).max() < 0.01  # every bit, 5 standard deviations
    assert not np.array_equal(words, hashed_words(stream_keys(1, 1), 0, 1 << 16))


def _x(numel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen) * torch.logspace(-4, 1, numel)


def _payload_parts(compressor, x):
    """Compress ``x`` (float32) as call 0 and return (norms, codes) read from the payload."""
    compressor.load_state_dict({"step": 0})
    buffer = compressor.compress(x).buffer.numpy()
    width = min(compressor.bucket, x.numel())
    head = -(-x.numel() // width) * 4
    codes = unpack_bits(torch.from_numpy(buffer[head:].copy()), compressor.bits, x.numel())
    return buffer[:head].view(F32), codes.numpy(), width


def _expanded(norms, width, numel):
    return np.repeat(norms, width)[:numel]


@pytest.mark.parametrize("numel", SIZES)
# Levels 1 to 64 pack their codes in 2 to 7 bits, 127 in 8: every width the kernels pack.
# Buckets of 17 make blocks of 481 x 17 x 8 elements, so the 3-bit codes of the second
# block start at an odd byte.
@pytest.mark.parametrize(
    "levels, bucket",
    [
        (1, 512),
        (2, 64),
        (2, 17),
        (4, 77),
        (8, 512),
        (16, 512),
        (32, 5),
        (127, 10**6),
        (16, 131_085),
    ],
)
def test_qsgd_kernel_codes_follow_the_formula(numel, levels, bucket):
    x = _x(numel)
    qsgd = QSGD(levels, seed=5, bucket=bucket)
    norms, codes, width = _payload_parts(qsgd, x)
    rows = np.pad(x.double().numpy(), (0, -numel % width)).reshape(-1, width)
    np.testing.assert_allclose(norms, np.linalg.norm(rows, axis=1), rtol=2e-6)
    # The reference: floor(s + u + x s / ||x_B||), u the word's low 24 bits / 2^24.
    s = F32(levels)
    u = s + (hashed_words(stream_keys(5, 0), 0, numel) & 0xFFFFFF).astype(F32) * F32(2**-24)
    scale = np.where(norms > 0, s / np.where(norms > 0, norms, 1), F32(0))
    t = u + x.numpy() * _expanded(scale, width, numel)
    expect = np.clip(t, 0, 2 * levels).astype(np.uint8)
    assert np.array_equal(codes, expect)
    # Decoding: value (c - s) / s times the bucket's norm.
    values = (codes.astype(F32) - s) / s * _expanded(norms, width, numel)
    qsgd.load_state_dict({"step": 0})
    assert np.array_equal(qsgd.decompress(qsgd.compress(x)).numpy(), values)


@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("levels, bucket", [(8, 512), (3, 77)])
def test_natural_dithering_kernel_codes_follow_the_formula(numel, levels, bucket):
    x = _x(numel, 1)
    x[: min(3, numel)] = 0.0  # r below the smallest level, rounding to 0 or to it
    dithering = NaturalDithering(levels, seed=6, bucket=bucket)
    norms, codes, width = _payload_parts(dithering, x)
    # The reference: r = |x| / ||x_B|| (r + 2^(1-s) below the smallest level 2^(1-s)); a
    # 23-bit draw added to its mantissa carries into its exponent with the chance to round up.
    tiny = F32(2.0 ** (1 - levels))
    r = np.abs(x.numpy()) / _expanded(np.where(norms > 0, norms, F32(1)), width, numel)
    small = r < tiny
    r = np.where(small, r + tiny, r).astype(F32)
    words = hashed_words(stream_keys(6, 0), 0, numel)
    exponent = (r.view(np.int32) + (words & 0x7FFFFF).astype(np.int32)) >> 23
    k = np.clip(exponent + levels - 128 + ~small, 0, levels)
    expect = (levels + np.where(x.numpy() < 0, -k, k)).astype(np.uint8)
    assert np.array_equal(codes, expect)
    level = np.where(k > 0, np.ldexp(F32(1), (k - levels).astype(np.int32)), 0).astype(F32)
    values = np.where(x.numpy() < 0, -level, level) * _expanded(norms, width, numel)
    dithering.load_state_dict({"step": 0})
    assert np.array_equal(dithering.decompress(dithering.compress(x)).numpy(), values)


@pytest.mark.parametrize("numel", SIZES)
def test_natural_kernel_follows_the_formula(numel):
    x = _x(numel, 2)
    x[: min(4, numel)] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])[: min(4, numel)]
    natural = Natural(seed=7)
    buffer = natural.compress(x).buffer.numpy()
    # The reference: a 23-bit draw added to the magnitude's bits carries into the exponent
    # with the chance to round up; the exponent byte, then the sign bits LSB-first.
    bits = x.numpy().view(np.uint32)
    words = hashed_words(stream_keys(7, 0), 0, numel)
    magnitude = np.minimum(((bits & 0x7FFFFFFF) + (words & 0x7FFFFF)) >> 23, 0xFF)
    assert np.array_equal(buffer[:numel], magnitude.astype(np.uint8))
    assert np.array_equal(buffer[numel:], np.packbits(bits >> 31, bitorder="little"))
    decoded = (magnitude.astype(np.uint32) << 23) | (bits & 0x80000000)
    natural.load_state_dict({"step": 0})
    assert np.array_equal(natural.decompress(natural.compress(x)).numpy().view(np.uint32), decoded)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("room", [3, 10**5])  # 3: fewer than found, a second pass
def test_top_k_candidates_are_every_entry_at_or_above_the_threshold(dtype, room):
    x = _x(100_003, 4).to(dtype)
    x[[5, 77, 100_000]] = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=dtype)
    threshold = x[1234].abs()  # an entry equal to it counts
    found, values = _at_least(x, threshold, room)
    magnitude = np.abs(x.numpy())
    assert np.array_equal(found.numpy(), np.flatnonzero(magnitude >= threshold.item()))
    assert torch.equal(values, x[found])
    assert 5 not in found.tolist() and {77, 100_000, 1234} <= set(found.tolist())


@pytest.mark.parametrize("numel", [9, 65536 * 2 + 13])
def test_kernels_add_in_place_what_they_decode(numel):
    x, target = _x(numel, 5), _x(numel, 6)
    compressors = (QSGD(16, seed=1, bucket=77), NaturalDithering(8, seed=1), Natural(seed=1))
    for compressor in (*compressors, STC(0.01)):
        payload = compressor.compress(x)
        expect = target + compressor.decompress(payload)
        assert torch.equal(compressor.decompress_add_(payload, target.clone()), expect)
        # A payload cut out of a larger receive buffer at an odd offset decodes the same.
        shifted = torch.cat([torch.zeros(1, dtype=torch.uint8), payload.buffer])[1:]
        moved = type(payload)(shifted, payload.shape, payload.dtype)
        assert torch.equal(compressor.decompress(moved), compressor.decompress(payload))
