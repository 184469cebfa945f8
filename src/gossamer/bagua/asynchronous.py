r"""Asynchronous model averaging: rounds on a background thread, over its own gloo group.

One round (:meth:`AsyncModelAverageOp.run_round`), with :math:`s` a snapshot of the local
weights taken when the round starts:

1. negotiate: the ranks add their "aborted" flags; when every rank has aborted, stop;
2. average the snapshots: :math:`\bar s = \frac1n \sum_r s_r` (``"all"``),
   :math:`(s + s_p)/2` with one peer (``"shift_one"``, any number of ranks), or the mean
   over this rank's line of a Moshpit grid, one dimension per round (``"moshpit"``:
   :func:`~gossamer.communicators.near_cubic_grid` of the world; every :math:`d` rounds
   of snapshots taken at once would give the global mean);
3. under the weight lock, :math:`x \leftarrow x + \bar s - s`, which keeps the local
   progress made while the round was in flight.

The training thread holds the lock from the forward pass to the end of the optimizer step,
so an update never lands in the middle of a step; ranks never wait for each other's steps,
only the background threads meet once per round. The thread communicates over its own gloo
group (CUDA weights are staged through host memory), so its rounds cannot interleave with
the training thread's operations on gossamer's communication thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossamer import context, transport
from gossamer.bagua.communicators import PEER_SELECTION_MODES, shift_one_peer
from gossamer.communicators import grid_groups, near_cubic_grid
from gossamer.ops.collectives import reduce_into

__all__ = ["ASYNC_PEER_SELECTION_MODES", "AsyncModelAverageOp", "BackgroundLoop", "new_gloo_group"]

#: Bagua's modes, and (beyond Bagua) Moshpit group averaging
ASYNC_PEER_SELECTION_MODES = (*PEER_SELECTION_MODES, "moshpit")


def new_gloo_group(ranks: list[int]) -> dist.ProcessGroup:
    """A new gloo group over ``ranks`` (collective: every rank of the world calls it)."""
    return transport.run(
        "new_group",
        lambda: dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=context.timeout())),
        False,
    )


class AsyncModelAverageOp:
    """The asynchronous averaging operation of one bucket (Bagua's asynchronous op).

    Args:
        bucket (BaguaBucket): the weights to average.
        peer_selection_mode (str): ``"all"`` or ``"shift_one"``.
        group (BaguaProcessGroup): the group the rounds run over (a gloo group of its own).

    Raises:
        ValueError: an unknown ``peer_selection_mode``.
    """

    def __init__(self, bucket: Any, peer_selection_mode: str, group: Any) -> None:
        if peer_selection_mode not in ASYNC_PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {ASYNC_PEER_SELECTION_MODES}; "
                f"got {peer_selection_mode!r}"
            )
        self.bucket = bucket
        self.peer_selection_mode = peer_selection_mode
        self.group = group
        self.rounds = 0  #: rounds applied so far
        self._weight_lock = threading.Lock()
        self._aborted = False
        self._status = True
        self.stopped_locally = False  # set at shutdown: leave without negotiating

    # ---------------------------------------------------------------- Bagua's op methods
    def lock_weight(self) -> None:
        """Take the weight lock (blocks while a round applies its update)."""
        self._weight_lock.acquire()

    def unlock_weight(self) -> None:
        """Release the weight lock."""
        self._weight_lock.release()

    def abort(self) -> None:
        """Flag this rank as done; rounds stop once every rank has flagged."""
        self._aborted = True

    def reset(self) -> None:
        """Clear the flag and mark the operation running again."""
        self._aborted = False
        self._status = True

    def set_status(self, status: bool) -> None:
        """Set whether rounds are running."""
        self._status = status

    def get_status(self) -> bool:
        """True while rounds are running."""
        return self._status

    # ---------------------------------------------------------------- one round
    def run_round(self) -> bool:
        """Negotiate, average a snapshot, apply the difference; False once stopped."""
        group = self.group.torch_group
        n = len(self.group.ranks)
        if self.stopped_locally:
            self._status = False
            return False
        flags = torch.tensor([1.0 if self._aborted else 0.0])
        reduce_into(flags, False, group)
        if flags.item() > n - 0.5:  # every rank aborted
            self._status = False
            return False
        snapshot = self.bucket.pack().to("cpu", copy=True)
        if self.peer_selection_mode == "all":
            total = snapshot.clone()
            reduce_into(total, False, group)
            delta = total.div_(n).sub_(snapshot)
        elif self.peer_selection_mode == "moshpit":
            delta = self._moshpit_delta(snapshot, group, n)
        else:
            me = dist.get_rank(group)
            peer = shift_one_peer(me, n, self.rounds)
            if peer is None:
                delta = None
            else:
                got = transport.exchange("pair_gossip", snapshot, {peer: snapshot}, [peer], group)
                delta = (got[peer] - snapshot).mul_(0.5)  # (s + s_p)/2 - s
        if delta is not None:
            with self._weight_lock:
                self.bucket.add_to_effective(delta)
        self.rounds += 1
        return True

    def _moshpit_delta(self, snapshot: torch.Tensor, group: Any, n: int) -> torch.Tensor | None:
        """The mean over this rank's grid line along dimension ``rounds mod d``, less ``s``."""
        grid, me = near_cubic_grid(n), dist.get_rank(group)
        line = next(g for g in grid_groups(grid, self.rounds % len(grid)) if me in g)
        peers = [r for r in line if r != me]
        if not peers:
            return None
        got = transport.exchange(
            "group_average", snapshot, dict.fromkeys(peers, snapshot), peers, group
        )
        return sum(got.values(), snapshot.clone()).div_(len(line)).sub_(snapshot)


class BackgroundLoop:
    """A daemon thread calling ``round()`` every ``interval_s`` until it returns False.

    The first error ends the loop and is kept in :attr:`error`.
    """

    def __init__(self, round_: Callable[[], bool], interval_s: float, name: str) -> None:
        self._round = round_
        self._interval_s = interval_s
        self._wake = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            while self._round():
                self._wake.wait(self._interval_s)
                self._wake.clear()
        except BaseException as err:  # kept for the training thread to raise
            self.error = err

    def wake(self) -> None:
        """Cut the current pause short."""
        self._wake.set()

    def join(self) -> None:
        """Wait for the loop to end (at most gossamer's deadline plus a grace period).

        Raises:
            CommunicationTimeout: it did not end in time.
        """
        from gossamer.errors import CommunicationTimeout

        limit = context.timeout() + self._interval_s + 30.0
        self._thread.join(limit)
        if self._thread.is_alive():
            raise CommunicationTimeout(f"asynchronous averaging did not stop within {limit:g} s")

    @property
    def alive(self) -> bool:
        """True while the thread runs."""
        return self._thread.is_alive()
