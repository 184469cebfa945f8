"""Seeded random streams for stochastic compressors: reproducible from ``(seed, step)``."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch

from gossamer.compression._common import check_int
from gossamer.compression.base import Compressor

__all__ = [
    "RandomWords",
    "Seeded",
    "for_rank",
    "generator",
    "hashed_words",
    "rank_seed",
    "stream_keys",
]

_MASK64 = (1 << 64) - 1


def _mix(seed: int, step: int) -> int:
    """SplitMix64 of ``(seed, step)``, as 63 bits (every backend accepts them as a seed)."""
    z = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def generator(seed: int, step: int, device: torch.device | str = "cpu") -> torch.Generator:
    """Return a generator on ``device`` seeded by a hash of ``(seed, step)``.

    SplitMix64 spreads neighbouring ``(seed, step)`` pairs over unrelated streams, so the
    draws of step ``t`` do not repeat those of step ``t + 1`` shifted by one element.
    """
    gen = torch.Generator(device=device)
    gen.manual_seed(_mix(seed, step))
    return gen


def stream_keys(seed: int, step: int) -> tuple[np.uint32, np.uint32]:
    """The two 32-bit keys of the word stream of ``(seed, step)`` (:func:`hashed_words`)."""
    key = _mix(seed, step)
    return np.uint32(key & 0xFFFFFFFF), np.uint32(key >> 32)


def _lowbias32(v: np.ndarray) -> None:
    """Wellons' "lowbias32" integer hash, in place on a uint32 array (arithmetic mod 2^32)."""
    v ^= v >> np.uint32(16)
    v *= np.uint32(0x7FEB352D)
    v ^= v >> np.uint32(15)
    v *= np.uint32(0x846CA68B)
    v ^= v >> np.uint32(16)


def hashed_words(keys: tuple[np.uint32, np.uint32], start: int, count: int) -> np.ndarray:
    """Words ``start, ..., start + count - 1`` of the counter-based stream keyed by ``keys``.

    Word ``i`` is ``h(h(i + k1) + k2)``, ``h`` an invertible 32-bit integer hash with good
    avalanche, and ``i`` taken mod 2^32. A counter-based stream can be computed anywhere
    from ``i`` alone, so the fused CPU kernels (:mod:`gossamer.compression._kernels`)
    compute each draw where they use it instead of reading it from a generator's buffer.
    The outer hash keeps two keys' streams from being shifts of one sequence. This numpy
    version is their reference and serves the compressors' torch formulation on CPU.
    """
    v = np.arange(start, start + count, dtype=np.int64).astype(np.uint32)
    v += keys[0]
    _lowbias32(v)
    v += keys[1]
    _lowbias32(v)
    return v


class RandomWords:
    """Uniform random words from the stream of ``(seed, step)``, taken block after block.

    The low 24 bits of every word are uniform and independent (on CPU all 32 are). On CPU
    they are :func:`hashed_words`, the numbers the fused kernels draw; on other devices
    they come from torch's generator there.
    """

    def __init__(self, seed: int, step: int, device: torch.device | str = "cpu") -> None:
        self._device = torch.device(device)
        if self._device.type == "cpu":
            self._keys = stream_keys(seed, step)
            self._taken = 0
        else:
            self._generator = generator(seed, step, self._device)

    def take(self, count: int) -> torch.Tensor:
        """Return the next ``count`` words as a 1-d int32 tensor on the device."""
        if self._device.type == "cpu":
            words = hashed_words(self._keys, self._taken, count)
            self._taken += count
            return torch.from_numpy(words.view(np.int32))
        return torch.randint(
            0, 1 << 24, (count,), generator=self._generator, dtype=torch.int32, device=self._device
        )


def rank_seed(seed: int, rank: int) -> int:
    """The seed of ``rank``'s own stream, derived from a seed common to all ranks.

    A hash of ``(seed, rank)``, not ``seed + rank``: a job with ``seed=1`` would otherwise
    give its rank 0 the stream of rank 1 of a job with ``seed=0``.
    """
    check_int(seed, "seed", 0, 2**63 - 1)
    check_int(rank, "rank", 0)
    return _mix(seed ^ 0x5DEECE66D, 2 * rank + 1)


def for_rank(compressor: Compressor, rank: int) -> Compressor:
    """The compressor ``rank`` should use inside a communicator.

    Deterministic compressors come back as they are. Stochastic ones (:class:`Seeded`) are
    split by what their randomness is for:

    - ``shared_stream`` (random-k): the draws choose *which* entries are sent, and ranks
      whose payloads are summed must choose the same ones, so every rank keeps ``seed``:
      step ``t`` of every rank draws the same indices;
    - otherwise (QSGD, natural compression, natural dithering): the draws are rounding
      noise, which averages out over ranks only if it is independent, so each rank gets
      ``rank_seed(seed, rank)``.

    Either way the draw of call ``t`` is the stream of ``(seed', t)``: deterministic per
    rank and step, with the step counter (the compressor's ``state_dict``) carried over.

    Raises:
        TypeError: ``compressor`` is not a :class:`Compressor`.
        ValueError: ``rank`` is negative.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor; got {type(compressor).__name__}")
    check_int(rank, "rank", 0)
    if not isinstance(compressor, Seeded) or compressor.shared_stream:
        return compressor
    mine = dataclasses.replace(compressor, seed=rank_seed(compressor.seed, rank))
    mine.load_state_dict(compressor.state_dict())
    return mine


class _Counter:
    """The one mutable part of a stochastic compressor: state, not configuration."""

    __slots__ = ("step",)

    def __init__(self) -> None:
        self.step = 0


@dataclass(frozen=True, repr=False)
class Seeded(Compressor):
    """Base of stochastic compressors: draw ``t`` uses the stream of ``(seed, t)``.

    The step counter advances by one per non-empty :meth:`compress` call and is the whole of
    :meth:`state_dict`, so a run resumed from a checkpoint draws the same numbers.
    """

    shared_stream: ClassVar[bool] = False
    """Whether ranks must draw the same numbers (see :func:`for_rank`): True for random-k."""

    seed: int = field(default=0, kw_only=True)
    _counter: _Counter = field(
        default_factory=_Counter, init=False, repr=False, compare=False, hash=False
    )

    def __post_init__(self) -> None:
        check_int(self.seed, "seed", 0, 2**63 - 1)

    @property
    def step(self) -> int:
        """Number of non-empty tensors compressed so far (the next draw's stream)."""
        return self._counter.step

    def _next_step(self) -> int:
        step = self._counter.step
        self._counter.step = step + 1
        return step

    def state_dict(self) -> dict[str, Any]:
        """Return ``{"step": n}``: the position in the random stream."""
        return {"step": self.step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position in the random stream saved by :meth:`state_dict`.

        Raises:
            ValueError: ``state`` does not hold exactly a non-negative int ``"step"``.
        """
        if not isinstance(state, dict) or set(state) != {"step"}:
            got = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"state must hold exactly the key 'step' for {self.name!r}; got {got}")
        self._counter.step = check_int(state["step"], "state['step']", 0)
