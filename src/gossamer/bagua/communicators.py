r"""Bagua's communication patterns as gossamer communicators (strategy objects).

================================  ===========================================================
class                             one round on a flat tensor :math:`x`
================================  ===========================================================
``CentralizedAllreduce``          sum or average over all ranks (Bagua's centralized op)
``PeerAverage``                   ``"all"``: global average; ``"shift_one"``: average with
                                  one peer, :math:`(x + x_p)/2`, the peer rotating each round
================================  ===========================================================

Compressed patterns (ByteGrad's scatter-reduce-gather, the low-precision difference ring)
are in :mod:`gossamer.bagua.compressed`. With ``hierarchical=True`` a pattern runs between
machines: the ranks of a machine are averaged first, the machines communicate, and every
rank of a machine gets its machine's result (gossamer's machine layout;
``GOSSAMER_NODES_PER_MACHINE=k`` fakes machines). Each class is a
:class:`gossamer.communicators.Communicator`, so gossamer's optimizers take them too::

    optim.AdaptWithCombine(sgd, model, communicator=PeerAverage("shift_one"))
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from gossamer import context, ops, transport
from gossamer.communicators import Communicator, Pending
from gossamer.communicators.base import PostedState
from gossamer.errors import TopologyError
from gossamer.topology import Step
from gossamer.transport import group_rank, group_size

__all__ = [
    "PEER_SELECTION_MODES",
    "CentralizedAllreduce",
    "GroupCommunicator",
    "Mapped",
    "PeerAverage",
    "shift_one",
    "shift_one_peer",
]

#: the peer selection modes of Bagua's decentralized algorithm
PEER_SELECTION_MODES = ("all", "shift_one")


class Mapped:
    """A pending round whose result is ``fn(result)`` (``fn`` runs in ``wait()``)."""

    def __init__(self, pending: Pending, fn: Any) -> None:
        self._pending, self._fn = pending, fn

    def wait(self) -> Any:
        """Wait for the round, then apply ``fn``."""
        return self._fn(self._pending.wait())


def shift_one_peer(rank: int, size: int, step: int) -> int | None:
    r"""Bagua's ``shift_one`` peer of ``rank`` at communication ``step`` (0, 1, ...).

    For an even ``size`` :math:`n` with :math:`h = n/2` (Bagua's formula, a matching between
    the lower and the upper half that rotates every step):

    .. math:: p(r) = \begin{cases} h + (s + r) \bmod \lceil n/2 \rceil & r < h \\
                                  (r - h - s) \bmod h & r \ge h \end{cases}

    For an odd ``size`` (Bagua refuses it) the same formula runs over :math:`n + 1` ranks
    with a phantom rank :math:`n`; the rank matched with the phantom has no peer that step
    (returns None) and keeps its value, a different rank each step.

    Raises:
        ValueError: ``size < 1``, ``rank`` outside ``[0, size)`` or ``step < 0``.
    """
    if size < 1 or not 0 <= rank < size or step < 0:
        raise ValueError(
            f"shift_one_peer: need 0 <= rank < size and step >= 0; got {rank}, {size}, {step}"
        )
    if size == 1:
        return None
    n = size + size % 2
    half = n // 2
    peer = half + (step + rank) % ((n + 1) // 2) if rank < half else (rank - half - step) % half
    return None if peer >= size else peer


def shift_one(size: int, rank: int, start: int = 0) -> Iterator[Step]:
    """The ``shift_one`` pattern as a dynamic topology: one Step per communication.

    Each :class:`~gossamer.topology.Step` gives weight 1/2 to this rank and its peer (1 to
    this rank when it has none).

    Feeds :class:`gossamer.communicators.NeighborAllreduce` (``schedule=``) as well.

    Example:
        >>> [s.send_ranks for s, _ in zip(shift_one(4, 0), range(3))]
        [(2,), (3,), (2,)]
    """
    step = start
    while True:
        peer = shift_one_peer(rank, size, step)
        if peer is None:
            yield Step((), (), 1.0, {}, {})
        else:
            yield Step((peer,), (peer,), 0.5, {peer: 0.5}, {peer: 1.0})
        step += 1


class GroupCommunicator(Communicator):
    """A communicator over a process group, flat or between machines.

    Args:
        hierarchical (bool): run between machines (needs the whole world as the group and
            the same number of ranks on every machine).
        group (ProcessGroup, optional): the ranks taking part; the world when None.

    Raises:
        ValueError: ``hierarchical`` with a group that is not the whole world.
        TopologyError: ``hierarchical`` on machines of different sizes.
    """

    def __init__(
        self, *, hierarchical: bool = False, group: dist.ProcessGroup | None = None
    ) -> None:
        super().__init__()
        if not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be a bool; got {hierarchical!r}")
        self.hierarchical = hierarchical
        self.group = group
        if hierarchical:
            if group is not None and group_size(group) != context.size():
                raise ValueError("hierarchical=True needs the whole world as the process group")
            if not context.is_homogeneous():
                raise TopologyError(
                    "hierarchical=True needs the same number of ranks on every machine, "
                    "numbered contiguously; machines of the ranks: "
                    f"{list(context.layout().machine_of)}"
                )

    @property
    def nranks(self) -> int:
        """Number of participants: ranks, or machines when hierarchical."""
        return context.machine_size() if self.hierarchical else group_size(self.group)

    @property
    def me(self) -> int:
        """This participant's index: group rank, or machine rank when hierarchical."""
        return context.machine_rank() if self.hierarchical else group_rank(self.group)

    def start(
        self, flat: torch.Tensor, index: int = 0, *, in_place: bool = False
    ) -> Pending | None:
        """Start this round on ``flat``; None when the group is a single rank.

        ``in_place`` is ignored: Bagua's patterns return buffers of their own.
        """
        if group_size(self.group) == 1:
            return None
        return self._start(flat, index)

    def _machines(self, flat: torch.Tensor, self_weight: float, peers: dict[int, float]) -> Pending:
        """Machine-level neighbour averaging: ``(w S_m + sum_k w_k S_k) / local_size``."""
        return ops.hierarchical_neighbor_allreduce(
            flat,
            self_weight=self_weight,
            src_machine_weights=peers,
            dst_machine_weights=list(peers),
            async_op=True,
        )

    def _global_average(self, flat: torch.Tensor) -> Pending:
        if not self.hierarchical:
            return ops.allreduce(flat, group=self.group, async_op=True)
        share = 1.0 / self.nranks
        others = {m: share for m in range(self.nranks) if m != self.me}
        return self._machines(flat, share, others)


