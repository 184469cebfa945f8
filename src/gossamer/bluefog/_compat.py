"""Argument translation shared by the facade modules: numpy scalars, BlueFog's errors."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np
import torch

__all__ = [
    "check_weight_types",
    "need_float",
    "plain_ranks",
    "plain_weights",
    "removed_kwargs",
]

F = TypeVar("F", bound=Callable[..., Any])


def _plain(value: object) -> object:
    # BlueFog programs pass numpy ranks and weights (permutations, matrix entries); the
    # core checks for Python ints and floats.
    if isinstance(value, np.integer):
        return int(value)
    if isinstance(value, np.floating):
        return float(value)
    return value


def plain_ranks(ranks: object) -> object:
    """``ranks`` as a list with numpy integers made Python ints; other values unchanged."""
    if isinstance(ranks, np.ndarray):
        return [_plain(r) for r in ranks.tolist()]
    if isinstance(ranks, list | tuple):
        return [_plain(r) for r in ranks]
    return ranks


def plain_weights(weights: object) -> object:
    """``weights`` with numpy keys and values made Python numbers; lists as ranks."""
    if isinstance(weights, Mapping):
        return {_plain(k): _plain(v) for k, v in weights.items()}
    return plain_ranks(weights)


def check_weight_types(self_weight: object, weights: object, what: str) -> object:
    """``self_weight`` as a Python number (numpy's made plain, as the weights are).

    Raises:
        ValueError: (BlueFog's documented error) weights of the wrong kind.
    """
    self_weight = _plain(self_weight)
    if self_weight is not None and (
        isinstance(self_weight, bool) or not isinstance(self_weight, int | float)
    ):
        raise ValueError(f"self_weight must be a number (int or float); got {self_weight!r}")
    if weights is not None and not isinstance(weights, Mapping):
        raise ValueError(f"{what} must be a dict {{rank: weight}}; got {type(weights).__name__}")
    return self_weight


def need_float(tensor: object, op: str) -> None:
    """Raise ``ValueError`` (as BlueFog) when averaging is asked of a non-float tensor."""
    if isinstance(tensor, torch.Tensor) and not tensor.dtype.is_floating_point:
        raise ValueError(f"{op} needs a floating-point tensor; got {tensor.dtype}")


def removed_kwargs(**fixes: str) -> Callable[[F], F]:
    """Make the decorated function raise ``TypeError`` with a hint for removed keywords.

    Args:
        **fixes: ``old_name="what to do instead"``.
    """

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, fix in fixes.items():
                if old in kwargs:
                    raise TypeError(f"{fn.__name__}() no longer takes the argument {old!r}. {fix}")
            return fn(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
