r"""The weighted sums of neighbour averaging, in one place (pure tensor math).

A gossip step at rank :math:`i` computes

.. math:: y_i = w_{ii}\, x_i + \sum_{j \in S} w_{ji}\, m_j

from its own value and what it received from its sources :math:`S`. Neighbour operations,
windows and optimizers all call :func:`weighted_sum`, so they round the same way.

Integer and bool tensors (windows hold any dtype) are weighted in float64 and rounded to the
nearest integer (halves to even) before the cast back: a weighted integer is the integer
closest to the exact weighted sum (exact while the values stay below 2**53 in magnitude),
and a weighted bool is True where that rounded value is nonzero. Unweighted sums
(:func:`add_into`) stay in the dtype and wrap around as its arithmetic does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["add_into", "is_uniform", "scale", "scaled_copies", "weighted_sum"]

# Unsigned types torch has no addition kernel for: added through the signed type of the
# same width, whose two's-complement sum has the same bits as the wrapped unsigned sum.
_SIGNED_TWIN = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _exact(dtype: torch.dtype) -> bool:
    """Whether weights apply in ``dtype`` itself (floating or complex) or need rounding."""
    return dtype.is_floating_point or dtype.is_complex


def _wide(dtype: torch.dtype) -> torch.dtype:
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype if _exact(dtype) else torch.float64


def _narrow(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` (computed in :func:`_wide`) back in ``dtype``, rounded if that is integral."""
    if out.dtype == dtype:
        return out
    if not _exact(dtype):
        out = out.round()
    return out.to(dtype)


def is_uniform(self_weight: float, weights: Mapping[int, float], sources: Sequence[int]) -> bool:
    """True when every weight, this rank's included, is ``1 / (len(sources) + 1)``."""
    share = 1.0 / (len(sources) + 1)
    return (
        set(weights) == set(sources)
        and self_weight == share
        and all(w == share for w in weights.values())
    )


def weighted_sum(
    x: torch.Tensor,
    self_weight: float | None,
    received: Mapping[int, torch.Tensor],
    weights: Mapping[int, float] | None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``self_weight * x + sum_s weights[s] * received[s]``; uniform when ``weights`` is None.

    The uniform case is ``(x + sum_s received[s]) / (k + 1)`` over every received tensor:
    sum first, then divide, which is exact where multiplying by ``1/(k+1)`` would round
    (BlueFog computes it this way). Sources are added in ascending rank order. float16 and
    bfloat16 are combined in float32, integers and bool in float64 (then rounded); the
    result has ``x``'s dtype. ``out`` (x's shape and dtype; ``x`` itself to combine in
    place) receives a float32 or float64 result instead of a new tensor; only then does the
    result alias ``x``.
    """
    wide = _wide(x.dtype)
    into = out if wide == x.dtype else None
    if weights is None:
        sources = sorted(received)
        if not sources:
            result = x.to(wide, copy=True) if into is None else into.copy_(x)
        else:  # the first addition writes the output, saving a separate copy of x
            result = torch.add(x.to(wide), received[sources[0]].to(wide), out=into)
        for src in sources[1:]:
            result.add_(received[src])
        result.div_(len(received) + 1)
    else:
        result = torch.mul(x.to(wide), self_weight, out=into)
        for src in sorted(weights):
            result.add_(received[src].to(wide), alpha=weights[src])
    return _narrow(result, x.dtype)


def scale(x: torch.Tensor, weight: float) -> torch.Tensor:
    """``weight * x`` in ``x``'s dtype (a new tensor; integers and bool rounded)."""
    return _narrow(torch.mul(x.to(_wide(x.dtype)), weight), x.dtype)


def add_into(out: torch.Tensor, value: torch.Tensor) -> None:
    """``out += value`` in ``out``'s dtype: integers wrap, bool is a logical or."""
    twin = _SIGNED_TWIN.get(out.dtype)
    if twin is None:
        out.add_(value)
    else:
        out.view(twin).add_(value.view(twin))


def scaled_copies(x: torch.Tensor, dst_weights: Mapping[int, float]) -> dict[int, torch.Tensor]:
    """What to send to each destination: ``x`` itself where the weight is 1, else a copy."""
    return {d: x if w == 1.0 else scale(x, w) for d, w in dst_weights.items()}
