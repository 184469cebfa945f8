"""Handles of asynchronous operations: ``wait()``, ``is_completed()``, ``get_future()``."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import torch

from gossamer.errors import CommunicationTimeout

__all__ = ["Handle"]

# A handle waits this much longer than the communication deadline itself, so that the
# engine's own, more precise timeout error (naming the peers) arrives first.
_GRACE_S = 30.0


class Handle:
    """The pending result of an operation started with ``async_op=True``.

    The operation reads its input tensor while it runs (as torch.distributed's and
    BlueFog's asynchronous operations do): leave it unchanged until :meth:`wait`, or pass
    a clone.

    Example:
        >>> handle = gossamer.allreduce(t, async_op=True)  # doctest: +SKIP
        >>> ...                                             # overlap other work
        >>> result = handle.wait()
    """

    def __init__(self, future: concurrent.futures.Future, op: str, deadline_s: float) -> None:
        self._future = future
        self._op = op
        self._deadline_s = deadline_s
        self._torch_future: torch.futures.Future | None = None

    @property
    def op(self) -> str:
        """Name of the operation (``"neighbor_allreduce"``, ...)."""
        return self._op

    def wait(self) -> Any:
        """Block until the operation is done; return its result or raise its error.

        Raises:
            CommunicationTimeout: the operation did not finish within the deadline.
            PeerError: a peer died or called something else.
        """
        try:
            return self._future.result(timeout=self._deadline_s + _GRACE_S)
        except TimeoutError:
            if self._future.done():  # the operation's own timeout error: keep it
                raise
            raise CommunicationTimeout(
                f"{self._op} did not complete within {self._deadline_s + _GRACE_S:g} s"
            ) from None

    def then(self, fn: Callable[[Any], Any]) -> Handle:
        """A handle to ``fn(result)``, computed as soon as this operation completes.

        ``fn`` runs on the thread that completes the operation (the communication thread).
        An error of the operation, or raised by ``fn``, is the new handle's error.
        """
        mapped: concurrent.futures.Future = concurrent.futures.Future()

        def forward(done: concurrent.futures.Future) -> None:
            try:
                value = fn(done.result())
            except BaseException as err:  # handed to the caller of wait()
                mapped.set_exception(err)
            else:
                mapped.set_result(value)

        self._future.add_done_callback(forward)
        return Handle(mapped, self._op, self._deadline_s)

    def is_completed(self) -> bool:
        """True once the operation finished (successfully or not); never blocks."""
        return self._future.done()

    def get_future(self) -> torch.futures.Future:
        """A ``torch.futures.Future`` that completes with the result (or the error)."""
        if self._torch_future is None:
            fut: torch.futures.Future = torch.futures.Future()

            def forward(done: concurrent.futures.Future) -> None:
                error = done.exception()
                if error is None:
                    fut.set_result(done.result())
                else:
                    fut.set_exception(error)

            self._torch_future = fut
            self._future.add_done_callback(forward)
        return self._torch_future

    def __repr__(self) -> str:
        state = "completed" if self.is_completed() else "pending"
        return f"Handle({self._op!r}, {state})"
