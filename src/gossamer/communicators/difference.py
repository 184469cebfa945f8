r"""Difference-compressed gossip: DCD-PSGD (Tang et al., NeurIPS 2018), Bagua's low-precision ring.

Every rank keeps its own public model :math:`\hat w_i` and a replica :math:`\hat x_j` of
each in-neighbour's public model. A round on :math:`x_i` (the model after the local step,
as adapt-then-combine sends it) with receive weights :math:`w_{ii}, w_{ji}`:

.. math::
    d_i = x_i + \sum_j w_{ji}\,\hat x_j + (w_{ii} - 2)\,\hat w_i,\qquad
    \hat w_i \mathrel{+}= D(C(d_i)),\quad \hat x_j \mathrel{+}= D(C(d_j)),\qquad
    x_i \leftarrow \hat w_i,

so :math:`\hat w_i` moves to :math:`w_{ii}\hat w_i + \sum_j w_{ji}\hat x_j + (x_i - \hat
w_i)`, the gossip step plus the local progress, up to the compression error of
:math:`d_i`. Only :math:`C(d_i)` travels, the same payload to every out-neighbour, and
both ends of an edge add the same decoded values, so a rank's replica of a neighbour stays
equal to that neighbour's public model. Unlike CHOCO (:class:`ChocoGossip`) the error is
not compensated: it enters the model each round, so DCD wants fine compressors (``uint8``,
``qsgd``, casts), whose error shrinks with :math:`d_i`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gossamer import context, transport
from gossamer.communicators.base import (
    Communicator,
    Deferred,
    Pending,
    PostedState,
    check_topology,
)
from gossamer.communicators.compressed import RankStreams, codec_id, typed_codec
from gossamer.compression import Compressor, Payload, get_compressor
from gossamer.errors import TopologyError
from gossamer.fusion import Bucket
from gossamer.ops import get_topology
from gossamer.topology import Topology

__all__ = [
    "Arrivals",
    "DifferenceGossip",
    "difference_payload",
    "difference_round",
    "payload_exchange",
    "payload_poster",
    "publish_differences",
    "take_differences",
]

_OP = "compressed_gossip"


def difference_round(
    compressor: Compressor,
    x: torch.Tensor,
    replicas: dict[Any, torch.Tensor],
    self_weight: float,
    peers: Sequence[tuple[int, float, Any]],
    exchange: Callable[[torch.Tensor], dict[int, torch.Tensor]],
) -> torch.Tensor:
    """One DCD round on the flat ``x``; returns the new model (a copy of ``replicas["self"]``).

    ``replicas`` holds ``"self"`` and each peer's replica under its key, updated in place;
    ``peers`` lists ``(source rank, weight, replica key)`` (a source may appear twice: the
    left and right of a ring of two); ``exchange(payload bytes)`` sends them to the
    out-neighbours and returns the bytes each source sent.
    """

    def post(buffer: torch.Tensor) -> Deferred:
        return Deferred(lambda: exchange(buffer))  # sent when take() waits, at once

    publish_differences(compressor, x, replicas, self_weight, peers, post)()
    return replicas["self"].clone()


def publish_differences(
    compressor: Compressor,
    x: torch.Tensor,
    replicas: dict[Any, torch.Tensor],
    self_weight: float,
    peers: Sequence[tuple[int, float, Any]],
    post: Callable[[torch.Tensor], Pending],
) -> Callable[[], None]:
    """The first half of :func:`difference_round`: returns ``take``, the second half.

    ``replicas["self"]``, the new model, is final on return: the round needs the peers'
    differences only for their replicas, which the *next* round reads. So the caller may
    go on (a forward and backward pass) while they travel, and call ``take()`` (which
    adds them into the replicas) before the next round on these replicas; the models are
    those of the blocking round, step for step. ``post(payload bytes)`` starts sending
    them; the pending round it returns gives the sources' bytes when waited for.
    """
    payload = difference_payload(compressor, x, replicas, self_weight, peers)
    posted = post(payload.buffer)
    return lambda: take_differences(compressor, posted.wait(), replicas, peers, replicas["self"])


def payload_exchange(
    dsts: Sequence[int], sources: Sequence[int], codec: int, group: Any = None
) -> Callable[[torch.Tensor], dict[int, torch.Tensor]]:
    """The ``exchange`` of :func:`difference_round` over ``group`` (None: the world).

    It sends one payload to every destination and returns a payload from every source.
    """

    def exchange(buffer: torch.Tensor) -> dict[int, torch.Tensor]:
        sends = dict.fromkeys(dsts, buffer)
        return transport.exchange(
            _OP, buffer, sends, sources, group, any_first_dim=True, codec=codec
        )

    return exchange


def payload_poster(
    posted: PostedState,
    index: int,
    nbytes: int,
    dsts: Sequence[int],
    sources: Sequence[int],
    codec: int,
    key: int | None = None,
) -> Callable[[torch.Tensor], Pending]:
    """The ``post`` of :func:`publish_differences` for a posted round of bucket ``index``.

    It sends the ``nbytes`` payload to every destination and receives one from every
    source into ``posted``'s buffers (``transport.post_exchange``, tags from ``key``,
    default ``index``); a bucket's first round checks the layout across ranks.
    """
    receives = {
        j: posted.buffer(index, slot, nbytes, torch.uint8) for slot, j in enumerate(sources)
    }
    check = posted.needs_check(index, nbytes)
    key = index if key is None else key

    def post(buffer: torch.Tensor) -> Pending:
        sends = dict.fromkeys(dsts, buffer)
        return transport.post_exchange(
            _OP, buffer, sends, receives, key=key, check=check, codec=codec
        )

    return post


def difference_payload(
    compressor: Compressor,
    x: torch.Tensor,
    replicas: dict[Any, torch.Tensor],
    self_weight: float,
    peers: Sequence[tuple[int, float, Any]],
) -> Payload:
    """``C(d)`` for this rank's difference ``d``; its own public model gets ``D(C(d))``."""
    diff = x.clone()
    for _, weight, key in peers:
        diff.add_(replicas[key], alpha=weight)
    diff.add_(replicas["self"], alpha=self_weight - 2)
    return compressor.compress_add_(diff, replicas["self"])


