"""Compressed payloads as flat byte tensors, so collectives can carry them.

A compressor of :mod:`gossamer.compression` returns a payload (a tensor, a tuple or
dataclass of tensors and numbers). :func:`to_bytes` lays its tensors and numbers out as one
``uint8`` tensor and returns a *spec* of the layout; :func:`from_bytes` rebuilds a payload
from such bytes and a spec. The ranks compress chunks of equal size, so one rank's spec
describes every rank's bytes; values that are neither tensors nor numbers (dtypes, shapes
given as ``torch.Size``, names) are taken from the spec's template.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

__all__ = ["from_bytes", "to_bytes"]

_NUMBERS = {float: torch.float64, int: torch.int64, bool: torch.bool}


def _flatten(payload: Any, leaves: list[torch.Tensor]) -> Any:
    """The payload's structure with each tensor or number replaced by its leaf index."""
    if isinstance(payload, torch.Tensor):
        leaves.append(payload.detach().contiguous())
        return ("tensor", len(leaves) - 1, payload.dtype, tuple(payload.shape))
    if isinstance(payload, torch.Size | torch.dtype | torch.device | str) or payload is None:
        return ("static", payload)  # the same on every rank: taken from the template
    if type(payload) in _NUMBERS:
        leaves.append(torch.tensor([payload], dtype=_NUMBERS[type(payload)]))
        return ("number", len(leaves) - 1, type(payload))
    if isinstance(payload, tuple) and hasattr(payload, "_fields"):  # a namedtuple
        return ("namedtuple", type(payload), [_flatten(v, leaves) for v in payload])
    if isinstance(payload, list | tuple):
        return (type(payload).__name__, [_flatten(v, leaves) for v in payload])
    if isinstance(payload, dict):
        return ("dict", {k: _flatten(v, leaves) for k, v in payload.items()})
    if dataclasses.is_dataclass(payload) and not isinstance(payload, type):
        fields = {
            f.name: _flatten(getattr(payload, f.name), leaves) for f in dataclasses.fields(payload)
        }
        return ("dataclass", payload, fields)
    if hasattr(payload, "__dict__"):
        return ("object", payload, {k: _flatten(v, leaves) for k, v in vars(payload).items()})
    return ("static", payload)  # dtype, torch.Size, str, None: the same on every rank


def to_bytes(payload: Any) -> tuple[torch.Tensor, Any]:
    """``payload`` as one ``uint8`` tensor (on its tensors' device) and its layout spec."""
    leaves: list[torch.Tensor] = []
    tree = _flatten(payload, leaves)
    device = next((t.device for t in leaves if t.device.type != "cpu"), torch.device("cpu"))
    parts = [t.to(device).reshape(-1).view(torch.uint8) for t in leaves]
    sizes = [p.numel() for p in parts]
    flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8, device=device)
    return flat, (tree, sizes, [(t.dtype, tuple(t.shape), t.device) for t in leaves])


def _build(tree: Any, leaves: list[torch.Tensor]) -> Any:
    kind = tree[0]
    if kind == "tensor":
        return leaves[tree[1]]
    if kind == "number":
        return tree[2](leaves[tree[1]].item())
    if kind == "namedtuple":
        return tree[1](*[_build(v, leaves) for v in tree[2]])
    if kind in ("list", "tuple"):
        values = [_build(v, leaves) for v in tree[1]]
        return values if kind == "list" else tuple(values)
    if kind == "dict":
        return {k: _build(v, leaves) for k, v in tree[1].items()}
    if kind == "dataclass":
        values = {k: _build(v, leaves) for k, v in tree[2].items()}
        init = {f.name for f in dataclasses.fields(tree[1]) if f.init}
        built = dataclasses.replace(tree[1], **{k: v for k, v in values.items() if k in init})
        for k, v in values.items():
            if k not in init:
                object.__setattr__(built, k, v)
        return built
    if kind == "object":
        built = copy.copy(tree[1])
        for k, v in tree[2].items():
            setattr(built, k, _build(v, leaves))
        return built
    return tree[1]


def from_bytes(flat: torch.Tensor, spec: Any) -> Any:
    """Rebuild a payload from bytes laid out as ``spec`` (from :func:`to_bytes`) describes."""
    tree, sizes, metas = spec
    if flat.numel() != sum(sizes):
        raise ValueError(f"expected {sum(sizes)} payload bytes; got {flat.numel()}")
    leaves, offset = [], 0
    for size, (dtype, shape, device) in zip(sizes, metas, strict=True):
        # A copy: a view at an odd byte offset cannot be reinterpreted as a wider dtype.
        part = flat[offset : offset + size].clone()
        leaves.append(part.view(dtype).reshape(shape).to(device))
        offset += size
    return _build(tree, leaves)
