r"""Machine-level operations: ranks on one machine act as one node of a machine graph.

``hierarchical_neighbor_allreduce`` sums inside each machine, lets the first rank of every
machine (its *leader*) exchange that sum with the leaders of the neighbour machines, and
shares the combined result inside the machine, so only one message per machine pair crosses
the network. ``local_allreduce`` reduces inside the machine only.

Failures travel the same way: the machine's ranks check their calls with one header
allgather (a rank that rejected its arguments takes part in it), the leader tells the other
leaders with a ``"rejected"`` header, and the result's broadcast ends with a status through
which a leader passes its own failure to its machine, so no rank waits for the deadline.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from gossamer import context, transport
from gossamer.combine import is_uniform, scaled_copies, weighted_sum
from gossamer.errors import (
    CommunicationTimeout,
    GossamerError,
    PeerArgumentError,
    PeerError,
    RankLostError,
    TopologyError,
)
from gossamer.ops.collectives import allreduce, allreduce_, reduce_into
from gossamer.ops.defaults import get_machine_topology
from gossamer.profiling import count_collective, timeline
from gossamer.transport import (
    AVERAGING_DTYPES,
    Handle,
    check_rank_list,
    check_tensor,
    check_weight,
    check_weights,
    staged,
)

__all__ = [
    "hierarchical_neighbor_allreduce",
    "local_allreduce",
    "local_allreduce_",
    "local_group",
]


def local_group() -> dist.ProcessGroup:
    """The process group of the ranks on this machine (collective on first use).

    The first call must be made by every rank, and not while operations are pending.
    """
    return context.runtime().component("ops.local_group", _new_local_group)


def _new_local_group() -> dist.ProcessGroup:
    layout = context.layout()
    machines = [list(layout.ranks_on(m)) for m in range(layout.machine_size)]
    # new_subgroups_by_enumeration is collective: every rank creates every group.
    mine, _ = dist.new_subgroups_by_enumeration(
        machines, backend="gloo", timeout=timedelta(seconds=context.timeout())
    )
    return mine


def local_allreduce(
    tensor: torch.Tensor, *, average: bool = True, async_op: bool = False
) -> torch.Tensor | Handle:
    """:func:`~gossamer.ops.collectives.allreduce` over the ranks of this machine only.

    With ``average`` the sum is divided by ``local_size()``. Out of place.
    """
    return allreduce(tensor, average=average, group=_queued_local_group(), async_op=async_op)


def local_allreduce_(
    tensor: torch.Tensor, *, average: bool = True, async_op: bool = False
) -> torch.Tensor | Handle:
    """In-place :func:`local_allreduce`: writes the result into ``tensor`` and returns it."""
    return allreduce_(tensor, average=average, group=_queued_local_group(), async_op=async_op)


def _queued_local_group() -> dist.ProcessGroup:
    group = context.runtime().find("ops.local_group")
    # Creating the group is collective: queue it behind pending operations. The allreduce
    # checks the arguments, so a rank that rejects them still takes part (the other ranks
    # of its machine raise PeerArgumentError naming it).
    return group if group is not None else transport.run("local_group", local_group, False)


def _leader(machine: int) -> int:
    return context.layout().ranks_on(machine)[0]


@staged(over_gloo=True)
def hierarchical_neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_machine_weights: Mapping[int, float] | None = None,
    dst_machine_weights: Mapping[int, float] | Sequence[int] | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Neighbour averaging between machines.

    With :math:`S_m = \sum_{r \in m} x_r` the sum over the ranks of machine m:

    .. math:: y_r = \frac{1}{L}\Big(w_{mm} S_m + \sum_{k \in \text{src}} w_{km}\, S_k\Big)
        \quad\text{for every rank } r \text{ on machine } m,

    with :math:`L` = ``local_size()``. With no weights the machine topology
    (:func:`~gossamer.ops.defaults.set_machine_topology`) gives them; uniform ones compute
    :math:`(S_m + \sum_k S_k) / (L (k+1))`. Dynamic use passes all three of
    ``self_weight``, ``src_machine_weights`` and ``dst_machine_weights`` (machine ranks;
    the sender scales its sum by ``dst_machine_weights[k]``), with no topology needed.
    Every rank of a machine gets the same result; the input is not modified.

    Raises:
        TopologyError: ranks are not spread evenly over machines, or no machine topology is
            set and no weights are given.
        ValueError: weights given partly, keys that are not machine neighbours or machines.
        PeerArgumentError: a rank of this machine, or of a machine this one exchanges with,
            rejected its arguments (each machine's leader passes it on to its ranks).
        PeerError: the ranks of this machine called different shapes or dtypes, or the
            leader's exchange failed (its ranks raise the leader's error).
    """
    op = "hierarchical_neighbor_allreduce"
    try:
        sw, weights, dsts = _plan(op, tensor, self_weight, src_machine_weights, dst_machine_weights)
        transport.check_flag(async_op, "async_op", op)
    except (TypeError, ValueError) as err:
        _reject(op, err, tensor, src_machine_weights, dst_machine_weights)
        raise
    layout = context.layout()
    me = layout.machine_rank
    sources = sorted(weights)
    uniform = is_uniform(sw, weights, sources)
    leaders = ([_leader(m) for m in dsts], [_leader(m) for m in sources])

    def body() -> torch.Tensor:
        local = local_group()
        x = tensor.contiguous()
        leader = _leader(me)
        try:  # the machine's ranks made the same call (or one rejected its arguments)
            transport.check_same_call(op, x, local)
        except PeerArgumentError as err:
            if context.rank() == leader:  # the other machines' leaders learn it from this one
                reason = str(err).removeprefix(f"{op}: ")
                transport.exchange_rejected(op, reason, *leaders, None, x.device, err.rank)
            raise
        # One buffer: the machine sum, then the result, then a status that the leader
        # broadcasts with it (its failure, which the machine's other ranks raise too).
        buf = torch.empty(x.nbytes + _STATUS_BYTES, dtype=torch.uint8, device=x.device)
        buf[x.nbytes :] = 0
        machine_sum = transport.from_bytes(buf[: x.nbytes], x.dtype, x.shape)
        machine_sum.copy_(x)
        # A half-precision machine sum can overflow where the average fits: such machines
        # exchange their average (computed in float32) instead, as if of one rank each.
        halves = x.dtype in (torch.float16, torch.bfloat16)
        reduce_into(machine_sum, halves, local)
        failure: GossamerError | None = None
        if context.rank() == leader:
            try:
                per = 1 if halves else layout.local_size
                _combine_machines(op, machine_sum, sw, weights, dsts, uniform, per)
            except GossamerError as err:
                failure = err
                buf[x.nbytes :] = _status(err)
        work = dist.broadcast(buf, leader, group=local, async_op=True)
        transport.wait_works(op, [(leader, work)])
        _count_broadcast(op, buf, leader, local)
        if failure is not None:
            _forward(op, failure, leader, local)
            raise failure
        if buf[x.nbytes :].any():
            raise _forwarded(op, buf[x.nbytes :], leader, local)
        return machine_sum

    return transport.run(op, body, async_op)


