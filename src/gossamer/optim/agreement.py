"""Every rank builds an optimizer with the same settings: checked once, when it is built.

Settings that shape the communication (a period, cliques, a topology, a correction) must be
the same on every rank. When they are not, the rounds pair up across different steps, or
wait for a peer that never comes, and nothing says why. So building an optimizer ends
with one small allgather (collective, like the optimizer's rounds): every rank's
configuration id (:func:`~gossamer.communicators.compressed.configuration_id` of its
settings, as text) and whether its build failed. A rank whose build raised ``TypeError``
or ``ValueError`` takes part too (:func:`building`), so its peers raise
:class:`~gossamer.errors.PeerArgumentError` at once instead of waiting for it.
"""

from __future__ import annotations

import contextlib
import functools
import zlib
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import torch
import torch.distributed as dist

from gossamer import context, ops, transport
from gossamer.communicators.compressed import configuration_id
from gossamer.errors import PeerArgumentError, PeerError
from gossamer.topology import Topology

__all__ = ["agree", "agreed", "building"]


def agreed(close: bool = False) -> Callable[[Callable], Callable]:
    """Decorator of an ``__init__``: build, then :func:`agree` on ``self.settings()``.

    Only the class built checks (a base's ``__init__`` called from a subclass's does not),
    as ``type(self).__name__``. With ``close``, a build whose settings differ across ranks
    is closed (``self.close()``) before the error propagates.
    """

    def wrap(init: Callable) -> Callable:
        @functools.wraps(init)
        def built(self: object, *args: object, **kwargs: object) -> None:
            if self.__dict__.get("_building"):
                init(self, *args, **kwargs)
                return
            what = type(self).__name__
            self._building = True  # type: ignore[attr-defined]
            try:
                with building(what):
                    init(self, *args, **kwargs)
            finally:
                del self._building  # type: ignore[attr-defined]
            try:
                agree(what, self.settings())  # type: ignore[attr-defined]
            except PeerError:
                if close:
                    self.close()  # type: ignore[attr-defined]
                raise

        return built

    return wrap


@contextlib.contextmanager
def building(what: str) -> Iterator[None]:
    """Build ``what`` inside: a ``TypeError``/``ValueError`` still takes part in the check.

    The other ranks' :func:`agree` then raises instead of waiting for this one.
    """
    try:
        yield
    except (TypeError, ValueError):
        with contextlib.suppress(Exception):  # the caller's own error is the one to see
            _exchange(0, failed=True)
        raise


def agree(
    what: str, settings: Mapping[str, object], group: dist.ProcessGroup | None = None
) -> None:
    """Check that every rank (of ``group``) built ``what`` with the same ``settings``.

    Collective over ``group`` (default: the world); its ranks are named by their rank in it.

    Raises:
        PeerArgumentError: another rank's build of ``what`` failed (its own error says why).
        PeerError: on every rank, naming the ranks whose settings differ from rank 0's.
    """
    text = ", ".join(f"{name}={_describe(value)}" for name, value in settings.items())
    rows = _exchange(configuration_id(f"{what}({text})"), failed=False, group=group)
    if rows is None:
        return
    failed = [r for r, (bad, _) in enumerate(rows) if bad]
    if failed:
        raise PeerArgumentError(
            f"{what}: ranks {failed} could not build it (their errors say why)", failed
        )
    other = [r for r, (_, codec) in enumerate(rows) if codec != rows[0][1]]
    if other:
        raise PeerError(
            f"{what}: ranks {other} gave other settings than rank 0; every rank must "
            f"give the same (this rank: {text})"
        )


def _exchange(
    codec: int, failed: bool, group: dist.ProcessGroup | None = None
) -> list[list[int]] | None:
    """Every rank's ``(failed, codec)``; None alone, or after a death (no world collective)."""
    if not context.is_initialized() or context.size() == 1:
        return None
    live = transport.get_liveness()
    if live is not None and live.lost:  # survivors build among themselves
        return None
    mine = torch.tensor([int(failed), codec], dtype=torch.int64)
    return ops.allgather(mine, group=group).view(-1, 2).tolist()


def _describe(value: object) -> str:
    """``value`` as text that is the same on every rank for the same value."""
    if isinstance(value, Topology):
        weights = np.ascontiguousarray(value.weights, dtype=np.float64)
        return f"Topology({value.name!r}, weights #{zlib.crc32(weights.tobytes())})"
    return repr(value)
