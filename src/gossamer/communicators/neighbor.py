"""Neighbour averaging patterns: over a static graph, a dynamic schedule, or machines.

With ``elastic=True``, :class:`NeighborAllreduce` outlives its peers: see
:class:`~gossamer.communicators.elastic.ElasticRound` and docs/fault-tolerance.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from gossamer import context, ops, transport
from gossamer.combine import is_uniform, scaled_copies, weighted_sum
from gossamer.communicators.base import (
    Communicator,
    Deferred,
    Pending,
    PostedState,
    check_topology,
)
from gossamer.communicators.elastic import ElasticRound
from gossamer.communicators.moshpit import elastic_global_average
from gossamer.errors import TopologyError
from gossamer.fusion import Bucket
from gossamer.topology import Step, Topology

__all__ = ["HierarchicalNeighborAllreduce", "NeighborAllreduce"]


class Scheduled(Communicator):
    """A pattern whose peers come from a topology or, per round, from a dynamic schedule.

    The schedule position (how many steps were taken) is part of :meth:`state_dict`; loading
    it advances a fresh schedule to the same place.
    """

    #: patterns that outlive dead peers set this from their ``elastic`` argument
    elastic = False

    def __init__(
        self,
        *,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
    ) -> None:
        super().__init__(global_average_every=global_average_every)
        if schedule is not None and not hasattr(schedule, "__next__"):
            raise TypeError(f"schedule must be an iterator of topology.Step; got {schedule!r}")
        self.schedule = schedule
        self.step: Step | None = None
        self.schedule_steps = 0
        self.self_weight: float | None = None

    def _global_start(self, flat: torch.Tensor) -> Pending | None:
        """An allreduce; elastic patterns: Moshpit rounds among the live ranks."""
        if self.elastic:
            return elastic_global_average(flat, self.rounds)
        return super()._global_start(flat)

    def _advance(self) -> None:
        if self.schedule is not None:
            self.step = self._next_step()
            self.schedule_steps += 1

    def _next_step(self) -> Step:
        """The schedule's next step; a schedule that ran out or gives another type raises."""
        try:
            step = next(self.schedule)
        except StopIteration:
            # A bare StopIteration would end a caller's loop (map, a generator) silently.
            raise ValueError(
                f"schedule ran out after {self.schedule_steps} steps; pass an endless one "
                "(e.g. itertools.cycle, or a generator of gossamer.topology)"
            ) from None
        if not isinstance(step, Step):
            raise TypeError(
                f"schedule must yield gossamer.topology.Step values; step "
                f"{self.schedule_steps} is {step!r}"
            )
        return step

    def state_dict(self) -> dict:
        """Rounds and schedule position."""
        return {**super().state_dict(), "schedule_steps": self.schedule_steps}

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters; a schedule is advanced to the saved position."""
        super().load_state_dict(state)
        target = int(state.get("schedule_steps", 0))
        if self.schedule is not None:
            if self.schedule_steps > target:
                raise ValueError(
                    f"the schedule is already at step {self.schedule_steps}, past the saved "
                    f"position {target}; pass a fresh schedule"
                )
            while self.schedule_steps < target:
                self.step = self._next_step()
                self.schedule_steps += 1


class NeighborAllreduce(Scheduled):
    r"""Each round: :math:`x_i \leftarrow w_{ii} x_i + \sum_j w_{ji} x_j` over in-neighbours.

    A round on a host float tensor returns a buffer kept for its bucket: the bucket's next
    round overwrites it, so consume (or copy) a result before starting the next round on
    the same bucket, as the optimizers do.

    Args:
        topology (Topology, optional): static graph (default: the group's default topology).
        schedule (Iterator[Step], optional): a dynamic topology; each round takes the next
            step's peers and weights (e.g. ``one_peer_exponential(g, rank)``).
        global_average_every (int, optional): every K-th round is a global average.
        elastic (bool): survive dead peers: a round whose peer died completes with the
            survivors (see :class:`ElasticRound`); later rounds use the topology without the
            dead ranks (``Topology.without``) or the step without them (``drop_dead``).

    Attributes:
        self_weight, src_weights, dst_weights: explicit weights for the next rounds (as
            :func:`gossamer.neighbor_allreduce` takes them); None: the topology's or the
            schedule's. ``check_topology``: check that sends match receives on dynamic rounds.
    """

    name = "neighbor_allreduce"

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
        elastic: bool = False,
    ) -> None:
        super().__init__(schedule=schedule, global_average_every=global_average_every)
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool; got {elastic!r}")
        self.elastic = elastic
        check_topology(topology)
        if topology is not None and schedule is not None:
            raise ValueError("give topology or schedule, not both")
        self.topology = topology
        self.src_weights: Mapping[int, float] | None = None
        self.dst_weights: Mapping[int, float] | Sequence[int] | None = None
        self.check_topology = False
        self._posted = PostedState()

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """Check the topology against the world when the optimizer is built.

        Raises:
            TopologyError: ``topology`` is not over ``gossamer.size()`` ranks (otherwise the
                first communication would raise, or never, in a world of one).
        """
        if self.topology is not None and self.topology.size != context.size():
            raise TopologyError(
                f"topology has {self.topology.size} ranks but the world has {context.size()}"
            )

    def check_posted(self, flats: Sequence[torch.Tensor]) -> None:
        """Run now, on every rank together, the check of each bucket's first posted round.

        That check is a call header over every rank, so ranks whose first rounds come at
        different steps (FedHiSyn's groups, one in a ring round while another averages
        globally) would wait on it for each other. Call this where every rank is at the same
        point; ``flats[i]`` is laid out like bucket ``i``.
        """
        for index, flat in enumerate(flats):
            layout = (flat.dtype, flat.numel())
            if transport.can_post(flat) and self._posted.needs_check(index, layout):
                transport.post_exchange(self.name, flat, {}, {}, key=index, check=True).wait()

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        explicit = (self.self_weight, self.src_weights, self.dst_weights)
        if self.elastic:
            if any(w is not None for w in explicit):
                raise ValueError(
                    "elastic=True takes its weights from the topology or the schedule; "
                    "explicit self_weight/src_weights/dst_weights are not re-weighted"
                )
            return ElasticRound(self.topology, self.step, self.rounds).start(flat)
        if any(w is not None for w in explicit):
            return ops.neighbor_allreduce(
                flat,
                self_weight=self.self_weight,
                src_weights=self.src_weights,
                dst_weights=self.dst_weights,
                check_topology=bool(self.check_topology) and self.dst_weights is not None,
                async_op=True,
            )
        if transport.can_post(flat) and not self.check_topology:
            return self._post(flat, index, *self._plan())
        if self.step is None:
            return ops.neighbor_allreduce(flat, topology=self.topology, async_op=True)
        return ops.neighbor_allreduce(
            flat,
            self_weight=self.step.self_weight,
            src_weights=self.step.src_weights,
            dst_weights=self.step.dst_weights,
            async_op=True,
        )

    def _plan(self) -> tuple[float, dict[int, float], list[int], dict[int, float]]:
        """This round's (self weight, receive weights, sources, send scales)."""
        if self.step is not None:
            step = self.step
            return (
                step.self_weight,
                dict(step.src_weights),
                list(step.recv_ranks),
                dict(step.dst_weights),
            )
        graph = ops.get_topology() if self.topology is None else self.topology
        me = context.rank()
        self_weight, weights = graph.recv_weights(me)
        sources = list(graph.in_neighbors(me))
        return self_weight, dict(weights), sources, dict.fromkeys(graph.out_neighbors(me), 1.0)

    def _post(
        self,
        flat: torch.Tensor,
        index: int,
        self_weight: float,
        weights: dict[int, float],
        sources: list[int],
        dsts: dict[int, float],
    ) -> Pending:
        """This round posted from the caller's thread (:func:`gossamer.transport.post_exchange`).

        The combine is :func:`gossamer.neighbor_allreduce`'s: uniform weights sum first,
        then divide. It is written into a buffer kept for the bucket, which its next round
        overwrites (a fresh model-sized tensor per round costs its page faults every time),
        or with ``in_place`` into ``flat`` once the sends of ``flat`` are done.
        """
        receives = {
            s: self._posted.buffer(index, slot, flat.numel(), flat.dtype)
            for slot, s in enumerate(sources)
        }
        check = self._posted.needs_check(index, (flat.dtype, flat.numel()))
        sends = scaled_copies(flat, dsts)
        exchange = transport.post_exchange(self.name, flat, sends, receives, key=index, check=check)
        mix = None if is_uniform(self_weight, weights, sources) else weights
        out = self._result_buffer(self._posted, index, flat)
        return Deferred(lambda: weighted_sum(flat, self_weight, exchange.wait(), mix, out))


class HierarchicalNeighborAllreduce(Scheduled):
    r"""Each round: sum inside each machine, average the sums with the neighbour machines.

    See :func:`gossamer.hierarchical_neighbor_allreduce`. Peers come from the machine
    topology, or per round from ``schedule`` (steps over machine ranks), or from the explicit
    ``self_weight`` / ``src_machine_weights`` / ``dst_machine_weights`` attributes.
    """

    name = "hierarchical_neighbor_allreduce"

    def __init__(
        self,
        *,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
    ) -> None:
        super().__init__(schedule=schedule, global_average_every=global_average_every)
        self.src_machine_weights: Mapping[int, float] | None = None
        self.dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        explicit = (self.self_weight, self.src_machine_weights, self.dst_machine_weights)
        if any(w is not None for w in explicit):
            sw, src, dst = explicit
        elif self.step is not None:
            sw, src, dst = self.step.self_weight, self.step.src_weights, self.step.dst_weights
        else:
            return ops.hierarchical_neighbor_allreduce(flat, async_op=True)
        return ops.hierarchical_neighbor_allreduce(
            flat,
            self_weight=sw,
            src_machine_weights=src,
            dst_machine_weights=dst,
            async_op=True,
        )
