"""Neighbour averaging patterns: over a static graph, a dynamic schedule, or machines."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import torch

from gossamer import ops
from gossamer.communicators.base import Communicator, Pending, check_topology
from gossamer.topology import Step, Topology

__all__ = ["HierarchicalNeighborAllreduce", "NeighborAllreduce"]


class Scheduled(Communicator):
    """A pattern whose peers come from a topology or, per round, from a dynamic schedule.

    The schedule position (how many steps were taken) is part of :meth:`state_dict`; loading
    it advances a fresh schedule to the same place.
    """

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

    def _advance(self) -> None:
        if self.schedule is not None:
            self.step = next(self.schedule)
            self.schedule_steps += 1

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
                self.step = next(self.schedule)
                self.schedule_steps += 1


class NeighborAllreduce(Scheduled):
    r"""Each round: :math:`x_i \leftarrow w_{ii} x_i + \sum_j w_{ji} x_j` over in-neighbours.

    Args:
        topology (Topology, optional): static graph (default: the group's default topology).
        schedule (Iterator[Step], optional): a dynamic topology; each round takes the next
            step's peers and weights (e.g. ``one_peer_exponential(g, rank)``).
        global_average_every (int, optional): every K-th round is a global average.

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
    ) -> None:
        super().__init__(schedule=schedule, global_average_every=global_average_every)
        check_topology(topology)
        if topology is not None and schedule is not None:
            raise ValueError("give topology or schedule, not both")
        self.topology = topology
        self.src_weights: Mapping[int, float] | None = None
        self.dst_weights: Mapping[int, float] | Sequence[int] | None = None
        self.check_topology = False

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        explicit = (self.self_weight, self.src_weights, self.dst_weights)
        if any(w is not None for w in explicit):
            return ops.neighbor_allreduce(
                flat,
                self_weight=self.self_weight,
                src_weights=self.src_weights,
                dst_weights=self.dst_weights,
                check_topology=bool(self.check_topology) and self.dst_weights is not None,
                async_op=True,
            )
        if self.step is None:
            return ops.neighbor_allreduce(flat, topology=self.topology, async_op=True)
        return ops.neighbor_allreduce(
            flat,
            self_weight=self.step.self_weight,
            src_weights=self.step.src_weights,
            dst_weights=self.step.dst_weights,
            async_op=True,
        )


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
