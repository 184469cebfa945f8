"""Sparsifiers: top-k, random-k and sparse ternary compression (STC)."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np
import torch

from gossamer.compression._common import (
    FusedAdd,
    Reader,
    check_int,
    check_ratio,
    compute_dtype,
    join,
    kept,
    kernels,
    takes_kernels,
)
from gossamer.compression._random import Seeded, generator
from gossamer.compression.base import Compressor, Payload
from gossamer.compression.minmax import MinMaxCodes, MinMaxUInt8
from gossamer.compression.packing import (
    pack_bits,
    packed_nbytes,
    rice_decode,
    rice_encode,
    rice_nbytes_bound,
    rice_parameter,
    unpack_bits,
)
from gossamer.compression.sign import sign_bits

__all__ = ["STC", "RandomK", "TopK"]


def _index_bits(numel: int) -> int:
    """Bits that hold any index in ``[0, numel)``."""
    return max(1, (numel - 1).bit_length())


_SAMPLE = 1 << 16  # about this many magnitudes are sampled to estimate the k-th largest one


def _sample_stride(numel: int) -> int:
    """The stride of the sample: odd, so that it shares no factor with power-of-two widths.

    Every stride-th element, not scattered positions: gathering 65 536 scattered floats of
    a 21 MB tensor misses the cache on each read.
    """
    return max(1, numel // _SAMPLE) | 1


def _top_entries(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the indices and values of the ``k`` largest magnitudes of ``flat``.

    In index order on CPU when the candidates are searched (see :func:`_largest`), in no
    particular order otherwise.

    ``torch.topk`` over millions of elements is slow on CPU (about 90 ms for 5 M). When
    ``k`` is a small fraction of a large tensor, a threshold slightly below the k-th largest
    magnitude is estimated from a sample, and the exact top-k is taken among the entries
    above it; if fewer than ``k`` pass (an unlucky sample), the full ``topk`` decides.
    """
    numel = flat.numel()
    if numel < 8 * _SAMPLE or 8 * k > numel:
        return _entries_at(flat, torch.topk(flat.abs(), k, sorted=False).indices)
    sample = flat[:: _sample_stride(numel)].abs()
    # About `expected` sampled entries lie above the k-th largest magnitude, give or take
    # sqrt(expected): taking the threshold 4 such deviations lower lets fewer than k
    # entries through with negligible probability, at the cost of a few extra candidates.
    expected = k * sample.numel() / numel
    rank = min(sample.numel(), math.ceil(expected + 4 * math.sqrt(expected)) + 16)
    if _numpy_floats(sample):
        threshold = torch.tensor(_kth_largest(sample.numpy(), rank))  # 0.1 ms; topk's 0.5
    else:
        threshold = torch.topk(sample, rank, sorted=False).values.min()
    candidates, values = _at_least(flat, threshold, room=2 * k)
    if candidates.numel() < k:
        return _entries_at(flat, torch.topk(flat.abs(), k, sorted=False).indices)
    # The candidates' values came with them: reading them again from `flat` would miss the
    # cache on every one (3.5 ms for 52,600 of 5.26 M floats).
    chosen = _largest(values.abs(), k)
    return candidates[chosen], values[chosen]


