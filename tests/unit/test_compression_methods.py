"""Each compressor against an independent reference: Bagua's formula, unbiasedness, bounds."""

from __future__ import annotations

import math
import statistics

import numpy as np
import pytest
import torch

from gossamer.compression import (
    BF16,
    FP16,
    QSGD,
    STC,
    MinMaxUInt8,
    Natural,
    NaturalDithering,
    Payload,
    RandomK,
    Sign,
    TopK,
    compression_quality,
    get_compressor,
)
from gossamer.compression.minmax import MinMaxCodes

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
"""Where each compressor runs: the tests that take ``device`` run on CUDA too (``-m gpu``)."""


def _randn(numel, seed=0, dtype=torch.float32, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen, dtype=torch.float64).to(device, dtype)


# --- MinMaxUInt8: bit-exact with Bagua's compress_float_to_uint8 / decompress kernels --------


def bagua_minmax_uint8(
    x: np.ndarray, chunks: int, levels: int = 255
) -> tuple[list, np.ndarray, np.ndarray]:
    """Bagua's kernel, one chunk at a time, in numpy float32 (the kernel's arithmetic).

    ``levels`` other than 255: the same rounding with that many steps (MinMaxCodes).
    """
    f32 = np.float32
    length = math.ceil(x.size / chunks)
    headers, codes, decoded = [], [], []
    for start in range(0, x.size, length):
        chunk = x[start : start + length]
        lo, hi = chunk.min(), chunk.max()  # in the source dtype, as the header stores them
        scale = f32(levels) / (f32(hi) - f32(lo) + f32(1e-7))
        upper = np.rint(f32(hi) * scale)
        lower = upper - f32(levels)
        level = np.minimum(np.rint(chunk.astype(f32) * scale), upper)
        # CUDA's float -> uint8 conversion saturates.
        q = np.clip(level - lower, 0, levels).astype(np.uint8)
        headers += [lo, hi]
        codes.append(q)
        decoded.append(((q.astype(f32) + lower) / scale).astype(x.dtype))
    return headers, np.concatenate(codes), np.concatenate(decoded)


BAGUA_INPUTS = {
    "normal": lambda n: _randn(n, 1).numpy(),
    "offset-1000": lambda n: (1000.0 + 0.01 * _randn(n, 2)).numpy(),  # levels above 2^24
    "constant": lambda n: np.full(n, 0.3, dtype=np.float32),
    "ramp": lambda n: np.linspace(-3.0, 7.0, n, dtype=np.float32),
    "tiny": lambda n: (1e-6 * _randn(n, 3)).numpy(),
}


@pytest.mark.parametrize("make", BAGUA_INPUTS.values(), ids=BAGUA_INPUTS.keys())
@pytest.mark.parametrize("chunks", [1, 3, 8], ids=lambda c: f"chunks{c}")
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("numel", [1003, 2**20 + 7])  # the second: CPU blocks, long loops
@pytest.mark.parametrize("device", DEVICES)
def test_minmax_uint8_is_bit_exact_with_bagua(make, chunks, dtype, numel, device):
    x = make(numel).astype(dtype)
    headers, codes, decoded = bagua_minmax_uint8(x, chunks)
    compressor = MinMaxUInt8(chunks)
    tensor = torch.from_numpy(x).to(device)
    buffer = compressor.compress(tensor).buffer
    assert buffer.device == tensor.device
    buffer = buffer.cpu()
    head = len(headers) * x.itemsize
    assert buffer[:head].numpy().view(dtype).tolist() == headers
    np.testing.assert_array_equal(buffer[head:].numpy(), codes)
    out = compressor.decompress(Payload(buffer.to(device), tensor.shape, tensor.dtype))
    out = out.cpu().numpy()
    np.testing.assert_array_equal(out.view(np.uint8), decoded.view(np.uint8))  # bit for bit


@pytest.mark.parametrize("device", DEVICES)
def test_minmax_uint8_error_is_within_half_a_step(device):
    x = _randn(10_000, 4, torch.float64, device)
    y = MinMaxUInt8(4).decompress(MinMaxUInt8(4).compress(x))
    for chunk_x, chunk_y in zip(x.view(4, -1), y.view(4, -1), strict=True):
        step = (chunk_x.max() - chunk_x.min()) / 255
        assert (chunk_x - chunk_y).abs().max() <= 0.5 * step * (1 + 1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["kernel", "torch"])
