"""Bagua's process groups and communicators, as views of torch process groups.

A :class:`BaguaProcessGroup` is a list of world ranks and the torch process group over them
(``None`` for the default group: the world). Its communicators (global, intra-node,
inter-node) are :class:`BaguaCommunicator` objects that name a torch group and this rank's
place in it; gossamer's operations take that group. Machines are gossamer's
(``GOSSAMER_NODES_PER_MACHINE`` fakes them).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from gossamer import context, transport
from gossamer.bagua._collectives import rejecting
from gossamer.bagua._state import state

__all__ = [
    "BaguaCommunicator",
    "BaguaProcessGroup",
    "CommMember",
    "comm",
    "default_group",
    "from_torch_group",
    "get_communicator",
    "install",
    "new_group",
    "resolve",
]


class comm:
    """Bagua's marker for "the global communicator of the default group"."""

    WORLD = object()


class CommMember:
    """Markers: the default group's communicator, and "this rank is not a member"."""

    WORLD = comm.WORLD
    NON_COMM_MEMBER = object()


class BaguaCommunicator:
    """A communicator: a torch process group (``None``: the world) and this rank in it."""

    def __init__(self, group: dist.ProcessGroup | None, ranks: Sequence[int]) -> None:
        self.group = group
        self.ranks = list(ranks)

    def rank(self) -> int:
        """This process's rank in the communicator."""
        return self.ranks.index(context.rank())

    def nranks(self) -> int:
        """Number of ranks in the communicator."""
        return len(self.ranks)

    def __repr__(self) -> str:
        return f"BaguaCommunicator(ranks={self.ranks})"


def _subgroups(rank_lists: list[list[int]]) -> Any:
    """This rank's communicator among ``rank_lists`` (disjoint), or NON_COMM_MEMBER.

    Only the members of a list create its group (torch's local synchronization), so a rank
    in none of them neither waits nor needs to call.
    """
    me = context.rank()
    mine = next((ranks for ranks in rank_lists if me in ranks), None)
    if mine is None:
        return CommMember.NON_COMM_MEMBER

    def body() -> dist.ProcessGroup:
        return dist.new_group(
            mine, timeout=timedelta(seconds=context.timeout()), use_local_synchronization=True
        )

    # Queued behind the operations already pending, as every collective of this rank.
    return BaguaCommunicator(transport.run("new_group", body, False), mine)


class BaguaProcessGroup:
    """Bagua's process group: ranks, a CUDA stream (kept, unused) and a name.

    Args:
        ranks (Sequence[int]): world ranks of the members, ascending.
        stream: accepted for Bagua compatibility; gossamer orders work on its own threads.
        group_name (str): the group's name.
        torch_group (ProcessGroup, optional): the torch group over ``ranks``; None: world.
    """

    def __init__(
        self,
        ranks: Sequence[int],
        stream: Any,
        group_name: str,
        *,
        torch_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.ranks = list(ranks)
        self.stream = stream
        self.group_name = group_name
        self.torch_group = torch_group
        self._communicators: dict[str, Any] = {}
        state().groups[group_name] = self

    @property
    def is_world(self) -> bool:
        """True when the group holds every rank (hierarchical operations need this)."""
        return self.ranks == list(range(context.size()))

    def get_global_communicator(self) -> Any:
        """The communicator over all ranks of the group (NON_COMM_MEMBER for outsiders)."""
        if context.rank() not in self.ranks:
            return CommMember.NON_COMM_MEMBER
        if "global" not in self._communicators:
            self._communicators["global"] = BaguaCommunicator(self.torch_group, self.ranks)
        return self._communicators["global"]

    def _machine_lists(self) -> list[list[int]]:
        layout = context.layout()
        lists = [
            [r for r in self.ranks if layout.machine_of[r] == m] for m in range(layout.machine_size)
        ]
        return [ranks for ranks in lists if ranks]

    def get_intra_node_communicator(self) -> Any:
        """The communicator over the group's ranks on this machine (collective on first use)."""
        if "intra" not in self._communicators:
            self._communicators["intra"] = _subgroups(self._machine_lists())
        return self._communicators["intra"]

    def get_inter_node_communicator(self) -> Any:
        """The communicator over the first group rank of every machine (collective on first use).

        Other ranks get ``CommMember.NON_COMM_MEMBER``.
        """
        if "inter" not in self._communicators:
            leaders = [ranks[0] for ranks in self._machine_lists()]
            self._communicators["inter"] = _subgroups([leaders])
        return self._communicators["inter"]

    def __repr__(self) -> str:
        return f"BaguaProcessGroup({self.group_name!r}, ranks={self.ranks})"


def default_group() -> BaguaProcessGroup:
    """The default group: the world (made on first use after init)."""
    st = state()
    if st.default_group is None:
        st.default_group = BaguaProcessGroup(list(range(context.size())), None, "0")
    return st.default_group


def new_group(
    ranks: list[int] | None = None, stream: torch.cuda.Stream | None = None
) -> BaguaProcessGroup:
    """Create a process group over ``ranks`` (all ranks when None).

    Every process must call it, in the same order, members or not (as in Bagua and torch);
    a rank whose ``ranks`` is refused, or differs from the others', makes every rank raise.
    ``ranks=[]`` gives a group that no rank is a member of (torch makes no group for it).

    Raises:
        TypeError: ``ranks`` is not a sequence of ints.
        ValueError: a rank outside ``[0, world size)``, or one given twice.
        PeerArgumentError, PeerError: on the other ranks, for the above.
    """
    size = context.size()
    with rejecting("new_group", None):
        chosen = list(range(size)) if ranks is None else _checked_ranks(ranks, size)

    def body() -> dist.ProcessGroup | None:
        listed = torch.tensor(chosen, dtype=torch.int64)
        checksum = zlib.crc32(listed.numpy().tobytes())
        transport.check_same_call("new_group", listed, None, checksum)
        if not chosen:
            return None
        return dist.new_group(chosen, timeout=timedelta(seconds=context.timeout()))

    group = transport.run("new_group", body, False)
    return BaguaProcessGroup(chosen, stream, str(next(state().group_ids)), torch_group=group)


@transport.explains_aux("new_group")
def _explain_members(checksum: int) -> str:
    return f"ranks checksum {checksum}"


def _checked_ranks(ranks: object, size: int) -> list[int]:
    if isinstance(ranks, str | bytes) or not isinstance(ranks, Sequence):
        raise TypeError(f"ranks must be a list of ints or None; got {ranks!r}")
    if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
        raise TypeError(f"ranks must be a list of ints or None; got {list(ranks)!r}")
    bad = [r for r in ranks if not 0 <= r < size]
    if bad:
        raise ValueError(f"ranks must be in [0, {size}); got {bad}")
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"ranks must not repeat a rank; got {list(ranks)!r}")
    return sorted(ranks)