def _entries_at(flat: torch.Tensor, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return indices, flat.index_select(0, indices)


def _largest(magnitudes: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the ``k`` largest of ``magnitudes`` (no NaNs).

    On CPU in increasing order, of equal magnitudes at the cut the first ones: numpy's
    introselect of the ``k``-th largest, then two masks. The candidates arrive in index
    order, so STC's entries leave sorted with no sort (2 ms for its 52,600 of 5.26 M).
    """
    if magnitudes.device.type != "cpu":
        return torch.topk(magnitudes, k, sorted=False).indices
    if not _numpy_floats(magnitudes):
        magnitudes = magnitudes.float()  # exact for 16-bit floats; numpy has no bfloat16
    m = magnitudes.numpy()
    cut = _kth_largest(m, k)
    keep = m > cut
    ties = np.flatnonzero(m == cut)[: k - int(keep.sum())]
    keep[ties] = True
    return torch.from_numpy(np.flatnonzero(keep))


def _numpy_floats(t: torch.Tensor) -> bool:
    """Whether ``t`` is a CPU float32 or float64 tensor (numpy and the kernels take it)."""
    return t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)


def _kth_largest(a: np.ndarray, k: int) -> np.generic:
    """The ``k``-th largest entry of ``a`` (numpy's introselect), in ``a``'s dtype."""
    return np.partition(a, a.size - k)[a.size - k]


_ROWS = 16


def _at_least(
    flat: torch.Tensor, threshold: torch.Tensor, room: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return the indices and values of the entries with ``|x| >= threshold`` (NaN: never).

    ``room`` is how many to make room for at first (more take a second pass on CPU).

    On CPU (float32 and float64) a compiled loop finds them in one pass
    (:func:`._kernels.at_least`); elsewhere, :func:`_at_least_by_columns`.
    """
    if not _numpy_floats(flat):
        return _entries_at(flat, _at_least_by_columns(flat, threshold))
    # The limit keeps its dtype: a float64 limit for float32 data cost a conversion per
    # element (6.1 against 3.9 ms for 5.26 M floats).
    x, limit = flat.detach().contiguous().numpy(), threshold.numpy()[()]
    found = torch.empty(room, dtype=torch.int64)
    values = torch.empty(room, dtype=flat.dtype)
    count = kernels().at_least(x, limit, found.numpy(), values.numpy())
    if count > found.numel():
        found = torch.empty(count, dtype=torch.int64)
        values = torch.empty(count, dtype=flat.dtype)
        kernels().at_least(x, limit, found.numpy(), values.numpy())
    return found[:count], values[:count]


def _at_least_by_columns(flat: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """:func:`_at_least` in torch operations, for every device and dtype.

    ``torch.nonzero`` over the whole tensor took more than half of top-k's time on CPU. So
    ``flat`` is cut into ``_ROWS`` consecutive rows and the rows' element-wise maximum
    magnitude (two vectorised reductions, no temporary of the tensor's size) tells which
    columns hold a candidate: at a 1 % density, 15 % of them. Only those columns are read
    again. A NaN hides the other entries of its column: they are not returned.
    """
    width = flat.numel() // _ROWS
    body = flat[: _ROWS * width].view(_ROWS, width)
    peak = torch.maximum(body.amax(dim=0), body.amin(dim=0).neg_())
    columns = torch.nonzero(peak >= threshold).view(-1)
    hits = torch.nonzero(body.index_select(1, columns).abs_() >= threshold)
    tail = flat[_ROWS * width :]
    return torch.cat(
        [
            hits[:, 0] * width + columns[hits[:, 1]],
            torch.nonzero(tail.abs() >= threshold).view(-1) + _ROWS * width,
        ]
    )


def _scatter(numel: int, indices: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Return a zero vector of ``numel`` elements holding ``values`` at ``indices``."""
    out = torch.zeros(numel, dtype=values.dtype, device=values.device)
    # scatter_ and index_select, not advanced indexing: half and two thirds of its time on
    # CPU (0.9 against 1.8 ms, 1.2 against 1.7 ms for 420 k of 5.26 M floats).
    return out.scatter_(0, indices, values)


class _Entries:
    """A sparsifier whose payload holds ``k`` (index, value) entries (``_entries``)."""

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return _scatter(numel, *self._entries(buffer, numel, dtype))

    def _decode_add(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype, target: torch.Tensor
    ) -> None:
        # Distinct indices: the dense sum, touching only the k entries.
        indices, values = self._entries(buffer, numel, dtype)
        target.scatter_add_(0, indices, values)


@dataclass(frozen=True, repr=False)
class TopK(_Entries, Compressor):
    """Top-k sparsification: keep the ``k = ceil(ratio * d)`` entries of largest magnitude.

    ``C(x)_i = x_i`` if ``|x_i|`` is among the ``k`` largest, else 0 (of equal magnitudes
    at the cut, which are kept is unspecified). Biased, a contraction with
    ``||C(x) - x||^2 <= (1 - k/d) ||x||^2``, and the classical partner of error feedback
    (Stich et al. 2018, "Sparsified SGD with memory"). Payload: the ``k`` values in the
    tensor's dtype, then the ``k`` indices bit-packed in ``ceil(log2 d)`` bits each (23
    bits for 5 M elements, not 32).

    Registry name: ``"topk:<ratio>"``.

    Args:
        ratio: Fraction of entries kept, in ``(0, 1]``; at least one entry is kept.
    """

    spec_name: ClassVar[str] = "topk"

    ratio: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_ratio(self.ratio))

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        k = kept(numel, self.ratio)
        return k * dtype.itemsize + packed_nbytes(k, _index_bits(numel))

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        indices, values = _top_entries(flat, kept(flat.numel(), self.ratio))
        return join(values, pack_bits(indices, _index_bits(flat.numel())))

    def _entries(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = kept(numel, self.ratio)
        reader = Reader(buffer)
        values = reader.take(k, dtype)
        return unpack_bits(reader.rest(), _index_bits(numel), k).long(), values


@dataclass(frozen=True, repr=False)
class RandomK(_Entries, Seeded):
    """Random-k sparsification with indices the receiver regenerates instead of receiving.

    The ``d`` positions are cut into ``k = ceil(ratio * d)`` consecutive blocks of ``d / k``
    (rounded) positions and one position is drawn uniformly in each block (stratified
    random-k): ``k`` distinct indices in O(k) time, no sort, each position kept with
    probability ``1 / n_j`` for its block size ``n_j ~ d / k``. The draw is the stream of
    ``(seed, step)`` on a CPU generator (identical on every device and machine); the payload
    carries ``seed`` and ``step`` (16 bytes) and the ``k`` values, never the indices.

    - ``unbiased=False`` (default): ``C(x)_i = x_i`` on the kept positions. Biased, a
      contraction with ``E||C(x) - x||^2 <= (1 - 1 / ceil(d/k)) ||x||^2``; run it under error
      feedback (the default for biased compressors).
    - ``unbiased=True``: kept values are scaled by ``n_j``, so ``E[C(x)] = x``, at the cost of
      a variance of about ``(d/k - 1) ||x||^2`` (99 times the signal for ``ratio=0.01``).

    Give all ranks the same ``seed`` when their random-k values are to be summed (same
    positions on every rank, as in a compressed allreduce).

    - ``cyclic=True``: block ``j`` (size ``n_j``) keeps offset ``floor(n_j frac(a_j + t /
      phi))`` at call ``t``, with phases ``a_j`` drawn once from ``seed`` and ``phi`` the
      golden ratio (a Weyl sequence). Each position is still kept with probability
      ``1 / n_j`` at every call (over ``a_j``), but it comes back after about ``n_j`` calls
      (three-gap theorem; at most about ``3 n_j`` when a caller's calls reach one tensor
      every 2nd to 7th call) instead of after a geometric wait (mean ``n_j``, one in a
      hundred after more than ``4.6 n_j``): what error feedback holds back is released
      more evenly.
    - ``reset=True``: asks :class:`~gossamer.communicators.CompressedAllreduce` for *error
      reset* (CSER, Xie et al. 2020): each rank applies its own update at once and the
      kept positions replace its residual-corrected values by the ranks' average, so the
      average of the models moves exactly as uncompressed and nothing is released
      ``1/ratio`` steps late. It needs error feedback and the biased form. The payload is
      unchanged; other communication paths treat it as plain random-k.
    - ``quantize=True``: the ``k`` values travel as Bagua's 8-bit MinMaxUInt8 codes
      (:class:`~gossamer.compression.MinMaxUInt8`, one chunk: ``k`` bytes plus the min and
      max) instead of in the tensor's dtype, so four times as many positions fit in the
      bytes of float32 values: ``randomk:0.04:quantize=true`` costs about what
      ``randomk:0.01`` does. The rounding (at most ``(max - min) / 510`` per value) is
      deterministic, so it needs the biased form; error feedback takes it up with the rest.
      A compressed allreduce sums the codes by scatter-reduce-gather (ByteGrad).
    - ``bits=b`` (with ``quantize=True``): ``b``-bit min-max codes instead, packed
      (:class:`~gossamer.compression.minmax.MinMaxCodes`; rounding at most
      ``(max - min) / (2 (2^b - 1))``): ``randomk:0.08:quantize=true:bits=4`` keeps eight
      times the positions of ``randomk:0.01`` in its bytes.

    Registry names: ``"randomk:<ratio>"``, ``"randomk:<ratio>:unbiased=true"``,
    ``"randomk:<ratio>:reset=true:cyclic=true"``, ``"randomk:<ratio>:quantize=true"``,
    ``"randomk:<ratio>:quantize=true:bits=4"``.

    Args:
        ratio: Fraction of entries kept, in ``(0, 1]``.
        unbiased: Scale kept values to make the compressor unbiased (keyword only).
        seed: Seed of the index stream (keyword only).
        reset: Error reset in a compressed allreduce (keyword only).
        cyclic: Weyl-sequence positions instead of independent draws (keyword only).
        quantize: Send the kept values as 8-bit MinMaxUInt8 codes (keyword only).
        bits: With ``quantize``, the code width, in ``[1, 8]`` (keyword only).
    """

    spec_name: ClassVar[str] = "randomk"
    shared_stream: ClassVar[bool] = True

    ratio: float
    unbiased: bool = field(default=False, kw_only=True)  # type: ignore[misc]
    reset: bool = field(default=False, kw_only=True)  # type: ignore[misc]
    cyclic: bool = field(default=False, kw_only=True)  # type: ignore[misc]
    quantize: bool = field(default=False, kw_only=True)  # type: ignore[misc]
    bits: int = field(default=8, kw_only=True)  # type: ignore[misc]

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "ratio", check_ratio(self.ratio))
        for name in ("unbiased", "reset", "cyclic", "quantize"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool; got {getattr(self, name)!r}")
        for name in ("reset", "quantize"):
            if self.unbiased and getattr(self, name):
                raise ValueError(f"{name}=True needs the biased random-k (unbiased=False)")
        check_int(self.bits, "bits", 1, 8)
        if self.bits != 8 and not self.quantize:
            raise ValueError(f"bits={self.bits} needs quantize=True (values are sent as codes)")

    @property
    def values_codec(self) -> Compressor | None:
        """How the kept values are encoded: min-max codes with ``quantize``, else None (raw)."""
        if not self.quantize:
            return None
        return _VALUES if self.bits == 8 else MinMaxCodes(self.bits)

    def kept_values(self, payload: Payload) -> torch.Tensor:
        """The ``k`` kept values of ``payload`` (decoded, in its dtype), in position order."""
        return self._entries(payload.buffer, math.prod(payload.shape), payload.dtype)[1]

    def with_values(self, payload: Payload, values: torch.Tensor) -> torch.Tensor:
        """Decompress ``payload`` with ``values`` (as :meth:`kept_values`) at its positions."""
        indices, _ = self._entries(payload.buffer, math.prod(payload.shape), payload.dtype)
        return _scatter(math.prod(payload.shape), indices, values).view(payload.shape)

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        k = kept(numel, self.ratio)
        codec = self.values_codec
        return 16 + (codec.payload_nbytes(k, dtype) if codec else k * dtype.itemsize)

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel, step = flat.numel(), self._next_step()
        indices, sizes = _stratified(numel, kept(numel, self.ratio), self.seed, step, self.cyclic)
        values = flat.index_select(0, indices.to(flat.device))
        if self.unbiased:
            cdt = compute_dtype(flat.dtype)
            values = (values.to(cdt) * sizes.to(flat.device, cdt)).to(flat.dtype)
        header = torch.tensor([self.seed, step], dtype=torch.int64, device=flat.device)
        codec = self.values_codec
        return join(header, codec.compress(values).buffer if codec else values)

    def _entries(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k = kept(numel, self.ratio)
        reader = Reader(buffer)
        seed, step = reader.take(2, torch.int64).tolist()
        indices, _ = _stratified(numel, k, seed, step, self.cyclic)
        codec = self.values_codec
        if codec is not None:
            codes = buffer[16:].contiguous()
            return indices.to(buffer.device), codec.decompress(Payload(codes, (k,), dtype))
        return indices.to(buffer.device), reader.take(k, dtype)


_VALUES = MinMaxUInt8()  # random-k's quantized values: one chunk, the min and max once


_BITS = 62
_WEYL = 0x9E3779B97F4A7C15 >> (64 - _BITS)  # 2^62 / golden ratio: a Weyl sequence's step
_PHASES = (1 << _BITS) - 1  # the stream of the phases: a step no call reaches


# A round of random-k draws its positions once and regenerates them up to four more times
# (error feedback, the kept values, the sum put back, error reset): 2.8 ms each for 210 k
# positions. The callers only read the tensors.
@functools.lru_cache(maxsize=4)
def _stratified(
    numel: int, k: int, seed: int, step: int, cyclic: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return one uniform index per block of ``[0, numel)`` cut into ``k`` blocks, and sizes.

    The draw is the CPU stream of ``(seed, step)``, so every device gets the same indices.
    ``cyclic``: block ``j`` of size ``n_j`` keeps offset ``floor(n_j frac(a_j + t / phi))``
    with ``a_j`` drawn once from ``seed``: still uniform over ``a_j``, but every position
    comes back after between about ``0.6 n_j`` and ``1.6 n_j`` calls (three-gap theorem),
    whatever the stride at which a caller's calls reach this tensor.
    """
    starts, sizes = _blocks(numel, k)
    if not cyclic:
        # 62 random bits modulo a block size: the modulo bias is below 2^-40 for any tensor.
        draws = torch.randint(0, 1 << _BITS, (k,), generator=generator(seed, step))
        return starts + draws % sizes, sizes
    phases, per_turn, last = _cycle(numel, k, seed)
    # phases < 2^62 and the step's turn < 2^62: the sum fits int64, and the mask is mod 2^62.
    turn = (phases + (step * _WEYL) % (1 << _BITS)).bitwise_and_(_PHASES)
    offsets = (turn.double() * per_turn).long()
    return starts + torch.minimum(offsets, last), sizes


# The parts of the positions that do not change from step to step (8x the positions of
# randomk:0.01, at randomk:0.08:quantize=true:bits=4, made them most of a round's draw).
@functools.lru_cache(maxsize=4)
def _blocks(numel: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first index and the size of each of the ``k`` blocks of ``[0, numel)``."""
    starts = torch.arange(k + 1, dtype=torch.int64) * numel // k
    return starts[:-1], starts[1:] - starts[:-1]


@functools.lru_cache(maxsize=4)
def _cycle(numel: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The Weyl phases ``a_j`` (62-bit), ``n_j / 2^62`` and ``n_j - 1`` of each block."""
    sizes = _blocks(numel, k)[1]
    phases = torch.randint(0, 1 << _BITS, (k,), generator=generator(seed, _PHASES))
    return phases, sizes.double() / 2.0**_BITS, sizes - 1


@dataclass(frozen=True, repr=False)
class STC(FusedAdd, Compressor):
    """Sparse ternary compression (Sattler et al., IEEE TNNLS 2019): top-k, then ``{-mu, 0, mu}``.

    Keep the ``k = ceil(ratio * d)`` entries of largest magnitude, replace each by
    ``mu * sign(x_i)`` with ``mu = mean of |x_i|`` over them, zero the rest. Biased; use
    error feedback (the paper does). Payload: ``mu`` (float32; float64 for float64 tensors),
    the Rice parameter (1 byte), the ``k`` signs (1 bit each), then the sorted positions as
    gaps ``g`` between them, Rice-coded with the STC-optimal parameter ``b*``
    (:func:`~gossamer.compression.packing.rice_parameter`): ``b*`` bits of ``g mod 2^b*`` plus
    ``g >> b*`` in unary, about ``b* + 2`` bits per position (8 at ``ratio=0.01``) instead
    of 32.

    The size depends on the positions: ``payload_nbytes`` is an upper bound and
    ``Payload.nbytes`` the exact size.

    Registry name: ``"stc:<ratio>"``.

    Args:
        ratio: Fraction of entries kept, in ``(0, 1]``.
    """

    spec_name: ClassVar[str] = "stc"
    exact_nbytes: ClassVar[bool] = False

    ratio: float

    def __post_init__(self) -> None:
        object.__setattr__(self, "ratio", check_ratio(self.ratio))

    def _nbytes(self, numel: int, dtype: torch.dtype) -> int:
        k = kept(numel, self.ratio)
        remainders, unary = rice_nbytes_bound(k, numel - k, rice_parameter(k / numel))
        return compute_dtype(dtype).itemsize + 1 + packed_nbytes(k, 1) + remainders + unary

    def _encode(self, flat: torch.Tensor) -> torch.Tensor:
        numel = flat.numel()
        k = kept(numel, self.ratio)
        indices, values = _top_entries(flat, k)
        if not bool((indices[1:] > indices[:-1]).all()):  # the Rice-coded gaps need order
            indices, order = torch.sort(indices)
            values = values[order]
        mu = values.abs().mean(dtype=compute_dtype(flat.dtype))
        b = rice_parameter(k / numel)
        gaps = torch.diff(indices, prepend=indices.new_tensor([-1])) - 1
        remainders, unary = rice_encode(gaps, b)
        rice_b = torch.tensor([b], dtype=torch.uint8, device=flat.device)
        return join(mu.reshape(1), rice_b, sign_bits(values), remainders, unary)

    def _decode(self, buffer: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if takes_kernels(buffer.device, dtype):
            out = torch.zeros(numel)
            self._kernel_decode(buffer, numel, out, add=False)
            return out
        mu, signs, gaps = self._parts(buffer, numel, dtype)
        indices = torch.cumsum(gaps + 1, 0) - 1
        negative = unpack_bits(signs, 1, gaps.numel()).bool()
        return _scatter(numel, indices, torch.where(negative, -mu, mu).to(dtype))

    def _kernel_decode(self, buffer: torch.Tensor, numel: int, out: torch.Tensor, add: bool):
        """Decode (or with ``add``, add) a float32 payload into float32 ``out`` on CPU."""
        mu, signs, gaps = self._parts(buffer, numel, torch.float32)
        kernels().stc_decode(gaps.numpy(), signs.numpy(), mu.numpy()[()], out.numpy(), add)

    def _parts(
        self, buffer: torch.Tensor, numel: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``mu``, the packed sign bits and the gaps between positions (int64).

        Raises:
            ValueError: the payload is not one of ``numel`` elements (its Rice parameter is
                not the one :meth:`compress` writes, or it places an entry beyond them).
        """
        k = kept(numel, self.ratio)
        reader = Reader(buffer)
        mu = reader.take(1, compute_dtype(dtype))[0]
        b, expected = int(reader.take(1)[0]), rice_parameter(k / numel)
        if b != expected:
            raise ValueError(f"payload's Rice parameter is {b}; {numel} elements take {expected}")
        signs = reader.take(packed_nbytes(k, 1))
        remainders = reader.take(packed_nbytes(k, b))
        gaps = rice_decode(remainders, reader.rest(), b, k)
        # Checked before anything is written: decompress_add_ must not leave a half sum.
        last = int(gaps.sum()) + k - 1
        if last >= numel:
            raise ValueError(f"payload places an entry at position {last}, beyond {numel}")
        return mu, signs, gaps