class CentralizedAllreduce(GroupCommunicator):
    r"""Bagua's centralized full-precision op: :math:`\sum_r x_r` or :math:`\frac1n\sum_r x_r`.

    Hierarchical: each machine sums (averages) its ranks, the machines add their results,
    and every rank gets the total (mean), as Bagua's reduce / allreduce / broadcast.

    Args:
        average (bool): divide by the number of ranks.
        hierarchical (bool), group (ProcessGroup, optional): see :class:`GroupCommunicator`.
        inplace (bool): keyword only; the flat (non-hierarchical) allreduce writes its
            result into the tensor it is given (a Bagua bucket's flat buffer) instead of a
            new one. Hierarchical rounds are always out of place.
    """

    name = "bagua_centralized"

    def __init__(
        self,
        average: bool = True,
        *,
        hierarchical: bool = False,
        group=None,
        inplace: bool = False,
    ) -> None:
        super().__init__(hierarchical=hierarchical, group=group)
        if not isinstance(average, bool):
            raise TypeError(f"average must be a bool; got {average!r}")
        if not isinstance(inplace, bool):
            raise TypeError(f"inplace must be a bool; got {inplace!r}")
        self.average = average
        self.inplace = inplace

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        if not self.hierarchical:
            allreduce = ops.allreduce_ if self.inplace else ops.allreduce
            return allreduce(flat, average=self.average, group=self.group, async_op=True)
        if self.average:
            return self._global_average(flat)
        # Every machine's sum, added up, arrives divided by the machine size: undo it.
        others = {m: 1.0 for m in range(self.nranks) if m != self.me}
        size = context.local_size()
        return Mapped(self._machines(flat, 1.0, others), lambda y: y.mul_(size))


