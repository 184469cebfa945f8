"""Waiting on torch.distributed work with errors that name the peer and the operation."""

from __future__ import annotations

from collections.abc import Iterable

import torch.distributed as dist

from gossamer import context
from gossamer.errors import CommunicationTimeout, PeerError

__all__ = ["wait_works"]


def wait_works(op: str, works: Iterable[tuple[int, dist.Work]]) -> None:
    """Wait for each ``(peer, work)``; turn gloo's errors into errors that name the peer.

    ``peer`` is a global rank, or -1 for a collective over all ranks.

    Raises:
        CommunicationTimeout: the backend's deadline passed.
        PeerError: a peer closed its connection or the transfer failed.
    """
    for peer, work in works:
        try:
            work.wait()
        except RuntimeError as err:
            text = str(err)
            who = "all ranks" if peer < 0 else f"rank {peer}"
            if "Timed out" in text or "timeout" in text.lower():
                raise CommunicationTimeout(
                    f"{op}: rank {context.rank()} timed out after {context.timeout():g} s "
                    f"waiting for {who}"
                ) from err
            if "closed" in text or "reset" in text or "Broken pipe" in text:
                raise PeerError(
                    f"{op}: {who} closed its connection to rank {context.rank()}; "
                    "did that rank crash or exit?"
                ) from err
            raise PeerError(f"{op}: communication with {who} failed: {text}") from err
