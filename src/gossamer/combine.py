r"""The weighted sums of neighbour averaging, in one place (pure tensor math).

A gossip step at rank :math:`i` computes

.. math:: y_i = w_{ii}\, x_i + \sum_{j \in S} w_{ji}\, m_j

from its own value and what it received from its sources :math:`S`. Neighbour operations,
windows and optimizers all call :func:`weighted_sum`, so they round the same way.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

__all__ = ["is_uniform", "scaled_copies", "weighted_sum"]


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
) -> torch.Tensor:
    """``self_weight * x + sum_s weights[s] * received[s]``; uniform when ``weights`` is None.

    The uniform case is ``(x + sum_s received[s]) / (k + 1)`` over every received tensor:
    sum first, then divide, which is exact where multiplying by ``1/(k+1)`` would round
    (BlueFog computes it this way). Sources are added in ascending rank order. float16 and
    bfloat16 are combined in float32, integers in float64 (then truncated toward zero); the
    result has ``x``'s dtype and never aliases ``x``.
    """
    wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
    if not (wide.is_floating_point or wide.is_complex):
        # Integer windows: combine in float64 (an in-place division of an integer tensor
        # fails), then truncate back, as the weighted path's cast does.
        wide = torch.float64
    if weights is None:
        sources = sorted(received)
        # The first addition allocates the output, saving a separate copy of x.
        out = torch.add(x.to(wide), received[sources[0]]) if sources else x.to(wide, copy=True)
        for src in sources[1:]:
            out.add_(received[src])
        out.div_(len(received) + 1)
    else:
        out = torch.mul(x.to(wide), self_weight)
        for src in sorted(weights):
            out.add_(received[src], alpha=weights[src])
    return out if out.dtype == x.dtype else out.to(x.dtype)


def scaled_copies(x: torch.Tensor, dst_weights: Mapping[int, float]) -> dict[int, torch.Tensor]:
    """What to send to each destination: ``x`` itself where the weight is 1, else a copy."""
    return {d: x if w == 1.0 else x * w for d, w in dst_weights.items()}
