r"""Bagua's compressed patterns as gossamer communicators.

=============================  ==============================================================
class                          one round on a flat tensor :math:`x`
=============================  ==============================================================
``ScatterGatherCompressed``    ByteGrad: compressed reduce-scatter, then compressed allgather
``LowPrecisionGossip``         DCD-PSGD: neighbours exchange compressed *differences* and
                               keep replicas of each other's public model
=============================  ==============================================================

Both take any compressor of :mod:`gossamer.compression` (an object with ``compress`` and
``decompress``, or a name for ``gossamer.compression.get_compressor``; Bagua's
``"MinMaxUInt8"`` is the 8-bit min-max quantizer). Compressors never communicate: the
payloads travel as bytes through gossamer's collectives.

Stochastic compressors draw from this rank's stream
(:func:`gossamer.compression.for_rank` with the global rank, as in gossamer's own
communicators): QSGD's and natural compression's rounding noise is independent across ranks,
random-k's positions are common to all; the stream position is in ``state_dict()``.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from typing import Any

import torch

from gossamer import context, ops, transport
from gossamer.bagua._groups import CommMember, default_group
from gossamer.bagua.communicators import KEYS, GroupCommunicator
from gossamer.communicators import (
    CompressedAllreduce,
    Pending,
    difference_round,
    payload_exchange,
)
from gossamer.communicators.base import Deferred, PostedState
from gossamer.communicators.compressed import RankStreams, codec_id
from gossamer.communicators.difference import Arrivals, payload_poster, publish_differences
from gossamer.compression import Compressor, Payload, get_compressor
from gossamer.topology import Topology

__all__ = ["LowPrecisionGossip", "ScatterGatherCompressed", "resolve_compressor"]

# Tags of the posted ring, apart from gossamer's buckets and Bagua's shift_one segments.
_KEY = 2 * KEYS

# Bagua's compression names -> gossamer.compression's
_NAMES = {"MinMaxUInt8": "uint8"}


def resolve_compressor(compression: str | Compressor) -> Compressor:
    """The compressor that ``compression`` names (Bagua's ``"MinMaxUInt8"`` is ``"uint8"``).

    Raises:
        ValueError, TypeError: as :func:`gossamer.compression.get_compressor`.
    """
    if isinstance(compression, str):
        compression = _NAMES.get(compression, compression)
    return get_compressor(compression)


def _leaders() -> Any:
    """The communicator of the machines' first ranks (None on other ranks)."""
    comm = default_group().get_inter_node_communicator()
    return None if comm is CommMember.NON_COMM_MEMBER else comm


class _Compressed(RankStreams, GroupCommunicator):
    def __init__(self, compression: str | Compressor, *, hierarchical: bool, group: Any) -> None:
        super().__init__(hierarchical=hierarchical, group=group)
        self.compressor = resolve_compressor(compression)
        # The configuration's id, the same on every rank (the ranks' streams differ).
        self.codec = codec_id(self.compressor)
        self._use_rank_streams()

    def state_dict(self) -> dict:
        """Rounds and the compressor's stream position."""
        return {**super().state_dict(), **self._compression_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        super().load_state_dict(state)
        self._use_rank_streams()
        self._load_compression_state(state)

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        self._use_rank_streams()
        x = flat.detach().clone()  # the caller may change flat while the round runs
        # One job on gossamer's communication thread; the operations inside run in place.
        return transport.submit(self.name, lambda: self._round(x, index))

    def _round(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if not self.hierarchical:
            return self._among(x, index, self.group, self.me, self.nranks)
        # Exactly inside the machine, compressed between the machines' first ranks.
        x = ops.local_allreduce(x, average=self._machine_average())
        leaders = _leaders()
        if leaders is not None:
            x = self._among(x, index, leaders.group, leaders.rank(), leaders.nranks())
        return ops.broadcast_(x, root=0, group=ops.local_group())

    def _machine_average(self) -> bool:
        return True

    @abc.abstractmethod
    def _among(self, x: torch.Tensor, index: int, group: Any, me: int, n: int) -> torch.Tensor:
        """The round among ``n`` ranks of ``group`` (this one is ``me``)."""

    def _decode(self, buffer: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return self.compressor.decompress(Payload(buffer.contiguous(), like.shape, like.dtype))


class ScatterGatherCompressed(_Compressed):
    r"""ByteGrad's round: compressed scatter-reduce-gather over :math:`n` ranks.

    With :math:`C`/:math:`D` the compressor and :math:`x^{(j)}` the :math:`j`-th of
    :math:`n` equal chunks (zero-padded):

    .. math:: y^{(j)} = D\Big(C\big(\tfrac1n \textstyle\sum_i D(C(x_i^{(j)}))\big)\Big)

    (a sum without ``average``): each chunk is compressed separately and sent to its owner
    (alltoall), the owner reduces its chunk, compresses it again, and everyone gathers the
    compressed chunks (allgather). Hierarchical: machines average (sum) exactly first.

    Args:
        compression: compressor or name (``"MinMaxUInt8"``).
        average (bool): average instead of sum.
        hierarchical (bool), group (ProcessGroup, optional): see
            :class:`~gossamer.bagua.communicators.GroupCommunicator`.
    """

    name = "bagua_scatter_gather"

    def __init__(
        self,
        compression: str | Compressor = "MinMaxUInt8",
        *,
        average: bool = True,
        hierarchical: bool = False,
        group: Any = None,
    ) -> None:
        super().__init__(compression, hierarchical=hierarchical, group=group)
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool; got {average!r}")
        self.average = average
        # Over the whole world this is gossamer's compressed allreduce (Bagua: no feedback).
        self._world = None
        if not hierarchical and group is None:
            self._world = CompressedAllreduce(
                self.compressor, error_feedback=False, average=average
            )

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        if self._world is not None:
            self._world.next_round()
            return self._world.start(flat, index)
        return super()._start(flat, index)

    def _machine_average(self) -> bool:
        return self.average

    def state_dict(self) -> dict:
        """As the base's; over the whole world, the compressed allreduce's state."""
        state = super().state_dict()
        if self._world is not None:
            state["world"] = self._world.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output."""
        super().load_state_dict(state)
        if self._world is not None and "world" in state:
            self._world.load_state_dict(state["world"])

    def _among(self, x: torch.Tensor, index: int, group: Any, me: int, n: int) -> torch.Tensor:
        flat = x.reshape(-1)
        count = math.ceil(flat.numel() / n)
        padded = flat.new_zeros(n * count)
        padded[: flat.numel()] = flat
        chunks = padded.view(n, count)
        sent = torch.cat([self.compressor.compress(c).buffer for c in chunks])
        received = ops.alltoall(sent, group=group).view(n, -1)
        mine = self._decode(received[0], chunks[0]).clone()
        for i in range(1, n):
            mine.add_(self._decode(received[i], chunks[0]))
        if self.average:
            mine.div_(n)
        gathered = ops.allgather(self.compressor.compress(mine).buffer, group=group).view(n, -1)
        out = torch.cat([self._decode(gathered[i], chunks[0]) for i in range(n)])
        return out[: flat.numel()].view_as(x)


class LowPrecisionGossip(Arrivals, _Compressed):
    r"""Bagua's low-precision decentralized round (difference compression, DCD-PSGD).

    Every rank keeps replicas of its own public model :math:`\hat w` and of each
    in-neighbour's, :math:`\hat x_j`, all starting at :math:`x_0`. With receive weights
    :math:`w_{ii}, w_{ji}` (Bagua: the ring, 1/3 each),

    .. math:: d_i = x_i + \sum_j w_{ji}\hat x_j + (w_{ii} - 2)\hat w_i,\qquad
        \hat x_j \mathrel{+}= D(C(d_j)),\ \hat w_i \mathrel{+}= D(C(d_i)),\
        x_i \leftarrow \hat w_i,

    i.e. :math:`\hat w` moves to :math:`w_{ii}\hat w + \sum_j w_{ji}\hat x_j + (x - \hat w)`
    up to compression error; only :math:`C(d_i)` travels (to the out-neighbours). Every
    rank must start from the same :math:`x_0` (``with_bagua`` broadcasts it). The round
    is :func:`gossamer.communicators.difference_round`, as in
    :class:`~gossamer.communicators.DifferenceGossip`, whose replicas start at zero instead.

    Args:
        compression: compressor or name (``"MinMaxUInt8"``).
        topology (Topology, optional): the mixing graph and weights (over machines when
            hierarchical); None: Bagua's ring, left and right neighbour 1/3 each.
        hierarchical (bool), group (ProcessGroup, optional): see
            :class:`~gossamer.bagua.communicators.GroupCommunicator`.
        replicas (tuple of 3 tensors, optional): Bagua's ``weight``, ``left_peer_weight``
            and ``right_peer_weight`` buffers (ring only), updated in place.
    """

    name = "bagua_low_precision_gossip"

    def __init__(
        self,
        compression: str | Compressor = "MinMaxUInt8",
        *,
        topology: Topology | None = None,
        hierarchical: bool = False,
        group: Any = None,
        replicas: Sequence[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(compression, hierarchical=hierarchical, group=group)
        if topology is not None:
            if not isinstance(topology, Topology):
                raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
            if topology.size != self.nranks:
                raise ValueError(
                    f"topology has {topology.size} nodes but there are {self.nranks} "
                    f"{'machines' if hierarchical else 'ranks'}"
                )
            if replicas is not None:
                raise ValueError("replicas are Bagua's ring buffers: give them without topology")
        self.topology = topology
        self._ring_buffers = None if replicas is None else list(replicas)
        self._replicas: dict[int, dict[Any, torch.Tensor]] = {}
        self._posted = PostedState()

    def bind(self, buckets: Sequence[Any]) -> None:
        """Start every bucket's replicas at its current value ``x0`` (before any step).

        Without it, replicas start at the first value a round sees, which is only right
        when that round comes before the first local step.
        """
        for index, bucket in enumerate(buckets):
            if index == 0 and self._ring_buffers is not None:
                own, left, right = self._ring_buffers  # Bagua's buffers hold x0 already
                self._replicas[0] = {"self": own, "left": left, "right": right}
                continue
            x0 = bucket.pack().detach().clone()
            keys = ["left", "right"] if self.topology is None else sorted(self._in_neighbors())
            self._replicas[index] = {"self": x0.clone(), **{k: x0.clone() for k in keys}}

    def _in_neighbors(self) -> list[int]:
        assert self.topology is not None
        return list(self.topology.in_neighbors(self.me))

    def _peers(self, me: int, n: int) -> tuple[float, list[tuple[int, float, Any]], list[int]]:
        """(self weight, [(source, weight, replica key)], destinations)."""
        if self.topology is not None:
            sw, weights = self.topology.recv_weights(me)
            return (
                sw,
                [(j, w, j) for j, w in sorted(weights.items())],
                list(self.topology.out_neighbors(me)),
            )
        if n == 1:
            return 1.0, [], []
        left, right = (me - 1) % n, (me + 1) % n
        return 1 / 3, [(left, 1 / 3, "left"), (right, 1 / 3, "right")], sorted({left, right})

    def _state(self, index: int, x: torch.Tensor, peers: list[tuple[int, float, Any]]) -> dict:
        if index not in self._replicas:
            if index == 0 and self._ring_buffers is not None:
                own, left, right = self._ring_buffers
                self._replicas[0] = {"self": own, "left": left, "right": right}
            else:
                self._replicas[index] = {
                    "self": x.clone(),
                    **{key: x.clone() for _, _, key in peers},
                }
        return self._replicas[index]

    def posts(self, like: torch.Tensor) -> bool:
        """Whether rounds on tensors like ``like`` are posted from the caller's thread.

        They are among the ranks of the world (no sub-group; ``hierarchical`` only with one
        rank per machine, where it is the same ring), with payloads of a fixed size, on
        tensors that ``transport.can_post`` takes.
        """
        return (
            self.group is None
            and (not self.hierarchical or context.local_size() == 1)
            and self.compressor.exact_nbytes
            and transport.can_post(like.new_empty(0))
        )

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        """A posted round (see :meth:`posts`) runs here and returns without waiting.

        The new model needs only this rank's difference; the peers' differences are
        needed only by the next round (see
        :func:`~gossamer.communicators.difference.publish_differences`), so they travel while the
        caller runs its next forward and backward passes. Bagua's op blocks instead. The
        result is a buffer kept for the bucket, valid until its next round.
        """
        self._take(index)
        if not self.posts(flat):
            return super()._start(flat, index)
        self._use_rank_streams()
        x = flat.reshape(-1)
        sw, peers, dsts, sources, reps = self._plan(index, x, self.me, self.nranks)
        nbytes = self.compressor.payload_nbytes(x.numel(), x.dtype)
        post = payload_poster(self._posted, index, nbytes, dsts, sources, self.codec, _KEY + index)
        self._arrive(index, publish_differences(self.compressor, x, reps, sw, peers, post))
        new = self._posted.result(index, x).copy_(reps["self"]).view_as(flat)
        return Deferred(lambda: new)

    def _among(self, x: torch.Tensor, index: int, group: Any, me: int, n: int) -> torch.Tensor:
        sw, peers, dsts, sources, reps = self._plan(index, x, me, n)
        exchange = payload_exchange(dsts, sources, self.codec, group)
        return difference_round(self.compressor, x, reps, sw, peers, exchange)

    def _plan(self, index: int, x: torch.Tensor, me: int, n: int) -> tuple:
        """(self weight, peers, destinations, sources, the bucket's replicas) of a round."""
        sw, peers, dsts = self._peers(me, n)
        sources = sorted({j for j, _, _ in peers})  # a ring of two: left is right
        return sw, peers, dsts, sources, self._state(index, x, peers)

    def state_dict(self) -> dict:
        """Rounds and the replicas of every bucket (after the differences still arriving)."""
        self._take()
        replicas = {
            i: {k: t.clone() for k, t in reps.items()} for i, reps in self._replicas.items()
        }
        return {**super().state_dict(), "replicas": replicas}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (replicas copied into existing buffers)."""
        self._take()
        super().load_state_dict(state)
        for i, reps in state.get("replicas", {}).items():
            mine = self._replicas.setdefault(int(i), {})
            for k, t in reps.items():
                if k in mine:
                    mine[k].copy_(t)
                else:
                    mine[k] = t.clone()
