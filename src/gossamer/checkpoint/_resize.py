r"""Resuming a checkpoint of ``n`` ranks on ``m != n`` ranks: every rank takes the average.

A gossip checkpoint holds ``n`` different models, and the per-rank optimizer and
communication state of a topology of ``n`` ranks. On ``m`` ranks there is no rank-to-rank
mapping that would make the resume exact, so every new rank starts from the point a global
averaging round would reach:

.. math::

    x_i \leftarrow \bar x = \frac{1}{n} \sum_{k=0}^{n-1} x_k^{saved},
    \qquad i = 0, \dots, m - 1,

and likewise for every floating-point tensor of the wrapped torch optimizer's state
(momentum buffers, Adam's moments). Gossip keeps the ``x_k`` close to their mean, so the
mean is where a joining rank should start (a neighbour's model would be one sample of it).
What is tied to the old topology (window slots, push-sum weights, schedule positions,
residuals of error feedback, exact diffusion's previous step) starts fresh, as the new
job's optimizer built it; the step counter and ``extra`` are saved rank 0's.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from gossamer.checkpoint._files import from_rank0, read_saved

__all__ = ["averaged_payload"]


def averaged_payload(directory: Path, manifest: dict, rank: int, size: int) -> dict:
    """The mean of every saved rank's state, on every rank (collective).

    Rank 0 reads all the saved files, so they must be readable there (one machine, or a
    shared file system), and sends the mean to the others.
    """

    def average() -> bytes:
        payloads = [read_saved(directory, manifest, k) for k in manifest["ranks"]]
        buffer = io.BytesIO()
        torch.save(_resized(payloads), buffer)
        return buffer.getvalue()

    data = from_rank0(rank, size, average, "average the saved ranks' states")
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def _resized(payloads: list[dict]) -> dict:
    first = payloads[0]
    states = [p["optimizer"] for p in payloads]
    if first["decentralized"]:
        # The wrapped torch optimizer's state is averaged; the communication state is not.
        optimizer = {
            "optimizer": mean([s["optimizer"] for s in states]),
            "steps": int(states[0]["communication"]["steps"]),
        }
    else:
        optimizer = mean(states)  # a plain torch optimizer's state dict
    return {**first, "model": mean([p["model"] for p in payloads]), "optimizer": optimizer}


def mean(values: list[Any]) -> Any:
    """The element-wise mean of same-shaped nested states; the first where they differ.

    Floating-point tensors of one shape and dtype are averaged (accumulated in float64);
    everything else (integer counters, hyper-parameters, tensors of another shape) is taken
    from the first state.
    """
    first = values[0]
    if isinstance(first, torch.Tensor):
        same = all(
            isinstance(v, torch.Tensor) and v.shape == first.shape and v.dtype == first.dtype
            for v in values
        )
        if not (same and (first.is_floating_point() or first.is_complex())):
            return first
        total = torch.stack(
            [v.to(torch.complex128 if v.is_complex() else torch.float64) for v in values]
        ).mean(0)
        return total.to(first.dtype)
    if isinstance(first, dict):
        return {
            key: mean([v[key] for v in values])
            if all(isinstance(v, dict) and key in v for v in values)
            else item
            for key, item in first.items()
        }
    if isinstance(first, list | tuple) and all(
        type(v) is type(first) and len(v) == len(first) for v in values
    ):
        return type(first)(mean(list(column)) for column in zip(*values, strict=True))
    return first