def take_differences(
    compressor: Compressor,
    received: dict[int, torch.Tensor],
    replicas: dict[Any, torch.Tensor],
    peers: Sequence[tuple[int, float, Any]],
    like: torch.Tensor,
) -> None:
    """Add each source's decoded difference (``received`` bytes) into its replica."""
    for source, _, key in peers:
        sent = Payload(received[source].contiguous(), like.shape, like.dtype)
        compressor.decompress_add_(sent, replicas[key])


class Arrivals:
    """A mixin for communicators that leave rounds' differences arriving.

    It keeps, per bucket, the ``take()`` of the last round published with
    :func:`publish_differences`, to run before the bucket's next round.
    """

    def _arrive(self, index: int, take: Callable[[], None]) -> None:
        """Keep ``take`` for bucket ``index`` (whose earlier one must have run)."""
        self.__dict__.setdefault("_arriving", {})[index] = take

    def _take(self, index: int | None = None) -> None:
        """Add the differences still arriving (for bucket ``index``; None: every bucket)."""
        arriving = self.__dict__.setdefault("_arriving", {})
        for i in list(arriving) if index is None else [index]:
            take = arriving.pop(i, None)
            if take is not None:
                take()

    def close(self) -> None:
        """Wait for the differences still arriving."""
        self._take()