def _plan(
    op: str,
    tensor: object,
    self_weight: object,
    src_machine_weights: object,
    dst_machine_weights: object,
) -> tuple[float, dict[int, float], dict[int, float]]:
    """Check the arguments: ``(self weight, weights per source machine, dst weights)``."""
    check_tensor(tensor, AVERAGING_DTYPES, op)
    layout = context.layout()
    if not layout.homogeneous:
        raise TopologyError(
            f"{op} needs the same number of ranks on every machine, numbered contiguously; "
            f"machines of the ranks: {list(layout.machine_of)}"
        )
    machines, me = layout.machine_size, layout.machine_rank
    given = [w is not None for w in (self_weight, src_machine_weights, dst_machine_weights)]
    if any(given) and not all(given):
        raise ValueError(
            f"{op}: self_weight, src_machine_weights and dst_machine_weights must be given together"
        )
    if all(given):
        sw = check_weight(self_weight, "self_weight")
        weights = check_weights(
            src_machine_weights, "src_machine_weights", machines, me, unit="machine"
        )
        if isinstance(dst_machine_weights, Mapping):
            dsts = check_weights(
                dst_machine_weights, "dst_machine_weights", machines, me, unit="machine"
            )
        else:
            ranks = check_rank_list(
                dst_machine_weights, "dst_machine_weights", machines, me, "machine"
            )
            dsts = dict.fromkeys(ranks, 1.0)
        return sw, weights, dsts
    graph = get_machine_topology()
    if graph is None:
        raise TopologyError(
            f"{op}: no machine topology is set; call set_machine_topology() or pass "
            "self_weight, src_machine_weights and dst_machine_weights"
        )
    sw, weights = graph.recv_weights(me)
    return sw, dict(weights), dict.fromkeys(graph.out_neighbors(me), 1.0)


