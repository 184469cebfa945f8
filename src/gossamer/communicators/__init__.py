"""Communicators: strategy objects, each one communication pattern with its own state.

=================================  =========================================================
class                              one round
=================================  =========================================================
``Allreduce``                      global average over all ranks
``NeighborAllreduce``              weighted average with in-neighbours (static or scheduled)
``HierarchicalNeighborAllreduce``  sum per machine, average with neighbour machines
``WindowPutGossip``                put into neighbours' windows; combine what arrived
``PushSumGossip``                  push shares of (x, p) over windows (directed graphs)
``MoshpitAverage``                 average within the groups of one grid dimension, in turn
``NoCommunication``                nothing (or only the periodic global average)
``CompressedAllreduce``            global average through a compressor (scatter-reduce-gather)
``ChocoGossip``                    compressed neighbour averaging with public copies (CHOCO)
``DifferenceGossip``               compressed differences with neighbour replicas (DCD-PSGD)
``NonlinearGossip``                :math:`x_i` += eps sum_j w_ji phi(x_j - x_i), phi sign-power
``PowerSGDAllreduce``              global average of rank-r factors (torch's PowerSGD hook)
=================================  =========================================================

Optimizers take a communicator object (``communicator=NeighborAllreduce(schedule=...)``);
the strings of :data:`COMMUNICATIONS` are a convenience that :func:`make` maps to classes.
"""

from __future__ import annotations

from collections.abc import Iterator

from gossamer.communicators.base import Communicator, Deferred, Pending, check_topology
from gossamer.communicators.choco import ChocoGossip, choco_gamma, default_gamma
from gossamer.communicators.collective import Allreduce, NoCommunication
from gossamer.communicators.compressed import CompressedAllreduce
from gossamer.communicators.difference import (
    DifferenceGossip,
    difference_round,
    payload_exchange,
)
from gossamer.communicators.moshpit import (
    MoshpitAverage,
    elastic_global_average,
    grid_groups,
    near_cubic_grid,
)
from gossamer.communicators.neighbor import HierarchicalNeighborAllreduce, NeighborAllreduce
from gossamer.communicators.nonlinear import NonlinearGossip, sign_power
from gossamer.communicators.powersgd import PowerSGDAllreduce, parse_powersgd
from gossamer.communicators.window import PushSumGossip, WindowPutGossip
from gossamer.compression import Compressor, get_compressor
from gossamer.topology import Step, Topology

__all__ = [
    "COMMUNICATIONS",
    "COMMUNICATORS",
    "Allreduce",
    "ChocoGossip",
    "Communicator",
    "CompressedAllreduce",
    "Deferred",
    "DifferenceGossip",
    "HierarchicalNeighborAllreduce",
    "MoshpitAverage",
    "NeighborAllreduce",
    "NoCommunication",
    "NonlinearGossip",
    "Pending",
    "PowerSGDAllreduce",
    "PushSumGossip",
    "WindowPutGossip",
    "choco_gamma",
    "default_gamma",
    "difference_round",
    "elastic_global_average",
    "grid_groups",
    "make",
    "near_cubic_grid",
    "payload_exchange",
    "sign_power",
]

#: every pattern by name
COMMUNICATORS: dict[str, type[Communicator]] = {
    cls.name: cls
    for cls in (
        NeighborAllreduce,
        HierarchicalNeighborAllreduce,
        Allreduce,
        NoCommunication,
        WindowPutGossip,
        PushSumGossip,
        CompressedAllreduce,
        ChocoGossip,
        DifferenceGossip,
        MoshpitAverage,
        NonlinearGossip,
        PowerSGDAllreduce,
    )
}
#: the names an optimizer's ``communication=`` accepts
COMMUNICATIONS = (
    "neighbor_allreduce",
    "hierarchical_neighbor_allreduce",
    "allreduce",
    "none",
    "nonlinear_gossip",
    "difference_gossip",
)


