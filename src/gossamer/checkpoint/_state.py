"""What a rank's file holds: model and optimizer states, random generators, ``extra``."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import nn

from gossamer.checkpoint._attached import attached_states, check_attached
from gossamer.checkpoint._files import FORMAT, FORMAT_VERSION
from gossamer.optim.base import DecentralizedOptimizer
from gossamer.optim.cocofl import CoCoFL
from gossamer.optim.skewscout import SkewScout

__all__ = [
    "WRAPPERS",
    "capture",
    "check_fit",
    "check_plain",
    "decentralized",
    "set_rng",
]

# Optimizers that are neither kind but save and load their whole state the same way.
WRAPPERS = (SkewScout, CoCoFL)

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
    optimizer: DecentralizedOptimizer | torch.optim.Optimizer | SkewScout | CoCoFL,
    extra: Any,
) -> dict:
    """This rank's payload: model and optimizer states, generators, ``extra``."""
    # The optimizer first: its state_dict() lands the combines in flight in the parameters.
    optimizer_state = optimizer.state_dict()
    model_states = [m.state_dict() for m in models]
    attached = attached_states(models)
    check_plain(optimizer_state, "the optimizer's state_dict()")
    check_plain(model_states, "the model's state_dict()")
    check_plain(attached, "the model's attached state")
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
        "attached": attached,
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


def decentralized(optimizer: object) -> DecentralizedOptimizer | None:
    """The decentralized optimizer that communicates for ``optimizer``, if any."""
    if isinstance(optimizer, SkewScout):
        return optimizer.inner
    return optimizer if isinstance(optimizer, DecentralizedOptimizer) else None


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
    saved_class, own_class = payload["optimizer_class"], type(optimizer).__qualname__
    wrapped = saved_class in {w.__qualname__ for w in WRAPPERS} or isinstance(optimizer, WRAPPERS)
    if payload["decentralized"] != isinstance(optimizer, DecentralizedOptimizer) or (
        wrapped and saved_class != own_class
    ):
        raise ValueError(
            f"the checkpoint was saved from optimizer class {saved_class}; "
            f"optimizer has class {own_class}"
        )
    inner = payload.get("inner_optimizer_class")  # absent in older checkpoints
    if inner is not None and inner != _inner_class(optimizer):
        raise ValueError(
            f"the checkpoint was saved with a torch.optim.{inner}; optimizer steps with a "
            f"torch.optim.{_inner_class(optimizer)}"
        )
    check_attached(payload.get("attached", []), models)  # absent in older checkpoints
    for module, state in zip(models, [saved] if single else saved, strict=True):
        own = module.state_dict()
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:  # a DDP-style wrapper's "module." keys against its module's
            raise ValueError(
                f"the checkpoint's model entries do not match the model's: it lacks "
                f"{missing[:4]} and has {unexpected[:4]} that the model does not"
            )
        for key, value in own.items():
            got = state.get(key)
            if isinstance(got, torch.Tensor) and got.shape != value.shape:
                raise ValueError(
                    f"the checkpoint's model entry {key!r} has shape {tuple(got.shape)}; the "
                    f"model's has {tuple(value.shape)}"
                )