def _combine_machines(
    op: str,
    machine_sum: torch.Tensor,
    sw: float,
    weights: Mapping[int, float],
    dsts: Mapping[int, float],
    uniform: bool,
    local_size: int,
) -> None:
    """The leader's part: exchange machine sums with the leaders, combine into machine_sum."""
    sources = sorted(weights)
    received = transport.exchange(
        op,
        machine_sum,
        {_leader(m): t for m, t in scaled_copies(machine_sum, dsts).items()},
        [_leader(m) for m in sources],
        None,
    )
    by_machine = {m: received[_leader(m)] for m in sources}
    with timeline.record(None, "combining"):
        if uniform and local_size == 1:  # averages (half types), or one rank per machine
            out, divisor = weighted_sum(machine_sum, None, by_machine, None, out=machine_sum), 1
        elif uniform:  # one division, as BlueFog: (S_m + sum_k S_k) / (L (k + 1))
            out = weighted_sum(machine_sum, 1.0, by_machine, dict.fromkeys(sources, 1.0))
            divisor = local_size * (len(sources) + 1)
        else:
            out, divisor = weighted_sum(machine_sum, sw, by_machine, weights), local_size
        torch.div(out, divisor, out=machine_sum)


# The leader's status after the result: 0, or the length of a JSON record of its failure,
# which follows in a second broadcast (only then).
_STATUS_BYTES = 8
_KINDS = {
    cls.__name__: cls for cls in (PeerArgumentError, RankLostError, CommunicationTimeout, PeerError)
}


def _status(err: GossamerError) -> torch.Tensor:
    size = len(_record(err))
    return torch.tensor(list(size.to_bytes(_STATUS_BYTES, "little")), dtype=torch.uint8)


def _record(err: GossamerError) -> bytes:
    kind = type(err).__name__ if type(err).__name__ in _KINDS else "PeerError"
    ranks = getattr(err, "ranks", [])
    return json.dumps({"kind": kind, "message": str(err), "ranks": ranks}).encode()


def _count_broadcast(op: str, data: torch.Tensor, leader: int, local: dist.ProcessGroup) -> None:
    """Count a machine-local broadcast from ``leader`` (a global rank)."""
    root = dist.get_group_rank(local, leader)
    size, me = dist.get_world_size(local), dist.get_rank(local)
    count_collective(op, "broadcast", data.nbytes, size, me, root)


def _forward(op: str, err: GossamerError, leader: int, local: dist.ProcessGroup) -> None:
    """The leader sends its failure's record to the machine's other ranks."""
    record = _record(err)
    data = torch.frombuffer(bytearray(record), dtype=torch.uint8)
    work = dist.broadcast(data, leader, group=local, async_op=True)
    transport.wait_works(op, [(leader, work)])
    _count_broadcast(op, data, leader, local)


def _forwarded(
    op: str, status: torch.Tensor, leader: int, local: dist.ProcessGroup
) -> GossamerError:
    """The leader's failure, received by another rank of the machine."""
    size = int.from_bytes(bytes(status.cpu().tolist()), "little")
    data = torch.empty(size, dtype=torch.uint8)
    work = dist.broadcast(data, leader, group=local, async_op=True)
    transport.wait_works(op, [(leader, work)])
    _count_broadcast(op, data, leader, local)
    record = json.loads(bytes(data.tolist()).decode())
    cls = _KINDS[record["kind"]]
    if cls in (PeerArgumentError, RankLostError):
        return cls(record["message"], record["ranks"])
    return cls(record["message"])


def _reject(op: str, error: Exception, tensor: object, srcs: object, dsts: object) -> None:
    """Queue this rank's part of a call it rejected: the machine's check, then the leaders'."""
    layout = context.layout()
    if not layout.homogeneous:
        return  # every rank rejects this one alike: nobody waits
    machines, me = layout.machine_size, layout.machine_rank
    device = tensor.device if isinstance(tensor, torch.Tensor) else None
    peers: tuple[list[int], list[int]] | None = None
    try:  # dynamic when destinations are given (as neighbor_allreduce), else the topology
        if dsts is not None:
            src_list = list(srcs) if isinstance(srcs, Mapping) else srcs
            dst_list = list(dsts) if isinstance(dsts, Mapping) else dsts
            peers = (
                check_rank_list(src_list, "", machines, me),
                check_rank_list(dst_list, "", machines, me),
            )
        elif get_machine_topology() is not None:
            graph = get_machine_topology()
            peers = (list(graph.in_neighbors(me)), list(graph.out_neighbors(me)))
    except (TypeError, ValueError):
        peers = None  # the machines it names are unknown: the other leaders time out

    def take_part(reason: str) -> None:
        transport.check_same_call(op, None, local_group(), rejection=reason)
        if context.rank() == _leader(me) and peers is not None:
            sources, destinations = ([_leader(m) for m in p] for p in peers)
            transport.exchange_rejected(op, reason, destinations, sources, None, device)

    transport.reject(op, error, None, take_part)