# Segments of a posted shift_one round (as gossamer's default fusion buckets), keyed apart
# from the buckets that gossamer's optimizers post (the low-precision ring's from 2 * KEYS).
SEGMENT_BYTES = 4 * 2**20
KEYS = 1 << 16


def _segments(numel: int, pieces: int) -> list[slice]:
    bounds = [numel * k // pieces for k in range(pieces + 1)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


class PeerAverage(GroupCommunicator):
    r"""Bagua's decentralized full-precision op: average with all ranks or with one peer.

    - ``"all"``: :math:`x \leftarrow \frac1n \sum_r x_r` (exact global model average).
    - ``"shift_one"``: :math:`x \leftarrow (x + x_p)/2` with :math:`p` from
      :func:`shift_one_peer` at step = number of earlier rounds; over machines when
      hierarchical (machine means averaged pairwise).

    Args:
        peer_selection_mode (str): ``"all"`` or ``"shift_one"``.
        hierarchical (bool), group (ProcessGroup, optional): see :class:`GroupCommunicator`.
    """

    name = "bagua_peer_average"
    #: the operation a posted round's errors and bytes are named for (transport.header.OPS)
    posted_op = "pair_gossip"

    def __init__(
        self, peer_selection_mode: str = "all", *, hierarchical: bool = False, group=None
    ) -> None:
        if peer_selection_mode not in PEER_SELECTION_MODES:
            raise ValueError(
                f"peer_selection_mode must be one of {PEER_SELECTION_MODES}; "
                f"got {peer_selection_mode!r}"
            )
        super().__init__(hierarchical=hierarchical, group=group)
        self.peer_selection_mode = peer_selection_mode
        self._posted = PostedState()

    def peer(self) -> int | None:
        """This round's peer (a group or machine rank); None: no peer this round."""
        return shift_one_peer(self.me, self.nranks, max(self.rounds - 1, 0))

    def post_segments(self, flat: torch.Tensor) -> list[tuple[slice, torch.Tensor, list]] | None:
        """This round's ``shift_one`` exchange, posted in segments, for a communication job.

        Returns ``(segment, received, work)`` per segment of :data:`SEGMENT_BYTES`: the
        job waits for each segment's work (``transport.wait_works``) and averages it while
        the later ones are still on the wire. None where rounds are not posted: ``"all"``,
        ``hierarchical``, a sub-group, an odd world (a rank without a peer), or a tensor
        that ``transport.can_post`` refuses; use :meth:`start` then.
        """
        if (
            self.peer_selection_mode != "shift_one"
            or self.hierarchical
            or self.group is not None
            or self.nranks % 2
            or not transport.can_post(flat)
        ):
            return None
        peer = self.peer()
        assert peer is not None  # every rank has one in an even world
        pieces = math.ceil(flat.nbytes / SEGMENT_BYTES)
        posted = []
        for key, piece in enumerate(_segments(flat.numel(), pieces)):
            sent = flat[piece]
            received = self._posted.buffer(key, 0, sent.numel(), sent.dtype)
            check = self._posted.needs_check(key, (sent.dtype, sent.numel()))
            works = transport.post_exchange_works(
                self.posted_op, sent, {peer: sent}, {peer: received}, key=KEYS + key, check=check
            )
            posted.append((piece, received, works))
        return posted

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        if self.peer_selection_mode == "all":
            return self._global_average(flat)
        peer = self.peer()
        if self.hierarchical:
            return (
                self._machines(flat, 1.0, {})
                if peer is None
                else self._machines(flat, 0.5, {peer: 0.5})
            )
        if peer is None:
            return None
        return ops.pair_gossip(flat, peer, group=self.group, async_op=True)
