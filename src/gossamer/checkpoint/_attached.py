"""State that lives beside a model, not in it or its optimizer (the Bagua facade's engine)."""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

__all__ = ["attach", "attached_states", "check_attached", "load_attached"]

_ATTACHED: weakref.WeakKeyDictionary[nn.Module, dict[str, Any]] = weakref.WeakKeyDictionary()


def attach(module: nn.Module, name: str, stateful: Any) -> None:
    """Save ``stateful.state_dict()`` with ``module``; load it back after the module's state.

    For communication state that lives beside a model, not in its optimizer: the Bagua
    facade's engine (its step counter and replicas). A checkpoint of a model holds what is
    attached to it and to its submodules (each object once), under
    ``"<submodule path>.<name>"``. Attaching again under ``name`` replaces the previous
    object. After a resized load (``load(..., resize=True)`` from another number of ranks),
    ``stateful.rebind()``, if it has one, starts the state anew from the loaded model
    instead.

    Raises:
        TypeError: ``module`` is not an ``nn.Module``, ``name`` not a str, or ``stateful``
            is a class or has no ``state_dict()`` and ``load_state_dict()``.
    """
    if not isinstance(module, nn.Module):
        raise TypeError(f"module must be an nn.Module; got {module!r}")
    if not isinstance(name, str):
        raise TypeError(f"name must be a str; got {name!r}")
    methods = ("state_dict", "load_state_dict")
    if isinstance(stateful, type) or not all(callable(getattr(stateful, m, None)) for m in methods):
        raise TypeError(
            f"stateful must be an object with state_dict() and load_state_dict(); got {stateful!r}"
        )
    _ATTACHED.setdefault(module, {})[name] = stateful


def _attached(model: nn.Module) -> dict[str, Any]:
    """What is attached to ``model`` and its submodules, each object once, by path."""
    found: dict[str, Any] = {}
    seen: set[int] = set()
    for path, module in model.named_modules():
        for name, obj in _ATTACHED.get(module, {}).items():
            if id(obj) not in seen:
                seen.add(id(obj))
                found[f"{path}.{name}" if path else name] = obj
    return found


def attached_states(models: list[nn.Module]) -> list[dict[str, Any]]:
    """Per model, the ``state_dict()`` of everything attached to it."""
    return [{key: obj.state_dict() for key, obj in _attached(m).items()} for m in models]


def check_attached(saved: list[dict], models: list[nn.Module]) -> None:
    """Raise ValueError where the checkpoint holds attached state that a model lacks.

    ``saved`` is empty for a checkpoint written before attaching existed.
    """
    for k, (states, model) in enumerate(zip(saved, models, strict=False)):
        missing = sorted(set(states) - set(_attached(model)))
        if missing:
            raise ValueError(
                f"the checkpoint holds state attached to model {k} as {missing} (with_bagua "
                "attaches 'bagua'); that model has none: set it up as saved before loading"
            )


def load_attached(models: list[nn.Module], saved: list[dict], resized: bool) -> None:
    """Load each model's attached objects, or (after a resize) rebind them to the model."""
    for model, states in zip(models, saved, strict=False):  # saved: as for check_attached
        objects = _attached(model)
        for key, state in states.items():
            if not resized:
                objects[key].load_state_dict(state)
            elif callable(getattr(objects[key], "rebind", None)):
                objects[key].rebind()
