"""The facade's process-wide state, held on gossamer's runtime.

Bagua keeps a default process group and a backend per wrapped model (found by the model's
name when a tensor is marked ready). Here they are one object, a component of
:func:`gossamer.context.runtime`, so ``gossamer.shutdown()`` stops the background loops
and drops everything with the rest.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gossamer import context

__all__ = ["BaguaState", "state"]


@dataclass
class BaguaState:
    """Bagua's globals for one runtime."""

    default_group: Any = None  # BaguaProcessGroup over the world, made on first use
    group_ids: itertools.count = field(default_factory=lambda: itertools.count(1))
    groups: dict[str, Any] = field(default_factory=dict)  # group name -> BaguaProcessGroup
    # torch group -> its BaguaProcessGroup (ProcessGroup.bagua_patch)
    torch_groups: weakref.WeakKeyDictionary = field(default_factory=weakref.WeakKeyDictionary)
    # module name -> its BaguaDistributedDataParallel (weakly: a dropped model goes away)
    models: weakref.WeakValueDictionary = field(default_factory=weakref.WeakValueDictionary)
    closers: list[Callable[[], None]] = field(default_factory=list)  # background loops

    def close(self) -> None:
        """Stop the background loops (called by ``gossamer.shutdown``)."""
        for closer in reversed(self.closers):
            closer()
        self.closers.clear()


def state() -> BaguaState:
    """The facade's state in this runtime (raises ``NotInitializedError`` before init)."""
    return context.runtime().component("bagua", BaguaState)
