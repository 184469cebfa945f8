"""Tensor fusion: pack many small tensors into a few flat buffers, one message each.

A :class:`Bucket` owns one flat buffer (allocated once, reused every step) and a view of it
per member tensor. :func:`bucketize` groups tensors of the same dtype and device, in the
order given, into buckets of at most ``threshold_bytes``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["Bucket", "bucketize"]


class Bucket:
    """Tensors of one dtype and device that travel together in one flat buffer."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        if not tensors:
            raise ValueError("a Bucket needs at least one tensor")
        first = tensors[0]
        if any(t.dtype != first.dtype or t.device != first.device for t in tensors):
            raise ValueError("tensors of one Bucket must share dtype and device")
        self.tensors = list(tensors)
        self.flat = torch.empty(
            sum(t.numel() for t in tensors), dtype=first.dtype, device=first.device
        )
        self.views: list[torch.Tensor] = []
        self.rebase(self.flat)

    def rebase(self, flat: torch.Tensor) -> None:
        """Make ``flat`` the buffer (its values are kept; the views are re-made over it).

        Raises:
            ValueError: ``flat`` is not a contiguous 1-d tensor of this bucket's size, dtype
                and device.
        """
        numel, first = sum(t.numel() for t in self.tensors), self.tensors[0]
        if (flat.shape, flat.dtype, flat.device) != ((numel,), first.dtype, first.device) or (
            not flat.is_contiguous()
        ):
            raise ValueError(
                f"flat must be a contiguous 1-d {first.dtype} tensor of {numel} elements on "
                f"{first.device}; got shape {tuple(flat.shape)}, {flat.dtype} on {flat.device}"
            )
        self.flat = flat
        self.views = []
        offset = 0
        for t in self.tensors:
            self.views.append(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.flat.numel() * self.flat.element_size()

    def pack(
        self,
        source: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t,
    ) -> torch.Tensor:
        """Copy ``source(t)`` of every member into the flat buffer (None packs zeros)."""
        with torch.no_grad():
            for t, view in zip(self.tensors, self.views, strict=True):
                value = source(t)
                if value is None:
                    view.zero_()
                else:
                    view.copy_(value)
        return self.flat

    def unpack(self, flat: torch.Tensor, target: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Copy the slices of ``flat`` (laid out like this bucket) into ``target(t)``."""
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                target(t).copy_(flat[offset : offset + t.numel()].view_as(t))
                offset += t.numel()


def bucketize(tensors: Sequence[torch.Tensor], threshold_bytes: int | None) -> list[Bucket]:
    """Group ``tensors`` into buckets of one dtype and device, each up to ``threshold_bytes``.

    Order is kept within each (dtype, device) group. A tensor larger than the threshold gets
    a bucket of its own. ``threshold_bytes=None`` or ``0`` turns fusion off: one tensor each.

    Raises:
        ValueError: a negative threshold.
    """
    if threshold_bytes is not None and (
        isinstance(threshold_bytes, bool)
        or not isinstance(threshold_bytes, int)
        or threshold_bytes < 0
    ):
        raise ValueError(f"threshold_bytes must be an int >= 0 or None; got {threshold_bytes!r}")
    if not threshold_bytes:
        return [Bucket([t]) for t in tensors]
    groups: dict[tuple, list[list[torch.Tensor]]] = {}
    for t in tensors:
        runs = groups.setdefault((t.dtype, t.device), [[]])
        size = sum(x.numel() * x.element_size() for x in runs[-1])
        if runs[-1] and size + t.numel() * t.element_size() > threshold_bytes:
            runs.append([])
        runs[-1].append(t)
    return [Bucket(run) for runs in groups.values() for run in runs]
