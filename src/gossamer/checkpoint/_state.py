"""What a rank's file holds: model and optimizer states, random generators, ``extra``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from gossamer.checkpoint._files import FORMAT, FORMAT_VERSION
from gossamer.optim.base import DecentralizedOptimizer

__all__ = ["capture", "check_fit", "check_plain", "set_rng"]

PLAIN = (str, int, float, bool, bytes, type(None), torch.Tensor)


def check_plain(value: object, where: str) -> None:
    """Raise TypeError unless ``value`` is data that ``torch.load(weights_only=True)`` reads."""
    if isinstance(value, PLAIN):
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not _plain_key(key):
                raise TypeError(f"{where} has a key of type {type(key).__name__}: {key!r}")
            check_plain(item, f"{where}[{key!r}]")
        return
    if isinstance(value, list | tuple):
        for index, item in enumerate(value):
            check_plain(item, f"{where}[{index}]")
        return
    raise TypeError(
        f"{where} is a {type(value).__name__}; a checkpoint holds only dict, list, tuple, str, "
        "int, float, bool, None, bytes and torch.Tensor (what torch.load(weights_only=True) "
        "reads back)"
    )


def _plain_key(key: object) -> bool:
    """A scalar, or a tuple of them (CHOCO's public copies, error-feedback residuals)."""
    if isinstance(key, tuple):
        return all(_plain_key(k) and not isinstance(k, tuple) for k in key)
    return isinstance(key, str | int | float | bool | type(None))


def capture(
    rank: int,
    size: int,
    models: list[nn.Module],
    single: bool,
    optimizer: DecentralizedOptimizer | torch.optim.Optimizer,
    extra: Any,
) -> dict:
    """This rank's payload: model and optimizer states, generators, ``extra``."""
    # The optimizer first: its state_dict() lands the combines in flight in the parameters.
    optimizer_state = optimizer.state_dict()
    model_states = [m.state_dict() for m in models]
    check_plain(optimizer_state, "the optimizer's state_dict()")
    check_plain(model_states, "the model's state_dict()")
    step = getattr(optimizer, "steps", None)
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "rank": rank,
        "world_size": size,
        "step": step if isinstance(step, int) else None,
        "optimizer_class": type(optimizer).__qualname__,
        "inner_optimizer_class": _inner_class(optimizer),
        "decentralized": isinstance(optimizer, DecentralizedOptimizer),
        "model": model_states[0] if single else model_states,
        "optimizer": optimizer_state,
        "rng": rng_state(),
        "extra": extra,
    }


def rng_state() -> dict:
    """The global generators of torch (and CUDA), Python and NumPy."""
    name, keys, position, has_gauss, gauss = np.random.get_state(legacy=True)
    state = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), position, has_gauss, gauss),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng(state: dict) -> None:
    """Restore the generators that :func:`capture` saved."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    name, keys, position, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), position, has_gauss, gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _inner_class(optimizer: object) -> str:
    """The class of the torch optimizer that takes the steps (inside a gossamer wrapper)."""
    return type(getattr(optimizer, "optimizer", optimizer)).__qualname__


def check_fit(payload: dict, single: bool, models: list[nn.Module], optimizer: object) -> None:
    """Raise ValueError unless the payload fits the models and the optimizer's kind.

    Loading another torch optimizer's state (SGD's into Adam) would replace its
    hyper-parameters and fail at its next step; another model's, fail inside torch.
    """
    saved = payload["model"]
    if single != isinstance(saved, dict) or (not single and len(saved) != len(models)):
        shape = "one module" if isinstance(saved, dict) else f"{len(saved)} modules"
        raise ValueError(f"the checkpoint holds {shape}; model has {len(models)}")
    if payload["decentralized"] != isinstance(optimizer, DecentralizedOptimizer):
        raise ValueError(
            f"the checkpoint was saved from optimizer class {payload['optimizer_class']}; "
            f"optimizer has class {type(optimizer).__qualname__}"
        )
    inner = payload.get("inner_optimizer_class")  # absent in older checkpoints
    if inner is not None and inner != _inner_class(optimizer):
        raise ValueError(
            f"the checkpoint was saved with a torch.optim.{inner}; optimizer steps with a "
            f"torch.optim.{_inner_class(optimizer)}"
        )
    for module, state in zip(models, [saved] if single else saved, strict=True):
        for key, value in module.state_dict().items():
            got = state.get(key)
            if isinstance(got, torch.Tensor) and got.shape != value.shape:
                raise ValueError(
                    f"the checkpoint's model entry {key!r} has shape {tuple(got.shape)}; the "
                    f"model's has {tuple(value.shape)}"
                )