def make(
    communication: str = "neighbor_allreduce",
    *,
    topology: Topology | None = None,
    schedule: Iterator[Step] | None = None,
    global_average_every: int | None = None,
    compression: str | Compressor | None = None,
    error_feedback: bool | None = None,
    elastic: bool = False,
) -> Communicator:
    """The communicator that ``communication`` names, built from the optimizer options.

    ``topology`` applies to ``"neighbor_allreduce"`` and ``"nonlinear_gossip"`` (NGO with its
    default ``power`` and ``step_size``; build :class:`NonlinearGossip` for others);
    ``schedule`` to the neighbour patterns.
    ``"difference_gossip"`` is :class:`DifferenceGossip` (DCD-PSGD, Bagua's low-precision
    ring) with ``compression`` (default ``"uint8"``) on ``topology``; it takes no
    ``schedule``, ``global_average_every`` or ``error_feedback``.
    With a ``compression`` other than ``"none"``, neighbour averaging becomes
    :class:`ChocoGossip` and ``allreduce`` :class:`CompressedAllreduce` (``error_feedback``
    applies to the latter; CHOCO's public copies always compensate the error, so it takes
    ``None`` or ``True`` and refuses ``False``).
    ``compression="powersgd"`` or ``"powersgd:<rank>"`` (``"allreduce"`` only) is torch's
    PowerSGD (:class:`PowerSGDAllreduce`, error feedback unless ``error_feedback=False``).

    ``elastic=True`` (neighbour averaging only, plain or CHOCO) makes rounds outlive dead
    peers (:class:`NeighborAllreduce`, :class:`ChocoGossip`).

    Raises:
        ValueError: an unknown name, both ``topology`` and ``schedule``, compression with
            a communication that has no compressed form, ``elastic`` with a pattern
            other than ``"neighbor_allreduce"``, an option ``"difference_gossip"``
            does not take, or ``error_feedback=False`` with CHOCO.
        TypeError: a ``topology``, ``schedule`` or ``error_feedback`` of the wrong type.
    """
    if communication not in COMMUNICATIONS:
        raise ValueError(f"communication must be one of {COMMUNICATIONS}; got {communication!r}")
    check_topology(topology)
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise TypeError(f"error_feedback must be a bool or None; got {error_feedback!r}")
    if schedule is not None and not hasattr(schedule, "__next__"):
        raise TypeError(f"schedule must be an iterator of topology.Step; got {schedule!r}")
    if topology is not None and schedule is not None:
        raise ValueError("give topology or schedule, not both")
    every = {"global_average_every": global_average_every}
    rank = parse_powersgd(compression)
    if rank is not None:
        if communication != "allreduce" or elastic:
            raise ValueError(
                f"compression={compression!r} needs communication='allreduce' without elastic; "
                f"got communication={communication!r}, elastic={elastic!r}"
            )
        feedback = True if error_feedback is None else error_feedback
        return PowerSGDAllreduce(rank, error_feedback=feedback, **every)
    compressor = get_compressor(compression)
    if not isinstance(elastic, bool):
        raise TypeError(f"elastic must be a bool; got {elastic!r}")
    if elastic and communication != "neighbor_allreduce":
        raise ValueError(
            f"elastic=True is built for 'neighbor_allreduce' (plain or CHOCO) only; got "
            f"communication={communication!r} (collective and hierarchical patterns cannot "
            "outlive a rank: they raise RankLostError)"
        )
    if communication == "difference_gossip":
        given = {
            "schedule": schedule,
            "global_average_every": global_average_every,
            "error_feedback": error_feedback,
        }
        clash = [f"{k}={v!r}" for k, v in given.items() if v is not None]
        if clash:
            raise ValueError(
                f"communication='difference_gossip' takes a static topology and a "
                f"compression only; got {', '.join(clash)}"
            )
        return DifferenceGossip("uint8" if compression is None else compressor, topology=topology)
    if error_feedback is not None and compressor.name == "none":
        raise ValueError(f"error_feedback={error_feedback!r} needs a compression; got none")
    if compressor.name != "none":
        if communication == "neighbor_allreduce":
            if error_feedback is False:
                raise ValueError(
                    f"error_feedback=False with compression={compressor.name!r}: compressed "
                    "neighbour averaging is CHOCO-gossip, whose public copies always "
                    "compensate the compression error; leave error_feedback unset"
                )
            return ChocoGossip(
                compressor, topology=topology, schedule=schedule, elastic=elastic, **every
            )
        if communication == "allreduce":
            return CompressedAllreduce(compressor, error_feedback=error_feedback, **every)
        raise ValueError(
            f"compression={compressor.name!r} has no compressed form for communication="
            f"{communication!r}; use 'neighbor_allreduce' (CHOCO) or 'allreduce'"
        )
    if communication == "neighbor_allreduce":
        return NeighborAllreduce(topology, schedule=schedule, elastic=elastic, **every)
    if communication == "nonlinear_gossip":
        return NonlinearGossip(topology, schedule=schedule, **every)
    if communication == "hierarchical_neighbor_allreduce":
        return HierarchicalNeighborAllreduce(schedule=schedule, **every)
    return COMMUNICATORS[communication](**every)
