r"""Machine-level operations: ranks on one machine act as one node of a machine graph.

``hierarchical_neighbor_allreduce`` sums inside each machine, lets the first rank of every
machine (its *leader*) exchange that sum with the leaders of the neighbour machines, and
shares the combined result inside the machine, so only one message per machine pair crosses
the network. ``local_allreduce`` reduces inside the machine only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from gossamer import context, transport
from gossamer.combine import is_uniform, scaled_copies, weighted_sum
from gossamer.errors import TopologyError
from gossamer.ops.collectives import allreduce, reduce_into
from gossamer.ops.defaults import get_machine_topology
from gossamer.profiling import timeline
from gossamer.transport import (
    AVERAGING_DTYPES,
    Handle,
    check_rank_list,
    check_tensor,
    check_weight,
    check_weights,
)

__all__ = ["hierarchical_neighbor_allreduce", "local_allreduce", "local_group"]


def local_group() -> dist.ProcessGroup:
    """The process group of the ranks on this machine (collective on first use).

    The first call must be made by every rank, and not while operations are pending.
    """
    return context.runtime().component("ops.local_group", _new_local_group)


def _new_local_group() -> dist.ProcessGroup:
    layout = context.layout()
    machines = [list(layout.ranks_on(m)) for m in range(layout.machine_size)]
    # new_subgroups_by_enumeration is collective: every rank creates every group.
    mine, _ = dist.new_subgroups_by_enumeration(machines, backend="gloo")
    return mine


def local_allreduce(
    tensor: torch.Tensor, *, average: bool = True, async_op: bool = False
) -> torch.Tensor | Handle:
    """:func:`~gossamer.ops.collectives.allreduce` over the ranks of this machine only.

    With ``average`` the sum is divided by ``local_size()``. Out of place.
    """
    runtime = context.runtime()
    # Creating the group is collective: queue it behind pending operations.
    group = runtime.find("ops.local_group")
    if group is None:
        group = transport.run("local_group", local_group, False)
    return allreduce(tensor, average=average, group=group, async_op=async_op)


def _leader(machine: int) -> int:
    return context.layout().ranks_on(machine)[0]


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
    """
    op = "hierarchical_neighbor_allreduce"
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
        weights = check_weights(src_machine_weights, "src_machine_weights", machines, me)
        if isinstance(dst_machine_weights, Mapping):
            dsts = check_weights(dst_machine_weights, "dst_machine_weights", machines, me)
        else:
            ranks = check_rank_list(dst_machine_weights, "dst_machine_weights", machines, me)
            dsts = dict.fromkeys(ranks, 1.0)
    else:
        graph = get_machine_topology()
        if graph is None:
            raise TopologyError(
                f"{op}: no machine topology is set; call set_machine_topology() or pass "
                "self_weight, src_machine_weights and dst_machine_weights"
            )
        sw, weights = graph.recv_weights(me)
        dsts = dict.fromkeys(graph.out_neighbors(me), 1.0)
    sources = sorted(weights)
    uniform = is_uniform(sw, weights, sources)

    def body() -> torch.Tensor:
        machine_sum = tensor.contiguous().clone()
        reduce_into(machine_sum, False, local_group())
        out = machine_sum
        leader = _leader(me)
        if context.rank() == leader:
            received = transport.exchange(
                op,
                machine_sum,
                {_leader(m): t for m, t in scaled_copies(machine_sum, dsts).items()},
                [_leader(m) for m in sources],
                None,
            )
            by_machine = {m: received[_leader(m)] for m in sources}
            with timeline.record(None, "combining"):
                if uniform:  # one division, as BlueFog: (S_m + sum_k S_k) / (L (k + 1))
                    out = weighted_sum(machine_sum, 1.0, by_machine, dict.fromkeys(sources, 1.0))
                    out.div_(layout.local_size * (len(sources) + 1))
                else:
                    out = weighted_sum(machine_sum, sw, by_machine, weights)
                    out.div_(layout.local_size)
        work = dist.broadcast(transport.as_bytes(out), leader, group=local_group(), async_op=True)
        transport.wait_works(op, [(leader, work)])
        return out

    return transport.run(op, body, async_op)