@pytest.mark.parametrize("bad", [float("inf"), -float("inf"), float("nan")])
def test_minmax_uint8_turns_a_chunk_holding_a_non_finite_value_into_nans(dtype, bad):
    # A gradient scaler looks for inf/NaN to skip the step: the chunk must not come back
    # finite, nor raise from inside the kernel; the other chunk is untouched.
    x = torch.tensor([1.0, bad, 2.0, 3.0, 5.0, 4.0], dtype=dtype)
    y = MinMaxUInt8(2).decompress(MinMaxUInt8(2).compress(x))
    assert not torch.isfinite(y[:3]).any()
    torch.testing.assert_close(y[3:], x[3:], atol=2 / 255, rtol=0)


@pytest.mark.parametrize("make", BAGUA_INPUTS.values(), ids=BAGUA_INPUTS.keys())
@pytest.mark.parametrize("bits", [1, 2, 3, 4, 7, 8])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
def test_minmax_codes_are_the_uint8_rounding_with_fewer_levels_packed(make, bits, dtype):
    x = make(1003).astype(dtype)
    headers, codes, decoded = bagua_minmax_uint8(x, 1, levels=2**bits - 1)
    compressor = MinMaxCodes(bits)
    payload = compressor.compress(torch.from_numpy(x))
    buffer = payload.buffer.numpy()
    assert buffer.size == 2 * x.itemsize + math.ceil(1003 * bits / 8)
    assert buffer[: 2 * x.itemsize].view(dtype).tolist() == headers
    stream = np.unpackbits(buffer[2 * x.itemsize :], bitorder="little")[: 1003 * bits]
    unpacked = (stream.reshape(-1, bits).astype(np.int64) << np.arange(bits)).sum(1)
    np.testing.assert_array_equal(unpacked, codes)
    out = compressor.decompress(payload).numpy()
    np.testing.assert_array_equal(out.view(np.uint8), decoded.view(np.uint8))
    if bits == 8:  # MinMaxUInt8's bytes, one chunk
        assert np.array_equal(buffer, MinMaxUInt8().compress(torch.from_numpy(x)).buffer.numpy())


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_minmax_codes_of_a_tensor_holding_a_non_finite_value_are_nans(bad):
    y = MinMaxCodes(4).decompress(MinMaxCodes(4).compress(torch.tensor([1.0, bad, 2.0])))
    assert torch.isnan(y).all()


