"""How much of a tensor a compressor keeps: the contraction factor ``delta``."""

from __future__ import annotations

import dataclasses

import torch

from gossamer.compression._common import check_int
from gossamer.compression.base import Compressor

__all__ = ["compression_quality"]

_MAX_PROBE = 1 << 18  # elements per probe: delta barely depends on the size beyond this


def compression_quality(compressor: Compressor, numel: int, *, probes: int = 4) -> float:
    r"""Estimate :math:`\delta = 1 - E\|x - D(C(x))\|^2 / \|x\|^2` on standard normal ``x``.

    :math:`\delta` is the quality in the contraction property
    :math:`E\|x - D(C(x))\|^2 \le (1 - \delta)\|x\|^2` of the analyses of error feedback and
    CHOCO-gossip (Koloskova et al. 2019, there :math:`\omega`): 1 for no compression,
    ``k/d`` for random-k, about ``2/pi`` for ``sign``, about ``2 z phi(z) + ratio`` for
    top-k with ``z`` the normal quantile of ``1 - ratio/2`` (0.085 for ``topk:0.01``).
    The estimate is the mean over ``probes`` normal vectors of ``min(numel, 2^18)``
    elements from a fixed seed, compressed by a copy of ``compressor`` from its first
    stream position, so it is the same on every rank and leaves ``compressor``'s stream
    untouched. A Gaussian probe is not a worst case: inputs with a few large entries keep
    less under ``sign`` (``1/d`` at worst), so it can be optimistic for the differences a
    compressor meets in practice (see docs/compression.md). Unbiased compressors that
    scale up (QSGD, unbiased random-k) can give a negative value: they are not
    contractions.

    Args:
        compressor: The compressor.
        numel: Size of the tensors it will compress, ``>= 1``.
        probes: Number of probe vectors, ``>= 1``.

    Raises:
        TypeError: ``compressor`` is not a :class:`Compressor`, or ``numel``/``probes`` not ints.
        ValueError: ``numel`` or ``probes`` is below 1.
    """
    if not isinstance(compressor, Compressor):
        raise TypeError(f"compressor must be a Compressor; got {type(compressor).__name__}")
    size = min(check_int(numel, "numel", 1), _MAX_PROBE)
    check_int(probes, "probes", 1)
    # A new stream counter with the same configuration (compressors are dataclasses).
    fresh = dataclasses.replace(compressor) if dataclasses.is_dataclass(compressor) else compressor
    generator = torch.Generator().manual_seed(0)
    lost = 0.0
    for _ in range(probes):
        x = torch.randn(size, generator=generator, dtype=torch.float64)
        error = x - fresh.decompress(fresh.compress(x))
        lost += float(error.square().sum() / x.square().sum())
    return 1.0 - lost / probes
