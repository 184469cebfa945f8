r"""Neighbour operations: every rank exchanges data only with its neighbours in a graph.

Static mode takes the graph from ``topology=`` or the group's default
(:func:`~gossamer.ops.defaults.set_topology`). Dynamic mode names the peers of this call
explicitly (``src_weights`` / ``dst_weights``, or ``src_ranks`` / ``dst_ranks``); they may
lie outside any topology, and each rank's sends must match its peers' receives.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from gossamer import transport
from gossamer.combine import is_uniform, scaled_copies, weighted_sum
from gossamer.ops.defaults import get_topology
from gossamer.profiling import count_collective, timeline
from gossamer.topology import Topology
from gossamer.transport import (
    AVERAGING_DTYPES,
    DTYPES,
    Handle,
    check_flag,
    check_rank,
    check_rank_list,
    check_tensor,
    check_weight,
    check_weights,
    group_rank,
    group_size,
    staged,
)

__all__ = ["neighbor_allgather", "neighbor_allreduce", "pair_gossip"]


def _combine(
    x: torch.Tensor,
    self_weight: float | None,
    received: Mapping[int, torch.Tensor],
    weights: Mapping[int, float] | None,
) -> torch.Tensor:
    # Row None: the operation being run (neighbor_allreduce, pair_gossip, hierarchical).
    with timeline.record(None, "combining"):
        return weighted_sum(x, self_weight, received, weights)


def _topology_for(topology: Topology | None, group: dist.ProcessGroup | None) -> Topology:
    if topology is None:
        return get_topology(group)
    return transport.check_topology(topology, group, "topology")


def _check_graph(
    op: str,
    sends: Sequence[int],
    sources: Sequence[int],
    group: dist.ProcessGroup | None,
    rejection: str | None = None,
) -> None:
    """Every rank checks, from everyone's send and receive lists, that they match up.

    Each row ends with the length of the rank's rejection reason (0: none), so a rank that
    rejected its arguments (``rejection``) makes every other rank raise instead.
    """
    size, me = group_size(group), group_rank(group)
    mine = torch.zeros(2 * size + 2, dtype=torch.uint8)
    mine[list(sends)] = 1
    mine[[size + s for s in sources]] = 1
    length = len(rejection.encode()) if rejection is not None else 0
    mine[-2:] = torch.tensor([length & 0xFF, length >> 8], dtype=torch.uint8)
    rows = [torch.empty_like(mine) for _ in range(size)]
    transport.wait_works(op, [(-1, dist.all_gather(rows, mine, group=group, async_op=True))])
    count_collective(op, "all_gather", mine.nbytes, size)
    lengths = [int(r[-2]) + (int(r[-1]) << 8) for r in rows]
    if any(lengths):
        texts = transport.gather_reasons(op, lengths, rejection, group)
        if rejection is None:
            refused = {_global(group, r): texts[r] for r, n in enumerate(lengths) if n}
            raise transport.peer_argument_error(op, refused)
        return
    send = torch.stack([r[:size] for r in rows])
    recv = torch.stack([r[size : 2 * size] for r in rows])
    bad = (send != recv.T).nonzero().tolist()
    if bad:
        pairs = ", ".join(
            f"{i}->{j} ({'sent, not received' if send[i, j] else 'received, not sent'})"
            for i, j in bad[:8]
        )
        raise ValueError(
            f"{op}: on rank {me}, sends and receives of the ranks do not match: {pairs}"
        )


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _peer_list(ranks: object, size: int, me: int) -> list[int]:
    """``ranks`` (a mapping's keys or a sequence) if every one is a valid peer, else raise."""
    return check_rank_list(list(ranks) if isinstance(ranks, Mapping) else ranks, "", size, me)


def _reject(
    op: str,
    error: Exception,
    tensor: object,
    group: dist.ProcessGroup | None,
    check_topology: object,
    peers: Callable[[], tuple[list[int], list[int]]],
) -> None:
    """Queue this rank's part of a neighbour call it rejected (see transport.rejection).

    With ``check_topology`` every rank of the group takes part in the graph check, which
    carries the reason; otherwise this rank exchanges with the peers ``peers()`` names: the
    topology's, or explicit peer lists if every entry is valid. When they name none (a bad
    topology or peer list), it takes no part: a guess could leave a message unmatched.
    """
    device = tensor.device if isinstance(tensor, torch.Tensor) else None
    take_part: Callable[[str], None] | None = None
    if check_topology is True:

        def take_part(reason: str) -> None:
            _check_graph(op, [], [], group, rejection=reason)

    else:
        try:
            sources, dsts = peers()
        except (TypeError, ValueError):
            pass  # the arguments name no peers: they time out, as without this
        else:

            def take_part(reason: str) -> None:
                transport.exchange_rejected(op, reason, dsts, sources, group, device)

    transport.reject(op, error, group, take_part)


def _named_peers(
    topology: object, srcs: object, dsts: object, group: dist.ProcessGroup | None, explicit: bool
) -> Callable[[], tuple[list[int], list[int]]]:
    """``(sources, destinations)`` a call's arguments name, computed when asked (or raise)."""

    def peers() -> tuple[list[int], list[int]]:
        size, me = group_size(group), group_rank(group)
        if explicit:
            return _peer_list(srcs, size, me), _peer_list(dsts, size, me)
        graph = _topology_for(topology, group)  # type: ignore[arg-type]
        return list(graph.in_neighbors(me)), list(graph.out_neighbors(me))

    return peers


def _allreduce_plan(
    op: str,
    tensor: object,
    self_weight: object,
    src_weights: object,
    dst_weights: object,
    topology: object,
    group: dist.ProcessGroup | None,
) -> tuple[float, dict[int, float], list[int], dict[int, float]]:
    """Check neighbor_allreduce's arguments: ``(self weight, weights, sources, dsts)``."""
    check_tensor(tensor, AVERAGING_DTYPES, op)
    size, me = group_size(group), group_rank(group)
    if (self_weight is None) != (src_weights is None):
        raise ValueError(f"{op}: self_weight and src_weights must be given together")
    if dst_weights is not None and src_weights is None:
        raise ValueError(f"{op}: dst_weights (dynamic mode) needs self_weight and src_weights")
    if topology is not None:
        # Also in dynamic mode, which does not use it: a wrong one must not pass unnoticed.
        transport.check_topology(topology, group, "topology")
    if dst_weights is not None:
        if topology is not None:  # unused in dynamic mode, but a wrong one is still a bug
            _topology_for(topology, group)  # type: ignore[arg-type]
        sw = check_weight(self_weight, "self_weight")
        weights = check_weights(src_weights, "src_weights", size, me)
        sources = sorted(weights)
        if isinstance(dst_weights, Mapping):
            dsts = check_weights(dst_weights, "dst_weights", size, me)
        else:
            dsts = dict.fromkeys(check_rank_list(dst_weights, "dst_weights", size, me), 1.0)
        return sw, weights, sources, dsts
    graph = _topology_for(topology, group)  # type: ignore[arg-type]
    sources = list(graph.in_neighbors(me))
    dsts = dict.fromkeys(graph.out_neighbors(me), 1.0)
    if src_weights is None:
        sw, weights = graph.recv_weights(me)
    else:
        sw = check_weight(self_weight, "self_weight")
        weights = check_weights(src_weights, "src_weights", size, me, sources, "in-neighbours")
    return sw, dict(weights), sources, dsts


@staged
def neighbor_allreduce(
    tensor: torch.Tensor,
    *,
    self_weight: float | None = None,
    src_weights: Mapping[int, float] | None = None,
    dst_weights: Mapping[int, float] | Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool = False,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Weighted average with the in-neighbours.

    .. math:: y_i = w_{ii} x_i + \sum_{j \in \text{src}} w_{ji}\, m_{j \to i}

    where :math:`m_{j \to i} = x_j`, or :math:`d_{j \to i} x_j` when sender j passes
    ``dst_weights`` (it scales its copy per destination).

    - No weights (static): the topology's weights, ``W[j, i]``. When they are all
      ``1/(indegree+1)`` the result is computed as ``(x_i + sum_j x_j) / (indegree + 1)``.
    - ``self_weight`` and ``src_weights`` (static): receive from every in-neighbour, combine
      those named in ``src_weights`` (matched by rank; keys must be in-neighbours).
    - Plus ``dst_weights`` (dynamic): receive from exactly the ``src_weights`` keys, send to
      the ``dst_weights`` keys (a list means weight 1.0); both may lie outside the topology.

    Out of place: the input is not modified. float16 and bfloat16 are combined in float32.

    Args:
        tensor (torch.Tensor): this rank's value (floating point or complex); same shape on
            every rank.
        self_weight (float, optional): weight of this rank's own value.
        src_weights (Mapping[int, float], optional): receive weight per source rank.
        dst_weights (Mapping[int, float] | Sequence[int], optional): destinations (dynamic).
        topology (Topology, optional): graph for this call; default: the group's.
        check_topology (bool): before sending, check with one allgather that every send has a
            matching receive; a mismatch raises ``ValueError`` on all ranks.
        group (ProcessGroup, optional): ranks taking part (topology ranks are group ranks).
        async_op (bool): return a :class:`Handle` instead of waiting.

    Returns:
        torch.Tensor of the input's shape and dtype (or a Handle).

    Raises:
        TypeError: wrong argument types or dtype.
        ValueError: weights given alone, keys that are not neighbours or ranks, duplicates.
        PeerError: a neighbour passed another shape or dtype, or called another operation.
        CommunicationTimeout: a neighbour did not answer within the deadline.

    Example:
        >>> # ring(3), uniform 1/3 weights; x_i = i
        >>> gossamer.neighbor_allreduce(torch.tensor([float(gossamer.rank())]))
        tensor([1.])  # Rank 0, 1 and 2
    """
    op = "neighbor_allreduce"
    try:
        sw, weights, sources, dsts = _allreduce_plan(
            op, tensor, self_weight, src_weights, dst_weights, topology, group
        )
        check_flag(check_topology, "check_topology", op)
        check_flag(async_op, "async_op", op)
    except (TypeError, ValueError) as err:
        explicit = dst_weights is not None
        peers = _named_peers(topology, src_weights, dst_weights, group, explicit)
        _reject(op, err, tensor, group, check_topology, peers)
        raise
    uniform = is_uniform(sw, weights, sources)

    def body() -> torch.Tensor:
        if check_topology:
            _check_graph(op, list(dsts), sources, group)
        x = tensor.contiguous()
        received = transport.exchange(op, x, scaled_copies(x, dsts), sources, group)
        return _combine(x, sw, received, None if uniform else weights)

    return transport.run(op, body, async_op)


@staged
def neighbor_allgather(
    tensor: torch.Tensor,
    *,
    src_ranks: Sequence[int] | None = None,
    dst_ranks: Sequence[int] | None = None,
    topology: Topology | None = None,
    check_topology: bool = False,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    """Concatenate the in-neighbours' tensors along dimension 0 (not this rank's own).

    Static mode: sources are the topology's in-neighbours (ascending), destinations its
    out-neighbours. Dynamic mode: ``src_ranks`` and ``dst_ranks`` together; the result
    follows the order of ``src_ranks``. First dimensions may differ; any dtype.

    Returns:
        torch.Tensor of shape ``(sum of the sources' first dims, *tensor.shape[1:])``.

    Raises:
        ValueError: only one of ``src_ranks``/``dst_ranks``, bad or repeated ranks, a scalar.
        PeerError: a source sent another dtype or trailing shape.

    Example:
        >>> # ring(3): in-neighbours of rank 1 are 0 and 2
        >>> gossamer.neighbor_allgather(torch.tensor([gossamer.rank()]))
        tensor([0, 2])  # Rank 1
    """
    op = "neighbor_allgather"
    try:
        check_tensor(tensor, DTYPES, op)
        if tensor.dim() == 0:
            raise ValueError(f"{op}: tensor must have at least one dimension; got a scalar")
        size, me = group_size(group), group_rank(group)
        if (src_ranks is None) != (dst_ranks is None):
            raise ValueError(f"{op}: src_ranks and dst_ranks must be given together")
        check_flag(check_topology, "check_topology", op)
        check_flag(async_op, "async_op", op)
        if topology is not None:
            # Also in dynamic mode, which does not use it: a wrong one must not pass unnoticed.
            transport.check_topology(topology, group, "topology")
        if src_ranks is None:
            graph = _topology_for(topology, group)
            sources, dsts = list(graph.in_neighbors(me)), list(graph.out_neighbors(me))
        else:
            if topology is not None:  # unused in dynamic mode, but a wrong one is still a bug
                _topology_for(topology, group)
            sources = check_rank_list(src_ranks, "src_ranks", size, me)
            dsts = check_rank_list(dst_ranks, "dst_ranks", size, me)
        check_flag(check_topology, "check_topology", op)
        check_flag(async_op, "async_op", op)
    except (TypeError, ValueError) as err:
        explicit = src_ranks is not None or dst_ranks is not None
        peers = _named_peers(topology, src_ranks, dst_ranks, group, explicit)
        _reject(op, err, tensor, group, check_topology, peers)
        raise

    def body() -> torch.Tensor:
        if check_topology:
            _check_graph(op, dsts, sources, group)
        x = tensor.contiguous()
        received = transport.exchange(
            op, x, dict.fromkeys(dsts, x), sources, group, any_first_dim=True
        )
        if not sources:
            return x.new_empty((0, *x.shape[1:]))
        return torch.cat([received[s] for s in sources])

    return transport.run(op, body, async_op)


@staged
def pair_gossip(
    tensor: torch.Tensor,
    target: int,
    *,
    self_weight: float | None = None,
    pair_weight: float | None = None,
    group: dist.ProcessGroup | None = None,
    async_op: bool = False,
) -> torch.Tensor | Handle:
    r"""Average with one peer, which must call ``pair_gossip`` with this rank as target.

    Returns :math:`(x + y) / 2`, or ``self_weight * x + pair_weight * y`` when both weights
    are given (``y`` is the peer's tensor). Out of place.
    """
    op = "pair_gossip"
    try:
        check_tensor(tensor, AVERAGING_DTYPES, op)
        size, me = group_size(group), group_rank(group)
        check_rank(target, "target", size)
        if target == me:
            raise ValueError(f"{op}: target must be another rank; got this rank ({me})")
        if (self_weight is None) != (pair_weight is None):
            raise ValueError(f"{op}: self_weight and pair_weight must be given together")
        weights = None
        if pair_weight is not None:
            sw = check_weight(self_weight, "self_weight")
            weights = {target: check_weight(pair_weight, "pair_weight")}
        else:
            sw = None
        check_flag(async_op, "async_op", op)
    except (TypeError, ValueError) as err:
        _reject(op, err, tensor, group, False, _named_peers(None, [target], [target], group, True))
        raise

    def body() -> torch.Tensor:
        x = tensor.contiguous()
        received = transport.exchange(op, x, {target: x}, [target], group)
        return _combine(x, sw, received, weights)

    return transport.run(op, body, async_op)