def test_minmax_codes_take_one_to_eight_bits():
    for bad, error in ((0, ValueError), (9, ValueError), (4.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match="bits must be"):
            MinMaxCodes(bad)


def test_minmax_uint8_uses_fewer_chunks_than_asked_for_short_tensors():
    compressor = MinMaxUInt8(8)
    assert compressor.payload_nbytes(3) == 3 * 8 + 3  # three chunks of one element
    x = torch.tensor([1.0, -2.0, 3.0])
    torch.testing.assert_close(compressor.decompress(compressor.compress(x)), x)


# --- Unbiased quantizers: Monte Carlo over many independent draws -----------------------------

TRIALS = 4000


def _trials(compressor, x):
    """TRIALS independent draws of D(C(x)), vectorised: x repeated, one bucket per copy."""
    repeated = x.repeat(TRIALS)
    return compressor.decompress(compressor.compress(repeated)).view(TRIALS, -1)


def _assert_rounds_between(samples, x, low, high, rtol=1e-12):
    """Each draw is sign(x) * low or sign(x) * high, high with chance (|x| - low) / (high - low).

    That chance is exactly what makes the mean x (unbiased); it is checked per element with
    a binomial bound of five standard deviations, which stays valid for rare events.
    ``rtol`` is how closely a draw must match a level (float32 draws: about 1e-6).
    """
    magnitude = samples.abs()
    is_low = torch.isclose(magnitude, low.expand_as(magnitude), rtol=rtol, atol=0)
    is_high = torch.isclose(magnitude, high.expand_as(magnitude), rtol=rtol, atol=0)
    assert (is_low | is_high).all()
    assert (samples * torch.sign(x) >= 0).all()
    # Clamped: where |x| is a power of two, the chance is 0 or 1, and on CUDA `2 ** floor(
    # log2 |x|)` may miss it by an ulp; the square root below would then be NaN.
    chance = ((x.abs() - low) / (high - low)).clamp(0, 1)
    frequency = is_high.double().mean(0)
    slack = 5 * (chance * (1 - chance) / TRIALS).sqrt() + 2 / TRIALS
    off = (~((frequency - chance).abs() <= slack)).nonzero().view(-1).tolist()  # NaN: off
    assert not off, [(i, x[i].item(), chance[i].item(), frequency[i].item()) for i in off]


def _bucket_norms(x, bucket):
    return x.view(-1, bucket).norm(dim=1).repeat_interleave(bucket)


# On CPU, float32 takes the fused kernels and float64 the torch formulation.
PRECISIONS = [(torch.float64, 1e-12), (torch.float32, 2e-6)]


@pytest.mark.parametrize("dtype, rtol", PRECISIONS, ids=["float64", "float32"])
@pytest.mark.parametrize("levels", [1, 4, 16], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("device", DEVICES)
def test_qsgd_rounds_between_uniform_levels_without_bias(levels, device, dtype, rtol):
    x = _randn(100, 5, torch.float64) * torch.logspace(-3, 1, 100, dtype=torch.float64)
    x = x.to(device, dtype).double()
    samples = _trials(QSGD(levels, seed=2, bucket=50), x.to(dtype)).double()
    norm = _bucket_norms(x, 50)
    low = torch.floor(x.abs() / norm * levels) / levels * norm
    _assert_rounds_between(samples, x, low, low + norm / levels, rtol)
    assert not torch.equal(samples[0], samples[1])  # it is random


@pytest.mark.parametrize("dtype, rtol", PRECISIONS, ids=["float64", "float32"])
@pytest.mark.parametrize("levels", [2, 6], ids=lambda s: f"s{s}")
@pytest.mark.parametrize("device", DEVICES)
def test_natural_dithering_rounds_between_powers_of_two_without_bias(levels, device, dtype, rtol):
    x = _randn(100, 6, torch.float64) * torch.logspace(-3, 1, 100, dtype=torch.float64)
    x = x.to(device, dtype).double()
    samples = _trials(NaturalDithering(levels, seed=2, bucket=50), x.to(dtype)).double()
    norm = _bucket_norms(x, 50)
    smallest = 2.0 ** (1 - levels)
    r = x.abs() / norm
    low = torch.where(r < smallest, 0.0, 2 ** torch.floor(torch.log2(r)))
    high = torch.where(r < smallest, smallest, 2 * low)
    _assert_rounds_between(samples, x, low * norm, high * norm, rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["kernel", "torch"])
@pytest.mark.parametrize("make", [lambda: QSGD(4), lambda: NaturalDithering(4)], ids=["qsgd", "nd"])
@pytest.mark.parametrize("scale", [1e20, 1e30])
def test_norm_quantizers_keep_large_finite_values_finite(dtype, make, scale):
    # float32 squares overflow from |x_i| ~ 1.8e19; the bucket norm must not.
    x = torch.tensor([4.0, -2.0, 1.0, 0.0]).mul(scale).to(dtype)
    y = make().decompress(make().compress(x)).double()
    norm = x.double().norm()
    assert torch.isfinite(y).all() and (y.abs() <= norm * (1 + 1e-2)).all()
    assert y[3] == 0 and (y[:3] * x[:3].double() >= 0).all()


@pytest.mark.parametrize("device", DEVICES)
def test_qsgd_variance_bound(device):
    s, d = 4, 50
    x = _randn(d, 6, torch.float64, device)
    samples = _trials(QSGD(s, bucket=d), x)
    mse = (samples - x).pow(2).sum(1).mean()
    assert mse <= min(d / s**2, math.sqrt(d) / s) * x.norm() ** 2


@pytest.mark.parametrize("device", DEVICES)
def test_natural_is_unbiased_with_variance_at_most_one_eighth(device):
    # |x| = 4/3 * 2^e is where the variance (|x| - 2^e)(2^(e+1) - |x|) peaks, at x^2 / 8.
    exponents = torch.arange(-20, 21, dtype=torch.float64)
    x = torch.cat(
        [4 / 3 * 2**exponents, -1.1 * 2**exponents, 2**exponents, _randn(50, 7, torch.float64)]
    )
    x = x.float().double().to(device)  # natural compression works on float32 values
    samples = _trials(Natural(seed=11), x.float()).double()
    low = 2 ** torch.floor(torch.log2(x.abs()))
    _assert_rounds_between(samples, x, low, 2 * low)
    variance = (x.abs() - low) * (2 * low - x.abs())
    assert (variance <= x.pow(2) / 8 * (1 + 1e-12)).all()
    assert samples.pow(2).sum(1).mean() <= 9 / 8 * x.pow(2).sum() * 1.01


@pytest.mark.parametrize("device", DEVICES)
def test_natural_special_values(device):
    x = torch.tensor([0.0, -0.0, 1.0, -0.25, float("inf"), -float("inf"), 2.0**-130], device=device)
    y = Natural().decompress(Natural().compress(x))
    assert y[:6].tolist() == [0.0, -0.0, 1.0, -0.25, float("inf"), -float("inf")]
    assert torch.signbit(y[1]) and y[6] in (0.0, 2.0**-126)  # below the normal range
    assert Natural().payload_nbytes(16) == 16 + 2  # 9 bits per element


@pytest.mark.parametrize("device", DEVICES)
def test_stochastic_compressors_are_reproducible_and_resumable(device):
    x = _randn(1000, 8, device=device)
    for make in (lambda: QSGD(8, seed=4), lambda: Natural(seed=4), lambda: RandomK(0.1, seed=4)):
        first, second = make(), make()
        assert torch.equal(first.compress(x).buffer, second.compress(x).buffer)
        state = first.state_dict()
        expected = [first.compress(x).buffer for _ in range(3)]
        resumed = make()
        resumed.load_state_dict(state)
        assert [resumed.compress(x).buffer.tolist() for _ in range(3)] == [
            b.tolist() for b in expected
        ]
        assert not torch.equal(expected[0], expected[1])  # each step draws anew
    with pytest.raises(ValueError, match="state must hold exactly the key 'step'"):
        QSGD(4).load_state_dict({"steps": 1})


# --- Sparsifiers --------------------------------------------------------------------------------


@pytest.mark.parametrize("numel", [10, 1000, 600_000], ids=lambda n: f"n{n}")
@pytest.mark.parametrize("device", DEVICES)
def test_topk_keeps_exactly_the_largest_magnitudes(numel, device):
    x = _randn(numel, 9, device=device)
    k = math.ceil(0.01 * numel)
    y = TopK(0.01).decompress(TopK(0.01).compress(x))
    kept = torch.nonzero(y).view(-1)
    expected = torch.argsort(x.abs(), descending=True)[:k]
    assert set(kept.tolist()) == set(expected.tolist())
    assert torch.equal(y[kept], x[kept])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_large_tensor_of_every_dtype_keeps_the_largest_magnitudes(dtype):
    # 16-bit magnitudes tie often: the k kept are the largest, whichever of equals is kept.
    x = _randn(600_000, 12, dtype)
    k = math.ceil(0.01 * x.numel())
    y = TopK(0.01).decompress(TopK(0.01).compress(x))
    kept = torch.nonzero(y).view(-1)
    dropped = torch.ones_like(x, dtype=torch.bool)
    dropped[kept] = False
    assert kept.numel() == k and torch.equal(y[kept], x[kept])
    assert x[kept].abs().min() >= x[dropped].abs().max()


def test_topk_large_tensor_falls_back_when_the_sample_misleads():
    # The sampled positions (every 9th) hold the largest values but fewer than k: the
    # threshold estimated from the sample lets too few through, and the full topk decides.
    numel, k = 600_000, 70_000
    x = _randn(numel, 10)
    x[::9] = 5.0 + torch.arange(-(-numel // 9), dtype=torch.float32) * 1e-5
    y = TopK(k / numel).decompress(TopK(k / numel).compress(x))
    expected = torch.argsort(x.abs(), descending=True)[:k]
    assert set(torch.nonzero(y).view(-1).tolist()) == set(expected.tolist())


@pytest.mark.parametrize("device", DEVICES)
def test_topk_large_tensor_reads_the_entries_past_its_rows(device):
    # The candidate search cuts the tensor into 16 rows; the 13 entries left over are
    # searched on their own and here hold three of the largest magnitudes.
    numel = 16 * 40_000 + 13
    x = _randn(numel, 11, device=device)
    x[-3:] = torch.tensor([50.0, -60.0, 70.0])
    y = TopK(0.01).decompress(TopK(0.01).compress(x))
    expected = torch.argsort(x.abs(), descending=True)[: math.ceil(0.01 * numel)]
    assert set(torch.nonzero(y).view(-1).tolist()) == set(expected.tolist())
    assert y[-3:].tolist() == [50.0, -60.0, 70.0]


def test_topk_payload_bit_packs_indices():
    numel = 5_260_000
    k = math.ceil(0.01 * numel)
    assert TopK(0.01).payload_nbytes(numel) == 4 * k + math.ceil(k * 23 / 8)


@pytest.mark.parametrize("device", DEVICES)
def test_randomk_regenerates_indices_from_the_header(device):
    x = _randn(1000, 12, device=device)
    sender, receiver = RandomK(0.1, seed=3), RandomK(0.1, seed=99)
    payload = sender.compress(x)
    assert payload.nbytes == 16 + 100 * 4  # seed and step, then the values: no indices
    y = receiver.decompress(payload)
    kept = torch.nonzero(y).view(-1)
    assert kept.numel() == 100 and torch.equal(y[kept], x[kept])
    # One position per block of ten, each block visited once.
    assert torch.equal(kept.cpu() // 10, torch.arange(100))
    other = sender.compress(x)
    assert not torch.equal(torch.nonzero(sender.decompress(other)).view(-1), kept)


@pytest.mark.parametrize("bits", [8, 4, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64])
def test_quantized_randomk_sends_codes_at_the_same_positions(dtype, bits):
    x = _randn(1000, 5).to(dtype)
    plain, quantized = RandomK(0.1, seed=4), RandomK(0.1, seed=4, quantize=True, bits=bits)
    want, payload = plain.decompress(plain.compress(x)), quantized.compress(x)
    # seed and step, the (min, max) of the kept values, then 100 codes of `bits` bits
    assert payload.nbytes == 16 + 2 * dtype.itemsize + math.ceil(100 * bits / 8)
    got = quantized.decompress(payload)
    kept = want != 0
    assert not got[~kept].any()  # (a kept value may round to 0)
    # Min-max codes of each kept value: the error is at most half a step of the range.
    lo, hi = want[kept].double().min(), want[kept].double().max()
    step = (hi - lo) / (2**bits - 1)
    assert (got[kept].double() - want[kept].double()).abs().max() <= step / 2 * 1.01
    assert torch.equal(quantized.kept_values(payload), got[kept])
    doubled = quantized.with_values(payload, 2 * quantized.kept_values(payload))
    assert torch.equal(doubled, 2 * got)


def test_randomk_same_seed_same_positions_on_every_rank():
    a, b = RandomK(0.05, seed=7), RandomK(0.05, seed=7)
    ya = a.decompress(a.compress(_randn(2000, 1)))
    yb = b.decompress(b.compress(_randn(2000, 2)))
    assert torch.equal(ya != 0, yb != 0)


@pytest.mark.parametrize("numel", [100, 97], ids=["aligned", "uneven-blocks"])
@pytest.mark.parametrize("device", DEVICES)
def test_unbiased_randomk_is_unbiased(numel, device):
    x = _randn(numel, 13, torch.float64, device)
    compressor = RandomK(0.1, unbiased=True, seed=1)
    # TRIALS copies in one tensor: one kept position per block of about ten, so each copy is
    # an independent draw; kept values are scaled by their block size, about 10.
    samples = compressor.decompress(compressor.compress(x.repeat(TRIALS))).view(TRIALS, -1)
    kept = samples != 0
    ratio = samples[kept] / x.repeat(TRIALS, 1)[kept]
    assert ((ratio - ratio.round()).abs() < 1e-12).all() and set(ratio.round().tolist()) <= {
        9,
        10,
        11,
    }
    # Var = x^2 (n_j - 1) <= 10 x^2 per draw.
    bound = 5 * x.abs() * math.sqrt(10 / TRIALS)
    assert ((samples.mean(0) - x).abs() <= bound).all()
    assert kept.double().mean().item() == pytest.approx(0.1, abs=0.002)
    biased = RandomK(0.1, seed=1)
    assert (biased.decompress(biased.compress(x)).abs() <= x.abs()).all()


@pytest.mark.parametrize("stride", [1, 3], ids=["every-call", "every-3rd"])
def test_cyclic_randomk_comes_back_to_every_position(stride):
    """Weyl-sequence offsets: each position returns within a bounded number of calls."""
    numel, blocks = 1000, 20  # blocks of 50
    compressor = RandomK(blocks / numel, cyclic=True, seed=4)
    x = _randn(numel, 15)
    last = torch.full((numel,), -1)
    gaps = []
    for call in range(200 * stride):
        payload = compressor.compress(x)
        if call % stride:
            continue  # another tensor's call, as when several buckets share the compressor
        kept = torch.nonzero(compressor.decompress(payload)).view(-1)
        assert torch.equal(kept // 50, torch.arange(blocks))  # one per block, as plain
        seen = last[kept] >= 0
        gaps.append((call - last[kept][seen]) // stride)
        last[kept] = call
    gaps = torch.cat(gaps)
    assert (last >= 0).all()  # every position kept in 4 block lengths
    # Plain random-k's gaps are geometric (mean 50, 1 % above 230); these stay near 50.
    assert 0.6 * 50 <= gaps.float().mean().item() <= 1.1 * 50
    assert gaps.min() >= 10 and gaps.max() <= 2 * 50


def test_cyclic_randomk_is_uniform_over_seeds():
    # P(keep i) = 1 / block size at any step, over the phases drawn from the seed.
    x, seeds = torch.ones(50, dtype=torch.float64), 400
    counts = torch.zeros(50, dtype=torch.float64)
    for seed in range(seeds):
        compressor = RandomK(0.1, cyclic=True, seed=seed)
        counts += compressor.decompress(compressor.compress(x)) != 0
    assert ((counts / seeds - 0.1).abs() < 5 * math.sqrt(0.09 / seeds)).all()
    assert counts.sum() == 5 * seeds  # one per block of ten
    unbiased = RandomK(0.1, unbiased=True, cyclic=True, seed=1)
    assert unbiased.decompress(unbiased.compress(x)).sum().item() == pytest.approx(50)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])  # compiled, torch decode
@pytest.mark.parametrize("numel", [10_000, 600_001])  # the second: the sampled threshold
def test_stc_matches_its_definition(device, dtype, numel):
    x = _randn(numel, 14, dtype, device)
    k = math.ceil(0.01 * numel)
    payload = STC(0.01).compress(x)
    y = STC(0.01).decompress(payload)
    top = torch.argsort(x.abs(), descending=True)[:k]
    mu = x[top].abs().mean()
    expected = torch.zeros_like(x)
    expected[top] = mu * torch.sign(x[top])
    torch.testing.assert_close(y, expected)
    target = _randn(numel, 15, dtype, device)
    torch.testing.assert_close(STC(0.01).decompress_add_(payload, target.clone()), target + y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_stc_rejects_a_payload_of_another_size(dtype):
    x = torch.zeros(100, dtype=dtype)
    x[99] = 1.0  # one entry at 99; 90 elements take the same Rice parameter (6), 64 not
    payload = STC(0.01).compress(x)
    target = torch.ones(90, dtype=dtype)
    with pytest.raises(ValueError, match="position 99, beyond 90"):
        STC(0.01).decompress_add_(type(payload)(payload.buffer, (90,), dtype), target)
    assert torch.equal(target, torch.ones(90, dtype=dtype))  # nothing added
    with pytest.raises(ValueError, match="Rice parameter is 6; 64 elements take 5"):
        STC(0.01).decompress(type(payload)(payload.buffer, (64,), dtype))


@pytest.mark.parametrize("numel", [1000, 100_000, 1_000_003], ids=lambda n: f"n{n}")
def test_stc_golomb_positions_beat_raw_int32_indices(numel):
    k = math.ceil(0.01 * numel)
    payload = STC(0.01).compress(_randn(numel, 15))
    assert payload.nbytes < 4 * k  # all of it, against the indices alone as int32
    assert payload.nbytes <= STC(0.01).payload_nbytes(numel)


@pytest.mark.parametrize("device", DEVICES)
def test_sign_is_scaled_by_the_mean_magnitude(device):
    x = torch.tensor([0.5, -1.5, 0.0, 2.0, -1.0], device=device)
    y = Sign().decompress(Sign().compress(x))
    assert y.tolist() == [1.0, -1.0, 1.0, 1.0, -1.0]
    x = _randn(1001, 16, torch.float64, device)
    y = Sign().decompress(Sign().compress(x))
    scale = x.abs().mean()
    torch.testing.assert_close(y, torch.where(x < 0, -scale, scale))


@pytest.mark.parametrize("bucket", [0, 1, 7, 512, 2000])
@pytest.mark.parametrize("numel", [1001, 2**17 + 3])  # the second: the kernel's blocks (float32)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("device", DEVICES)
def test_sign_with_buckets_scales_each_run_by_its_mean_magnitude(bucket, numel, dtype, device):
    x = _randn(numel, 17, torch.float64) * torch.linspace(0.01, 10, numel, dtype=torch.float64)
    x = x.to(device, dtype)
    c = Sign(bucket=bucket)
    payload = c.compress(x)
    width = bucket or numel
    runs = -(-numel // width)
    assert (
        payload.nbytes == c.payload_nbytes(numel, dtype) == dtype.itemsize * runs + -(-numel // 8)
    )
    x64 = x.double()
    scales = torch.cat([x64[i : i + width].abs().mean().reshape(1) for i in range(0, numel, width)])
    scale = scales.repeat_interleave(width)[:numel].to(dtype)
    expected = torch.where(x < 0, -scale, scale)
    torch.testing.assert_close(c.decompress(payload), expected)
    target = torch.ones_like(x)
    torch.testing.assert_close(c.decompress_add_(payload, target), expected + 1)
    assert get_compressor(c.name) == c and c.name == (
        "sign" if bucket == 0 else f"sign:bucket={bucket}"
    )
    with pytest.raises(ValueError, match="bucket"):
        Sign(bucket=-1)


@pytest.mark.parametrize(
    ("compressor", "dtype"), [(FP16(), torch.float16), (BF16(), torch.bfloat16)]
)
@pytest.mark.parametrize("device", DEVICES)
def test_casts_round_to_nearest(compressor, dtype, device):
    x = _randn(1000, 17, torch.float64, device)
    y = compressor.decompress(compressor.compress(x))
    assert torch.equal(y, x.to(dtype).to(torch.float64))


def test_compression_quality_matches_closed_forms():
    z = statistics.NormalDist().inv_cdf(1 - 0.005)  # top 1 % of |N(0, 1)|: |x| > z
    top_share = 2 * z * statistics.NormalDist().pdf(z) + 0.01  # E[x^2; |x| > z]
    assert compression_quality(TopK(0.01), 100_000) == pytest.approx(top_share, abs=0.003)
    assert compression_quality(Sign(), 100_000) == pytest.approx(2 / math.pi, abs=0.005)
    assert compression_quality(RandomK(0.1), 100_000) == pytest.approx(0.1, abs=0.005)
    assert compression_quality(get_compressor("none"), 10) == 1.0
    stream = RandomK(0.1, seed=3)
    compression_quality(stream, 1000)
    assert stream.step == 0  # a copy drew the probes' positions
    with pytest.raises(ValueError, match="numel must be >= 1; got 0"):
        compression_quality(TopK(0.1), 0)
    with pytest.raises(TypeError, match="compressor must be a Compressor"):
        compression_quality("topk:0.1", 10)
