"""Tensor fusion: pack many small tensors into a few flat buffers, one message each.

A :class:`Bucket` owns one flat buffer (allocated once, reused every step) and a view of it
per member tensor. :func:`bucketize` groups tensors of the same dtype and device, in the
order given, into buckets of at most ``threshold_bytes``. :meth:`Bucket.adopt` moves the
members themselves into the buffer (as torch's DDP does with ``gradient_as_bucket_view``
for gradients), so that packing and unpacking them copies nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence

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
        self._spare: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self.views = _views(self.tensors, flat)

    def adopt(self, skip: Container[int] = ()) -> None:
        """Move the members into the flat buffer: each member's ``.data`` becomes its view.

        Values are kept. :meth:`pack` then copies nothing for them, and :meth:`unpack` of
        :attr:`flat` nothing either: a model-sized copy fewer each way per round. Only
        members that are contiguous and own their whole storage move; a member that is a
        view of a larger buffer (another fusion's, say), or whose storage's ``data_ptr`` is
        in ``skip`` (memory that another tensor uses too: tied weights), keeps it. A member
        whose ``.data`` is later replaced (``module.to(...)``) is simply copied again.
        """
        with torch.no_grad():
            for t, view in zip(self.tensors, self.views, strict=True):
                if t.untyped_storage().data_ptr() in skip:
                    continue
                if _owns_storage(t) and not _same_memory(t, view):
                    view.copy_(t)
                    t.data = view

    @property
    def nbytes(self) -> int:
        """Size of the flat buffer in bytes."""
        return self.flat.numel() * self.flat.element_size()

    def pack(
        self,
        source: Callable[[torch.Tensor], torch.Tensor | None] = lambda t: t,
    ) -> torch.Tensor:
        """Copy ``source(t)`` of every member into the flat buffer (None packs zeros).

        Returns the buffer. Members that live in it (:meth:`adopt`) are not copied when
        ``source`` gives them back; any other source (their gradients, say) is packed into
        a second buffer instead, which is returned, so that the members are never written.
        """
        values = [source(t) for t in self.tensors]
        flat, views = self.flat, self.views
        if any(
            _same_memory(t, view) and (value is None or not _same_memory(value, view))
            for t, view, value in zip(self.tensors, views, values, strict=True)
        ):
            flat, views = self._spare_buffer()
        with torch.no_grad():
            for value, view in zip(values, views, strict=True):
                if value is None:
                    view.zero_()
                elif not _same_memory(value, view):
                    view.copy_(value)
        return flat

    def _spare_buffer(self) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """A second buffer laid out like :attr:`flat`, and its views (made on first use)."""
        if self._spare is None:
            flat = torch.empty_like(self.flat)
            self._spare = (flat, _views(self.tensors, flat))
        return self._spare

    def unpack(self, flat: torch.Tensor, target: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Copy the slices of ``flat`` (laid out like this bucket) into ``target(t)``."""
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                dest, value = target(t), flat[offset : offset + t.numel()].view_as(t)
                if not _same_memory(value, dest):
                    dest.copy_(value)
                offset += t.numel()


def _views(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> list[torch.Tensor]:
    """A view of ``flat`` shaped like each of ``tensors``, laid end to end."""
    views, offset = [], 0
    for t in tensors:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


def _owns_storage(t: torch.Tensor) -> bool:
    """Whether ``t`` is a contiguous strided tensor spanning exactly its whole storage."""
    return (
        t.layout == torch.strided
        and t.is_contiguous()
        and t.storage_offset() == 0
        and t.untyped_storage().nbytes() == t.numel() * t.element_size()
    )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and the contiguous ``b`` (same shape) are the same elements in memory."""
    return a.data_ptr() == b.data_ptr() and a.device == b.device and a.is_contiguous()


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
