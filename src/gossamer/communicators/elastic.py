"""Rounds that outlive dead peers: neighbour averaging among the survivors.

:class:`ElasticRound` is one round of weighted neighbour averaging that completes when
peers die (the weights of the topology or step without the dead ranks);
:class:`GroupRound` is one round of averaging inside a group of ranks (Moshpit's grid
lines), among its live members.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from gossamer import context, ops, transport
from gossamer.combine import scaled_copies, weighted_sum
from gossamer.communicators.base import Pending
from gossamer.errors import PeerError
from gossamer.topology import Step, Topology, drop_dead

__all__ = ["ElasticRound", "GroupRound"]


# (id of the topology, dead set) -> (the topology, kept alive for its id; the result)
_WITHOUT_CACHE: dict[tuple[int, frozenset[int]], tuple[Topology, Topology]] = {}


def _without(topology: Topology, dead: frozenset[int]) -> Topology:
    """``topology.without(dead)``, computed once per (topology object, dead set)."""
    key = (id(topology), dead)
    found = _WITHOUT_CACHE.get(key)
    if found is None or found[0] is not topology:
        if len(_WITHOUT_CACHE) > 64:
            _WITHOUT_CACHE.clear()
        found = _WITHOUT_CACHE[key] = (topology, topology.without(sorted(dead)))
    return found[1]


class ElasticRound:
    r"""One neighbour-averaging round that completes when peers die.

    The round is planned with the dead set this rank knows when it starts: the topology
    without the dead ranks (``Topology.without``: Metropolis-Hastings on undirected
    doubly stochastic graphs, Sinkhorn on directed ones) or this rank's step without them
    (:func:`~gossamer.topology.drop_dead`). Its header carries this rank's membership epoch.
    Then :func:`~gossamer.transport.exchange_surviving` delivers every survivor's message;

    - a peer whose transfer failed and whose heartbeat stopped is reported dead
      (:meth:`~gossamer.transport.Membership.report`: the survivors agree on a new epoch
      through the store);
    - a header with a newer epoch than this rank's makes it adopt that epoch.

    The combine then uses the weights of the newest dead set known *after* the exchange,
    over the values that arrived. Removing dead ranks keeps every survivor-to-survivor
    edge, so every source of the new weights has delivered: **the failed round is not
    retried nor skipped; it is completed with the survivors' weights**. A rank learns of a
    death in the round where one of its peers is the dead rank, or one round after a peer
    learned of it (through the epoch in that peer's next header). Which weights each rank
    uses in each round is therefore fixed by the graph and the round of the death, not by
    timing; during the rounds the news takes to spread, ranks that have not heard use the
    old weights, which is not doubly stochastic on the survivors for those rounds.
    """

    op = "neighbor_allreduce"
    codec = 0  # the payload codec in the header (0: raw values)

    def __init__(self, topology: Topology | None, step: Step | None, round: int = -1) -> None:
        self.topology = topology
        self.step = step
        self.round = round
        self.membership = transport.get_membership()

    def plan(self, dead: frozenset[int]) -> tuple[float, dict[int, float], list[int], dict]:
        """``(self weight, receive weights, sources, destination scales)`` without ``dead``."""
        if self.step is not None:
            step = drop_dead(self.step, dead) if dead else self.step
            sources = list(step.recv_ranks)
            return step.self_weight, dict(step.src_weights), sources, dict(step.dst_weights)
        graph = self.topology if self.topology is not None else ops.get_topology()
        if dead:
            graph = _without(graph, dead)
        me = context.rank()
        self_weight, weights = graph.recv_weights(me)
        sources = list(graph.in_neighbors(me))
        return self_weight, dict(weights), sources, dict.fromkeys(graph.out_neighbors(me), 1.0)

    def encode(
        self, x: torch.Tensor, dsts: dict[int, float]
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """``(probe, sends)``: what the header describes, and what each destination gets."""
        return x, scaled_copies(x, dsts)

    def combine(
        self,
        x: torch.Tensor,
        self_weight: float,
        received: dict[int, torch.Tensor],
        weights: dict[int, float],
    ) -> torch.Tensor:
        """The new value from what arrived, with the survivors' weights."""
        return weighted_sum(x, self_weight, received, weights)

    def start(self, flat: torch.Tensor) -> Pending:
        """Queue the round on the communication thread; ``wait()`` gives the new value."""
        membership = self.membership
        live = transport.get_liveness()
        if live is not None and live.lost - membership.dead:
            membership.report(live.lost, self.round)  # the heartbeats already showed a death
        dead, epoch = membership.dead, membership.epoch
        _, _, sources, dsts = self.plan(dead)

        def body() -> torch.Tensor:
            x = flat.contiguous()
            probe, sends = self.encode(x, dsts)
            got = transport.exchange_surviving(
                self.op, probe, sends, sources, epoch=epoch, codec=self.codec
            )
            if got.lost:
                membership.report(got.lost, self.round)
            if got.epoch > membership.epoch:
                membership.catch_up(got.epoch)
            self_weight, weights, now_sources, _ = self.plan(membership.dead)
            missing = [s for s in now_sources if s not in got.received]
            if missing:
                raise PeerError(
                    f"{self.op}: rank {context.rank()} has no value from {missing} for the "
                    f"combine at epoch {membership.epoch} (were the survivors disconnected?)"
                )
            received = {s: got.received[s] for s in now_sources}
            return self.combine(x, self_weight, received, weights)

        # No peers for the engine to fail it on: the round deals with dead peers itself
        # (a watchdog failing it while it confirms a death would leave its peers waiting).
        return transport.submit(self.op, body, peers=())


class GroupRound(ElasticRound):
    r"""Average inside ``members`` among the live ones: :math:`x \leftarrow \bar x_A`.

    :math:`\bar x_A = |A|^{-1} \sum_{s \in A} x_s`, where :math:`A` is ``members``
    without the dead ranks (and without ``also_dead``). Every
    live member exchanges with every other, so a member that dies during the round is
    found by all of them in that round, and all re-plan with the same live set: they
    compute the same mean, and the round keeps the sum over the live members.
    """

    op = "group_average"

    def __init__(
        self, members: Sequence[int], also_dead: frozenset[int] = frozenset(), round: int = -1
    ) -> None:
        super().__init__(None, None, round)
        self.members = tuple(members)
        self.also_dead = also_dead

    def plan(self, dead: frozenset[int]) -> tuple[float, dict[int, float], list[int], dict]:
        """Weights :math:`1/|A|` over the live members."""
        me = context.rank()
        alive = [r for r in self.members if r not in dead and r not in self.also_dead]
        share = 1.0 / len(alive)
        peers = [r for r in alive if r != me]
        return share, dict.fromkeys(peers, share), peers, dict.fromkeys(peers, 1.0)