def _torch_non_member(group: object) -> bool:
    """Whether ``group`` is what torch's ``new_group`` gives a rank outside the group."""
    return type(group) is int and group == dist.GroupMember.NON_GROUP_MEMBER


def from_torch_group(
    group: dist.ProcessGroup, stream: torch.cuda.Stream | None = None
) -> BaguaProcessGroup:
    """The Bagua process group that communicates over the torch process group ``group``.

    On a rank outside ``group`` torch's ``new_group`` returned
    ``GroupMember.NON_GROUP_MEMBER``; that gives a group this rank is not a member of (its
    members are not known here, so ``ranks`` is empty).
    """
    if _torch_non_member(group):
        return BaguaProcessGroup([], stream, str(next(state().group_ids)))
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a torch.distributed ProcessGroup; got {group!r}")
    ranks = sorted(dist.get_process_group_ranks(group))
    return BaguaProcessGroup(ranks, stream, str(next(state().group_ids)), torch_group=group)


_COMMUNICATORS = {
    "global": BaguaProcessGroup.get_global_communicator,
    "inter": BaguaProcessGroup.get_inter_node_communicator,
    "intra": BaguaProcessGroup.get_intra_node_communicator,
}


def get_communicator(group_name: str, comm_name: str) -> Any:
    """Communicator ``comm_name`` (``"global"``, ``"inter"``, ``"intra"``) of the named group.

    Raises:
        ValueError: an unknown ``comm_name``.
        KeyError: no group has the name ``group_name``.
    """
    if comm_name not in _COMMUNICATORS:
        raise ValueError(f"comm_name must be one of {sorted(_COMMUNICATORS)}; got {comm_name!r}")
    default_group()  # made on first use; it registers itself
    group = state().groups.get(group_name)
    if group is None:
        raise KeyError(f"no Bagua process group is named {group_name!r}")
    return _COMMUNICATORS[comm_name](group)


def resolve(comm_: object, name: str = "comm") -> BaguaCommunicator | None:
    """The communicator a primitive's ``comm=`` names; None when this rank is not in it.

    Accepts None and ``CommMember.WORLD`` (the default group), a communicator, a
    :class:`BaguaProcessGroup` (its global communicator) or a torch process group.
    """
    if comm_ is None or comm_ is CommMember.WORLD:
        comm_ = default_group().get_global_communicator()
    elif isinstance(comm_, BaguaProcessGroup):
        comm_ = comm_.get_global_communicator()
    elif isinstance(comm_, dist.ProcessGroup):
        comm_ = comm_.bagua_patch().bagua_get_global_communicator()
    if comm_ is CommMember.NON_COMM_MEMBER or _torch_non_member(comm_):
        return None
    if not isinstance(comm_, BaguaCommunicator):
        raise TypeError(
            f"{name} must be a communicator (group.get_global_communicator()), a process "
            f"group or None; got {comm_!r}"
        )
    return comm_


class ProcessGroupPatch:
    """What Bagua adds to ``torch.distributed.ProcessGroup``: its Bagua twin, made once."""

    def bagua_patch(self, stream: torch.cuda.Stream | None = None) -> dist.ProcessGroup:
        """Make (once) the Bagua process group of this torch group; return this group."""
        twins = state().torch_groups
        if self not in twins:
            twins[self] = from_torch_group(self, stream)
        return self

    @property
    def bagua_pg(self) -> BaguaProcessGroup:
        """The Bagua process group made by :meth:`bagua_patch`.

        Raises:
            RuntimeError: ``bagua_patch()`` was not called on this group.
        """
        twin = state().torch_groups.get(self)
        if twin is None:
            raise RuntimeError(f"call bagua_patch() on {self!r} before using its Bagua group")
        return twin

    def bagua_get_global_communicator(self) -> Any:
        """``self.bagua_pg.get_global_communicator()``."""
        return self.bagua_pg.get_global_communicator()

    def bagua_get_inter_node_communicator(self) -> Any:
        """``self.bagua_pg.get_inter_node_communicator()``."""
        return self.bagua_pg.get_inter_node_communicator()

    def bagua_get_intra_node_communicator(self) -> Any:
        """``self.bagua_pg.get_intra_node_communicator()``."""
        return self.bagua_pg.get_intra_node_communicator()


def install() -> None:
    """Add :class:`ProcessGroupPatch`'s members to ``torch.distributed.ProcessGroup``."""
    for name, member in vars(ProcessGroupPatch).items():
        if name.startswith("bagua_"):
            setattr(dist.ProcessGroup, name, member)
