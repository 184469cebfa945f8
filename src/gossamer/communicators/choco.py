r"""Compressed gossip with error compensation: CHOCO-gossip (Koloskova et al., ICML 2019).

Every rank keeps *public copies* :math:`\hat x` that it and its neighbours update
identically, and sends only the compressed difference between its model and its copy:

.. math::
    q_i = C(x_i - \hat x_i),\qquad \hat x_j \mathrel{+}= D(q_j)\ \text{(at i and at j's
    neighbours)},\qquad x_i \mathrel{+}= \gamma \sum_{j} w_{ji}\,(\hat x_j - \hat x_i).

The copies absorb the compression error, so the ranks reach exact consensus (and the
average is preserved exactly for doubly stochastic :math:`W`) with any compressor, biased
ones included, for a small enough consensus step :math:`\gamma`.

Static graphs keep one public copy of this rank (sent to every out-neighbour) and one per
in-neighbour: :math:`(1 + d_{in})` extra model-sized buffers per bucket. Dynamic schedules
(one peer per step) change the receivers every round, so a single public copy would drift
from the copies of ranks that did not hear a round; there the copies are kept *per edge*:
one per out-neighbour and one per in-neighbour that the schedule ever uses
(:math:`d_{out} + d_{in}` buffers, e.g. :math:`2 \log_2 n` for the one-peer exponential
schedule), and the update is

.. math:: x_i \mathrel{+}= \gamma \Big(\sum_{s} w_{si}\,\hat x_{s\to i}
    - \big(\textstyle\sum_s w_{si}\big)\, \tfrac{1}{|D|}\sum_{d \in D} \hat x_{i\to d}\Big),

which preserves the average when every rank receives the total weight it gives, as in the
one-peer exponential schedule (weights 1/2).

With ``elastic=True`` a round outlives dead peers as
:class:`~gossamer.communicators.elastic.ElasticRound` does: every message between two survivors
is delivered in the round of the death, so the public copies on both ends of every
survivor-to-survivor edge stay equal, and the combine uses the weights of the topology
(or step) without the dead ranks; the dead ranks' copies are no longer read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from gossamer import transport
from gossamer.communicators.base import Deferred, Pending, PostedState, check_topology
from gossamer.communicators.compressed import RankStreams, codec_id, typed_codec
from gossamer.communicators.elastic import ElasticRound
from gossamer.communicators.neighbor import Scheduled
from gossamer.compression import Compressor, Payload, compression_quality, get_compressor
from gossamer.fusion import Bucket
from gossamer.ops import get_topology
from gossamer.topology import Step, Topology

__all__ = ["ChocoGossip", "choco_gamma", "default_gamma"]

_OP = "compressed_gossip"


def default_gamma(compressor: Compressor) -> float:
    r"""The consensus step size :math:`\gamma` used when none is given.

    1.0 for casts (``none``, ``fp16``, ``bf16``: CHOCO is then plain gossip); 0.8 for
    ``uint8`` and the unbiased quantizers (with enough levels for the bucket: one that is no
    contraction is refused, see :func:`contraction_quality`); 1.5 times the kept
    fraction for sparsifiers (``topk:0.1`` -> 0.15), which send only that share of the
    difference each round; 0.05 for ``sign``. Measured on average consensus over the
    exponential graph of 4 ranks (one process, 400 rounds): ``topk:0.1`` reaches 1e-13 of
    its start with 0.1-0.2 and diverges from 0.4; ``uint8`` reaches 1e-10 with any value in
    [0.1, 1]; ``sign`` stalls near 4e-2 at every value (it is too coarse for exact consensus).
    Koloskova et al. tune :math:`\gamma` per compressor and graph; so should users: in
    CHOCO-SGD training the steps that work are larger than these consensus steps
    (``topk:0.01`` and ``stc:0.01`` on the digits: within 1 point of uncompressed gossip
    with 0.1, 1.4 points behind with the default 0.015; docs/compression.md).
    ``gamma="auto"`` (:func:`choco_gamma`) is their theorem's step: it never diverges for a
    contraction, but is 2.4 (``sign``) to 21 (``uint8``) times smaller than these values.
    """
    kind = compressor.name.split(":")[0]
    if kind in ("none", "fp16", "bf16"):
        return 1.0
    if kind in ("uint8", "qsgd", "natural", "natural_dithering"):
        return 0.8
    ratio = getattr(compressor, "ratio", None)
    if ratio is not None:
        return min(1.0, 1.5 * float(ratio))
    return 0.05


def contraction_quality(compressor: Compressor, numel: int, what: str) -> float:
    r"""``compressor``'s :math:`\delta` on tensors of ``numel`` elements, if it is > 0.

    CHOCO's public copies take the compressed differences as they are, so a compressor
    that is no contraction (:math:`\delta \le 0`: an unbiased quantizer whose variance
    exceeds the signal, e.g. ``qsgd:4`` on more than a few elements) makes them diverge,
    whatever :math:`\gamma`. The same on every rank (a fixed probe).

    Raises:
        ValueError: :math:`\delta \le 0`, naming ``what`` (the bucket) and the compressor.
    """
    delta = compression_quality(compressor, max(numel, 1))
    if delta <= 0:
        raise ValueError(
            f"compression={compressor.name!r} is not a contraction on {what} of {numel} "
            f"elements (relative error {math.sqrt(1 - delta):.2f} on normal data): CHOCO's "
            "public copies would diverge; use one that loses less (uint8, natural, topk, "
            "more levels)"
        )
    return delta


def choco_gamma(delta: float, topology: Topology) -> float:
    r"""The consensus step of Koloskova et al. (ICML 2019), Theorem 2, for quality ``delta``.

    .. math:: \gamma^* = \frac{\rho^2 \delta}{16 \rho + \rho^2 + 4 \beta^2
        + 2 \rho \beta^2 - 8 \rho \delta}

    with :math:`\rho = 1 - \|W - \tfrac1n 11^\top\|_2` the spectral gap of the weight
    matrix (``1 - |lambda_2|`` for a symmetric or circulant ``W``), :math:`\beta = \|I -
    W\|_2` and :math:`\delta` the compressor's quality
    (:func:`~gossamer.compression.compression_quality`). With it CHOCO-gossip converges
    linearly for every :math:`\delta`-contraction, at the rate
    :math:`1 - \rho^2 \delta / 82` per round. The bound is conservative: on the
    exponential graph of 4 ranks (:math:`\rho = 2/3`, :math:`\beta = \sqrt{10}/3`) it
    gives 0.0021 for ``topk:0.01``, where 0.015 converges 10 times faster and 0.05
    diverges, and 0.038 for ``uint8``, where 0.8 works (docs/compression.md).

    Raises:
        TypeError: ``topology`` is not a :class:`~gossamer.topology.Topology`.
        ValueError: ``delta`` is not in (0, 1] (not a contraction), or the graph is
            disconnected (:math:`\rho = 0`).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a Topology; got {type(topology).__name__}")
    if isinstance(delta, bool) or not isinstance(delta, int | float) or not 0 < delta <= 1:
        raise ValueError(
            f"delta must be in (0, 1] (a contraction; give gamma explicitly otherwise); "
            f"got {delta!r}"
        )
    w = np.asarray(topology.weights, dtype=np.float64)
    n = len(w)
    rho = 1.0 - float(np.linalg.norm(w - np.full((n, n), 1.0 / n), 2)) if n > 1 else 1.0
    beta = float(np.linalg.norm(np.eye(n) - w, 2))
    if rho <= 1e-12:
        raise ValueError(f"topology {topology.name!r} has no spectral gap: CHOCO cannot converge")
    return rho**2 * delta / (16 * rho + rho**2 + 4 * beta**2 + 2 * rho * beta**2 - 8 * rho * delta)


