"""Argument checks shared by the data modules: each raises naming the argument and value."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

__all__: list[str] = []


def check_int(value: object, name: str, *, minimum: int | None = None) -> int:
    """Return ``value`` as an ``int`` or raise naming ``name``; bools are rejected."""
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise TypeError(f"{name} must be an int; got {value!r} of type {type(value).__name__}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}; got {value}")
    return int(value)


def check_positive_float(value: object, name: str) -> float:
    """Return ``value`` as a finite ``float > 0`` or raise naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.integer | np.floating):
        raise TypeError(f"{name} must be a number; got {value!r} of type {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0; got {value}")
    return float(value)


def as_labels(labels: Any, name: str = "labels") -> np.ndarray:
    """Return ``labels`` as a 1-D int64 array of class indices ``>= 0`` (a copy).

    Accepts a sequence of ints, a numpy array or a torch tensor of an integer dtype.
    Floats are refused rather than rounded: a float label usually means the wrong column.
    """
    if labels is None or isinstance(labels, str | bytes):
        raise TypeError(f"{name} must be a sequence, array or tensor of ints; got {labels!r}")
    if isinstance(labels, torch.Tensor):
        labels = labels.detach().cpu().numpy()
    try:
        arr = np.asarray(labels)
    except (TypeError, ValueError) as exc:
        raise TypeError(f"{name} must be convertible to an int array; got {exc}") from exc
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D; got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} must not be empty; got {arr.size} labels")
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TypeError(f"{name} must hold integers (class indices); got dtype {arr.dtype}")
    if arr.min() < 0:
        position = int(np.argmin(arr))
        raise ValueError(f"{name} must be >= 0; got {arr[position]} at position {position}")
    return arr.astype(np.int64, copy=True)


def check_seed(seed: object) -> int:
    """Return ``seed`` as an int ``>= 0`` (what numpy's generators accept)."""
    return check_int(seed, "seed", minimum=0)