class DifferenceGossip(Arrivals, RankStreams, Communicator):
    r"""Each round: DCD-PSGD over a static graph, sending compressed differences.

    Memory: :math:`1 + d_{in}` model-sized replicas per bucket. They start at zero on every
    rank, so the ranks need not start from the same model: the first round publishes each
    model (compressed once, :math:`x_i \leftarrow D(C(x_i))`) and mixing starts with the
    second. (Bagua starts them at the model it broadcast; ``gossamer.bagua`` does so.)
    A stochastic compressor draws from this rank's own stream; its position is in
    :meth:`state_dict`.

    Args:
        compression (str | Compressor): the compressor (default ``"uint8"``).
        topology (Topology, optional): the static graph and its weights (default: the
            default topology). Dynamic schedules are not supported: a replica is exact only
            while its neighbour sends to this rank every round.
    """

    name = "difference_gossip"

    def __init__(
        self, compression: str | Compressor = "uint8", *, topology: Topology | None = None
    ) -> None:
        super().__init__()
        self.compressor = get_compressor(compression)
        self.codec = codec_id(self.compressor)
        self.topology = check_topology(topology)
        # bucket index -> {"self" | source rank: replica}
        self.replicas: dict[int, dict[Any, torch.Tensor]] = {}
        self._posted = PostedState()
        self._use_rank_streams()

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """Check the topology against the world when the optimizer is built.

        Raises:
            TopologyError: ``topology`` is not over ``gossamer.size()`` ranks.
        """
        if self.topology is not None and self.topology.size != context.size():
            raise TopologyError(
                f"topology has {self.topology.size} ranks but the world has {context.size()}"
            )

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        self._begin(flat)
        self._take(index)
        if self.compressor.exact_nbytes and transport.can_post(flat):
            return self._post(flat, index)
        x = flat.detach().clone()  # the caller may change flat while the round runs
        return transport.submit(self.name, lambda: self._round(x, index))

    def _plan(self, index: int, flat: torch.Tensor) -> tuple:
        """(self weight, peers, destinations, the bucket's replicas) of this round."""
        graph = get_topology() if self.topology is None else self.topology
        me = transport.group_rank(None)
        self_weight, weights = graph.recv_weights(me)
        peers = [(j, weights[j], j) for j in sorted(weights)]
        replicas = self.replicas.setdefault(index, {})
        for key in ["self", *weights]:
            if key not in replicas:
                replicas[key] = torch.zeros_like(flat)
        return self_weight, peers, list(graph.out_neighbors(me)), replicas

    def _round(self, x: torch.Tensor, index: int) -> torch.Tensor:
        flat = x.reshape(-1)
        self_weight, peers, dsts, replicas = self._plan(index, flat)
        exchange = payload_exchange(
            dsts, [j for j, _, _ in peers], typed_codec(self.codec, flat.dtype)
        )
        return difference_round(
            self.compressor, flat, replicas, self_weight, peers, exchange
        ).view_as(x)

    def _post(self, flat: torch.Tensor, index: int) -> Pending:
        """The round posted from the caller's thread (fixed-size payloads, float on gloo).

        Compression runs here and the payload goes on the wire; the round's result, the
        bucket's new public model, is known at once (:func:`publish_differences`). The
        replicas take what arrived at the bucket's next round, so the transfer overlaps
        whatever the caller computes in between. The result is written into a buffer kept
        for the bucket, valid until its next round (as
        :class:`~gossamer.communicators.NeighborAllreduce`'s).
        """
        self_weight, peers, dsts, replicas = self._plan(index, flat)
        nbytes = self.compressor.payload_nbytes(flat.numel(), flat.dtype)
        sources = [j for j, _, _ in peers]
        codec = typed_codec(self.codec, flat.dtype)
        post = payload_poster(self._posted, index, nbytes, dsts, sources, codec)
        self._arrive(
            index, publish_differences(self.compressor, flat, replicas, self_weight, peers, post)
        )
        out = self._posted.result(index, flat).copy_(replicas["self"])
        return Deferred(lambda: out)

    def state_dict(self) -> dict:
        """Rounds, the replicas of every bucket, and the compressor's stream position.

        Waits for the differences still arriving first.
        """
        self._take()
        replicas = {i: {k: t.clone() for k, t in r.items()} for i, r in self.replicas.items()}
        return {**super().state_dict(), "replicas": replicas, **self._compression_state()}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (after the differences still arriving)."""
        self._take()
        super().load_state_dict(state)
        self._use_rank_streams()
        self._load_compression_state(state)
        self.replicas = {
            int(i): {k: t.clone() for k, t in r.items()}
            for i, r in state.get("replicas", {}).items()
        }
