"""The strategy interface: what one communication round does to a flat tensor.

A :class:`Communicator` is given the flat buckets of a model once (:meth:`~Communicator.bind`),
then, every round, the current value of each bucket (:meth:`~Communicator.start`); it returns
something whose ``wait()`` gives the bucket's new value. Optimizers decide *when* rounds
happen; communicators decide *what* a round is. Each owns its state (round counter, schedule
position, windows, replicas) with ``state_dict()`` / ``load_state_dict()``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from gossamer import context, ops
from gossamer.errors import TopologyError
from gossamer.fusion import Bucket
from gossamer.topology import Topology

__all__ = ["Communicator", "Deferred", "Pending", "PostedState", "check_topology"]


class Pending(Protocol):
    """A round in flight: ``wait()`` returns the bucket's new value."""

    def wait(self) -> Any:
        """Block until the round is done; return the new value."""


class Deferred:
    """A result computed on the caller's thread when it is waited for.

    Window rounds finish with a combine that takes locks the progress thread must be free to
    grant, so it cannot run in a completion callback.
    """

    def __init__(self, compute: Callable[[], Any]) -> None:
        self._compute: Callable[[], Any] | None = compute
        self._value: Any = None

    def wait(self) -> Any:
        """Compute the value (once) and return it."""
        if self._compute is not None:
            compute, self._compute = self._compute, None
            self._value = compute()
        return self._value


class PostedState:
    """What a communicator's posted rounds keep per bucket (see ``transport.posted``).

    Receive buffers by source slot (reused every round), and the layout each bucket's
    first round checked across ranks (checked again only if it changes).
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._checked: dict[int, object] = {}

    def buffer(self, index: int, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The receive buffer of bucket ``index``'s ``slot``-th source."""
        found = self._buffers.get((index, slot))
        if found is None or found.dtype != dtype or found.numel() != numel:
            found = self._buffers[index, slot] = torch.empty(numel, dtype=dtype)
        return found

    def result(self, index: int, flat: torch.Tensor) -> torch.Tensor:
        """A buffer kept for bucket ``index``'s result, shaped like ``flat``, not ``flat``.

        Two alternate, so a round whose input is the bucket's last result (``x = round(x)``)
        does not write over its own input.
        """
        out = self.buffer(index, -1, flat.numel(), flat.dtype)
        if out.data_ptr() == flat.data_ptr():
            out = self.buffer(index, -2, flat.numel(), flat.dtype)
        return out.view_as(flat)

    def needs_check(self, index: int, layout: object) -> bool:
        """Whether bucket ``index``'s round must check ``layout`` (first time, or changed)."""
        check = self._checked.get(index) != layout
        self._checked[index] = layout
        return check


def check_topology(topology: object) -> Topology | None:
    """``topology`` if it is None or a Topology of the world's size (once initialized)."""
    if topology is None:
        return None
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
    if context.is_initialized() and topology.size != context.size():
        raise TopologyError(
            f"topology has {topology.size} ranks but the world has {context.size()}"
        )
    return topology


def check_every(value: object, name: str) -> int | None:
    """``value`` if it is None or an int >= 1, else ValueError naming ``name``."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be an int >= 1 or None; got {value!r}")
    return value


class Communicator(abc.ABC):
    """Base of every communication pattern.

    Args:
        global_average_every (int, optional): every K-th round is a global ``allreduce``
            average instead of this pattern's (periodic global averaging).
    """

    #: the name of this pattern in :data:`gossamer.communicators.COMMUNICATIONS`
    name: str = ""

    def __init__(self, *, global_average_every: int | None = None) -> None:
        self.global_average_every = check_every(global_average_every, "global_average_every")
        self.rounds = 0
        self._global = False
        # A pattern that samples (random peers, stochastic rounding) draws only from this
        # generator, so that its state in state_dict() makes a resumed run draw the same.
        self.generator: torch.Generator | None = None

    @property
    def communication(self) -> str:
        """The pattern's name (``"neighbor_allreduce"``, ...)."""
        return self.name

    def compression_config(self) -> str:
        """The compression of this pattern's rounds, which a state it loads must share.

        ``"no compression"`` here; compressed patterns name their compressor.
        """
        return "no compression"

    def bind(self, buckets: Sequence[Bucket]) -> None:  # noqa: B027 - optional hook
        """Called once with the optimizer's buckets (window patterns create windows here)."""

    def rebind(self, buckets: Sequence[Bucket]) -> None:  # noqa: B027 - optional hook
        """Rebuild what :meth:`bind` made from the buckets' values now (the model was replaced).

        Collective for window patterns, whose slots would otherwise still hold the models
        they were created from.
        """

    def next_round(self) -> None:
        """Advance to the next round (a global one every ``global_average_every``)."""
        self.rounds += 1
        every = self.global_average_every
        self._global = every is not None and self.rounds % every == 0
        if not self._global:
            self._advance()

    def _advance(self) -> None:  # noqa: B027 - optional hook
        """Pick this round's peers (dynamic patterns)."""

    def start(
        self, flat: torch.Tensor, index: int = 0, *, in_place: bool = False
    ) -> Pending | None:
        """Start this round on bucket ``index``, whose value is ``flat``; None: unchanged.

        ``in_place=True`` lets the round write its result into ``flat`` itself (in its
        ``wait()``, not before) instead of into a buffer of its own, for a caller that would
        copy it there. Only posted neighbour and CHOCO rounds do; the others return a tensor
        of their own as before, so the caller still takes the result from ``wait()``.
        """
        if context.size() == 1:
            return None
        if self._global:
            return self._global_start(flat)
        self._in_place = in_place
        return self._start(flat, index)

    _in_place = False  # the in_place of the round being started

    def _result_buffer(self, posted: PostedState, index: int, flat: torch.Tensor) -> torch.Tensor:
        """Where a posted round writes its result: ``flat`` if in place, else a kept buffer."""
        return flat if self._in_place else posted.result(index, flat)

    def _global_start(self, flat: torch.Tensor) -> Pending | None:
        """A global round: an ``allreduce`` average."""
        return ops.allreduce(flat, async_op=True)

    @abc.abstractmethod
    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        """This pattern's round (a world of more than one rank, not a global round)."""

    def state_dict(self) -> dict:
        """What the next rounds depend on: the round counter and, if set, ``generator``'s state.

        A pattern that samples sets ``self.generator`` (a ``torch.Generator``) in its
        constructor and draws only from it; its state is saved here as ``"rng"``.
        """
        state: dict = {"rounds": self.rounds}
        if self.generator is not None:
            state["rng"] = self.generator.get_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` holds a generator state and this communicator has no
                ``generator`` (it was saved from another pattern).
        """
        self.rounds = int(state["rounds"])
        rng = state.get("rng")
        if rng is not None:
            if self.generator is None:
                raise ValueError(
                    f"state holds a random generator's state but {type(self).__name__} "
                    "draws from none (was it saved from another communicator?)"
                )
            self.generator.set_state(rng)

    def discard_round(self) -> None:  # noqa: B027 - optional hook
        """Drop what the last round carried into the next one (error-feedback residuals).

        Called when that round's result was not applied: a loss scaler skipped the step on
        every rank alike, so the residuals may hold the overflow's infinities.
        """

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release what :meth:`bind` created (collective for window patterns)."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rounds={self.rounds})"