class ChocoGossip(RankStreams, Scheduled):
    r"""Each round: CHOCO-gossip with in-neighbours, sending compressed differences.

    A stochastic compressor draws from this rank's own stream
    (:func:`~gossamer.compression.for_rank`: independent rounding noise per rank for QSGD
    and natural compression); its position is in :meth:`state_dict`.

    Args:
        compression (str | Compressor): the compressor (``"uint8"``, ``"topk:0.1"``, ...).
        gamma (float | "auto", optional): the consensus step :math:`\gamma` in (0, 1];
            default: :func:`default_gamma` of the compressor. ``"auto"``: Koloskova et al.'s
            :func:`choco_gamma` for the static graph and the compressor's
            :func:`~gossamer.compression.compression_quality` on the bucket's size, computed
            per bucket at its first round (identical on every rank); safe but slow, see
            :func:`choco_gamma`. Not for dynamic schedules.
        topology (Topology, optional): static graph (default: the default topology).
        schedule (Iterator[Step], optional): a dynamic topology (per-edge copies).
        global_average_every (int, optional): every K-th round is a full-precision global
            average.
        elastic (bool): survive dead peers (see the module's text); needs a compressor whose
            payload size depends only on the tensor's (all but ``stc``).
    """

    name = "choco"

    def __init__(
        self,
        compression: str | Compressor = "uint8",
        *,
        gamma: float | None = None,
        topology: Topology | None = None,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
        elastic: bool = False,
    ) -> None:
        super().__init__(schedule=schedule, global_average_every=global_average_every)
        self.compressor = get_compressor(compression)
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool; got {elastic!r}")
        if elastic and not self.compressor.exact_nbytes:
            raise ValueError(
                f"elastic=True needs a compressor with fixed-size payloads; got compression="
                f"{self.compressor.name!r}"
            )
        self.elastic = elastic
        if gamma is None:
            gamma = default_gamma(self.compressor)
        auto = gamma == "auto"
        if not auto and (
            isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1
        ):
            raise ValueError(f"gamma must be a number in (0, 1] or 'auto'; got {gamma!r}")
        check_topology(topology)
        if topology is not None and schedule is not None:
            raise ValueError("give topology or schedule, not both")
        if auto and schedule is not None:
            raise ValueError("gamma='auto' needs a static topology, not a schedule")
        self.gamma: float | str = "auto" if auto else float(gamma)
        self._gammas: dict[int, float] = {}  # bucket index -> gamma, for gamma="auto"
        self._deltas: dict[int, float] = {}  # bucket index -> the compressor's quality
        self.topology = topology
        self.codec = codec_id(self.compressor)
        # bucket index -> {("self",) | ("out", d) | ("in", s): public copy}
        self.copies: dict[int, dict[tuple, torch.Tensor]] = {}
        self._use_rank_streams()
        self._posted = PostedState()

    def _copy(self, index: int, key: tuple, like: torch.Tensor) -> torch.Tensor:
        # Every copy starts at zero on both ends of its edge, so they agree from round one.
        copies = self.copies.setdefault(index, {})
        if key not in copies:
            copies[key] = torch.zeros_like(like)
        elif copies[key].shape != like.shape:  # loaded from a state of another model
            raise ValueError(
                f"ChocoGossip bucket {index}: the public copy {key} holds "
                f"{copies[key].numel()} elements, the bucket {like.numel()} (was the "
                "state_dict saved for another model or bucket size?)"
            )
        return copies[key]

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        self._begin(flat)
        if self.elastic:
            return _ElasticChoco(self, index, self.topology, self.step, self.rounds).start(flat)
        step = self.step
        if step is None:
            graph = get_topology() if self.topology is None else self.topology
            me = transport.group_rank(None)
            _, weights = graph.recv_weights(me)
            plan = (list(graph.out_neighbors(me)), dict(weights), False)
        else:
            plan = (list(step.send_ranks), dict(step.src_weights), True)
        delta = self._delta(index, flat.numel())
        if self.gamma == "auto" and index not in self._gammas:
            graph = get_topology() if self.topology is None else self.topology
            self._gammas[index] = choco_gamma(delta, graph)
        if self.compressor.exact_nbytes and transport.can_post(flat):
            return self._post(flat, index, *plan)
        x = flat.detach().clone()
        return transport.submit(self.name, lambda: self._round(x, index, *plan))

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """Refuse, when the optimizer is built, a compressor that is no contraction."""
        for index, bucket in enumerate(buckets):
            self._delta(index, bucket.flat.numel())

    def _delta(self, index: int, numel: int) -> float:
        if index not in self._deltas:
            # probed with the compressor as given (not this rank's seed): the same everywhere
            given = get_compressor(self._given_name())
            self._deltas[index] = contraction_quality(given, numel, f"bucket {index}")
        return self._deltas[index]

    def bucket_gamma(self, index: int = 0) -> float:
        """The consensus step used for bucket ``index`` (``"auto"``: once it has run)."""
        return self._gammas[index] if self.gamma == "auto" else float(self.gamma)

    def _encode(
        self,
        flat: torch.Tensor,
        index: int,
        dsts: list[int],
        edged: bool,
        scratch: torch.Tensor | None = None,
    ) -> tuple[list[tuple], dict[int, torch.Tensor]]:
        """Compress the differences to the public copies and update them; what to send.

        The differences are formed in ``scratch`` where given (default: a new tensor).
        """
        mine = [("out", d) for d in dsts] if edged else [("self",)]
        if len(mine) > 1:  # a payload may be a view of its input ("none"): one each
            scratch = None
        sends: dict[int, torch.Tensor] = {}
        for key in mine:
            public = self._copy(index, key, flat)
            diff = torch.sub(flat, public, out=scratch)
            payload = self.compressor.compress_add_(diff, public)
            for d in dsts if not edged else [key[1]]:
                sends[d] = payload.buffer
        return mine, sends

    def _combine(
        self,
        flat: torch.Tensor,
        index: int,
        mine: list[tuple],
        received: dict[int, torch.Tensor],
        weights: dict[int, float],
        out: torch.Tensor | None = None,
        in_place: bool = False,
    ) -> torch.Tensor:
        """Update the in-neighbours' copies with what arrived; the new value, in ``out``.

        ``out`` (default: a new tensor) must not overlap ``flat`` or the copies; with
        ``in_place`` it is only the scratch and the new value is written into ``flat``.
        """
        replicas = []
        for src in weights:
            replica = self._copy(index, ("in", src), flat)
            payload = Payload(received[src].contiguous(), flat.shape, flat.dtype)
            replicas.append(self.compressor.decompress_add_(payload, replica))
        copies = [self._copy(index, key, flat) for key in mine]
        # No copies: every destination of the step is dead (elastic), none was sent.
        own = (copies[0] if len(copies) == 1 else sum(copies) / len(copies)) if copies else flat
        pull = torch.empty_like(flat) if out is None else out
        gamma, ws = self.bucket_gamma(index), list(weights.values())
        into = flat if in_place else pull
        if len(ws) == 1:  # one-peer: x + gamma w (h_j - h_i), two passes
            torch.sub(replicas[0], own, out=pull)
            return torch.add(flat, pull, alpha=gamma * ws[0], out=into)
        torch.mul(own, -sum(ws), out=pull)
        for replica, w in zip(replicas, ws, strict=True):
            pull.add_(replica, alpha=w)
        return torch.add(flat, pull, alpha=gamma, out=into)

    def _round(
        self, x: torch.Tensor, index: int, dsts: list[int], weights: dict[int, float], edged: bool
    ) -> torch.Tensor:
        flat = x.reshape(-1)
        mine, sends = self._encode(flat, index, dsts, edged)
        probe = next(iter(sends.values()), self.compressor.compress(flat[:0]).buffer)
        codec = typed_codec(self.codec, flat.dtype)
        received = transport.exchange(
            _OP, probe, sends, sorted(weights), any_first_dim=True, codec=codec
        )
        return self._combine(flat, index, mine, received, weights).view_as(x)

    def _post(
        self,
        flat: torch.Tensor,
        index: int,
        dsts: list[int],
        weights: dict[int, float],
        edged: bool,
    ) -> Pending:
        """The round posted from the caller's thread (fixed-size payloads, float on gloo).

        Compression runs here; the exchange is :func:`gossamer.transport.post_exchange`,
        whose first round per bucket checks the payload layout (and the codec) across ranks.
        The new value is written into a buffer kept for the bucket, valid until its next
        round (as :class:`~gossamer.communicators.NeighborAllreduce`'s), or with
        ``in_place`` into ``flat`` (the buffer then only holds the differences).
        """
        out = self._posted.result(index, flat)  # holds the differences until the combine
        mine, sends = self._encode(flat, index, dsts, edged, out)
        nbytes = self.compressor.payload_nbytes(flat.numel(), flat.dtype)
        receives = {
            src: self._posted.buffer(index, slot, nbytes, torch.uint8)
            for slot, src in enumerate(sorted(weights))
        }
        probe = torch.empty(nbytes, dtype=torch.uint8)
        check = self._posted.needs_check(index, nbytes)
        codec = typed_codec(self.codec, flat.dtype)
        exchange = transport.post_exchange(
            _OP, probe, sends, receives, key=index, check=check, codec=codec
        )
        in_place = self._in_place
        return Deferred(
            lambda: self._combine(flat, index, mine, exchange.wait(), weights, out, in_place)
        )

    def state_dict(self) -> dict:
        """Rounds, schedule position, the compressor's state and every public copy."""
        copies = {i: {k: t.clone() for k, t in c.items()} for i, c in self.copies.items()}
        return {**super().state_dict(), **self._compression_state(), "copies": copies}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` was saved with another compressor.
        """
        super().load_state_dict(state)
        self._load_compression_state(state)
        self.copies = {
            int(i): {tuple(k): t.clone() for k, t in c.items()}
            for i, c in state.get("copies", {}).items()
        }


class _ElasticChoco(ElasticRound):
    """A CHOCO round that completes with the survivors (see :class:`ElasticRound`)."""

    op = _OP

    def __init__(
        self,
        choco: ChocoGossip,
        index: int,
        topology: Topology | None,
        step: Step | None,
        round: int,
    ) -> None:
        super().__init__(topology, step, round)
        self.choco, self.index = choco, index
        self.codec = choco.codec
        self.mine: list[tuple] = []

    def encode(
        self, x: torch.Tensor, dsts: dict[int, float]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Compress the differences to the live destinations' copies; the payload layout."""
        flat = x.reshape(-1)
        self.mine, sends = self.choco._encode(flat, self.index, list(dsts), self.step is not None)
        nbytes = self.choco.compressor.payload_nbytes(flat.numel(), flat.dtype)
        return torch.empty(nbytes, dtype=torch.uint8), sends

    def combine(
        self,
        x: torch.Tensor,
        self_weight: float,
        received: dict[int, torch.Tensor],
        weights: dict[int, float],
    ) -> torch.Tensor:
        """CHOCO's combine over the survivors' weights."""
        flat = x.reshape(-1)
        return self.choco._combine(flat, self.index, self.mine, received, weights).view_as(x)
