"""Bagua buckets: tensors that travel together, and the operations run on them.

A :class:`BaguaBucket` holds the *effective* tensors of its Bagua tensors (gradients,
weights, momenta, see :mod:`gossamer.bagua.tensor`) in one flat buffer
(:class:`gossamer.fusion.Bucket`) and a list of operations. When every tensor of the
bucket has been marked ready, the operations run in the order they were appended, as one
job of gossamer's communication thread, each through a gossamer communicator.

With ``flatten=True`` (Bagua's ``do_flatten``, the default) the effective tensors are
re-pointed into the flat buffer, as Bagua does: they *are* slices of it, so packing copies
nothing and a result is written back with one contiguous copy. A parameter keeps its
identity (``set_`` changes its storage, not the object), so optimizers and their state
still find it. A tensor that was replaced since (a gradient that ``zero_grad()`` set to
None and the backward pass allocated anew) is copied into its slice and re-pointed when
it is marked ready. With ``flatten=False`` the effective tensors keep their own storage:
they are copied into the flat buffer before each operation list and results copied back.
Both give the same values.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable
from typing import Any

import torch

from gossamer import transport
from gossamer.bagua._groups import BaguaProcessGroup, default_group
from gossamer.bagua.communicators import CentralizedAllreduce, GroupCommunicator, PeerAverage
from gossamer.fusion import Bucket
from gossamer.topology import Topology

__all__ = [
    "BaguaBucket",
    "CentralizedSynchronousOp",
    "DecentralizedSynchronousOp",
    "LowPrecisionDecentralizedSynchronousOp",
    "PythonOp",
]

logger = logging.getLogger(__name__)


def _group(group: BaguaProcessGroup | None) -> BaguaProcessGroup:
    if group is None:
        return default_group()
    if not isinstance(group, BaguaProcessGroup):
        raise TypeError(f"group must be a BaguaProcessGroup or None; got {group!r}")
    return group


def _writable(tensor: torch.Tensor) -> torch.Tensor:
    """The effective tensor to write into, creating a zero gradient where there is none."""
    effective = tensor.bagua_getter_closure()
    if effective is None:
        tensor.bagua_ensure_grad()
        effective = tensor.bagua_getter_closure()
    return effective


class _Op(abc.ABC):
    """One operation of a bucket: ``run(bucket)`` on gossamer's communication thread."""

    communicator: GroupCommunicator | None = None

    @abc.abstractmethod
    def run(self, bucket: BaguaBucket) -> None:
        """Run this operation on ``bucket``'s flat tensor."""

    def inline(self, bucket: BaguaBucket) -> bool:
        """Whether :meth:`run` may run on the caller's thread instead (it only posts)."""
        return False

    def _round(self, flat: torch.Tensor) -> torch.Tensor:
        """One round of the communicator on ``flat``; ``flat`` itself if it did nothing."""
        assert self.communicator is not None
        self.communicator.next_round()
        pending = self.communicator.start(flat, 0)
        return flat if pending is None else pending.wait()


class CentralizedSynchronousOp(_Op):
    """Sum or average the bucket over all ranks, in full precision or compressed."""

    def __init__(self, communicator: GroupCommunicator) -> None:
        self.communicator = communicator

    def run(self, bucket: BaguaBucket) -> None:
        """Pack, communicate, write back into the effective tensors."""
        bucket.unpack(self._round(bucket.pack()))


class DecentralizedSynchronousOp(_Op):
    """Average the bucket's weights with peers into ``peer_weight``; the weights stay.

    :meth:`copy_back_peer_weight` then writes ``peer_weight`` into the weights.
    """

    def __init__(self, communicator: PeerAverage, peer_weight: torch.Tensor) -> None:
        self.communicator = communicator
        self.peer_weight = peer_weight

    def run(self, bucket: BaguaBucket) -> None:
        """``peer_weight <- W x`` for the bucket's current ``x``.

        A posted ``shift_one`` round averages each segment into ``peer_weight`` as it
        arrives, while the later segments are on the wire.
        """
        flat = bucket.pack()
        self.communicator.next_round()
        posted = self.communicator.post_segments(flat)
        with torch.no_grad():
            if posted is None:
                pending = self.communicator.start(flat, 0)
                self.peer_weight.copy_(flat if pending is None else pending.wait())
                return
            for piece, received, works in posted:
                transport.wait_works(self.communicator.posted_op, works)
                torch.add(flat[piece], received, out=self.peer_weight[piece]).div_(2)

    def copy_back_peer_weight(self, bucket: BaguaBucket) -> None:
        """Overwrite the bucket's tensors with the averaged ``peer_weight``."""
        bucket.unpack(self.peer_weight)

    def swap_in_peer_weight(self, bucket: BaguaBucket) -> None:
        """Make the averaged ``peer_weight`` the bucket's tensors, as a copy back would.

        A bucket flattened in place trades buffers with ``peer_weight`` (no model-sized
        copy); ``peer_weight`` is then the old buffer, which the next round overwrites.
        Otherwise it copies back.
        """
        if bucket.flatten and bucket.check_flatten():
            self.peer_weight = bucket.swap_flat(self.peer_weight)
        else:
            self.copy_back_peer_weight(bucket)


class LowPrecisionDecentralizedSynchronousOp(_Op):
    """The compressed difference ring: the weights become their public replica."""

    def __init__(self, communicator: GroupCommunicator) -> None:
        self.communicator = communicator

    def run(self, bucket: BaguaBucket) -> None:
        """Pack the weights, run the round, write the new weights back."""
        bucket.unpack(self._round(bucket.pack()))

    def inline(self, bucket: BaguaBucket) -> bool:
        """Whether the round is posted (its differences then arrive during the next step)."""
        return self.communicator.posts(bucket.tensors[0])


class PythonOp(_Op):
    """An arbitrary Python step ``fn(bucket_name)``."""

    def __init__(self, fn: Callable[[str], None]) -> None:
        if not callable(fn):
            raise TypeError(f"python_function must be callable; got {fn!r}")
        self.fn = fn

    def run(self, bucket: BaguaBucket) -> None:
        """Call the function with the bucket's name."""
        self.fn(bucket.name)


class BaguaBucket:
    """A bucket of Bagua tensors of one dtype and device.

    Args:
        tensors (list[torch.Tensor]): Bagua tensors (see ``ensure_bagua_tensor``).
        name (str): the bucket's unique name.
        flatten (bool): re-point the effective tensors into the bucket's flat buffer (as
            Bagua does), so that no per-step packing copy is needed; False packs them
            into the buffer and copies results back each time. Values are the same.
        alignment (int): pad the bucket with zeros to a multiple of this many elements.

    Raises:
        ValueError: no tensors, tensors not registered, or of different dtypes or devices.
    """

    def __init__(
        self, tensors: list[torch.Tensor], name: str, flatten: bool, alignment: int = 1
    ) -> None:
        if not tensors:
            raise ValueError("a BaguaBucket needs at least one tensor")
        unregistered = [i for i, t in enumerate(tensors) if not t.is_bagua_tensor()]
        if unregistered:
            raise ValueError(f"tensors {unregistered} are not Bagua tensors (ensure_bagua_tensor)")
        if isinstance(alignment, bool) or not isinstance(alignment, int) or alignment < 1:
            raise ValueError(f"alignment must be an int >= 1; got {alignment!r}")
        self.tensors = list(tensors)
        self.name = name
        self.flatten = flatten
        self.bagua_module_name = tensors[0].bagua_module_name
        first = self.tensors[0].bagua_getter_closure()
        if first is None:
            first = self.tensors[0]
        numel = sum(t.numel() for t in self.tensors)
        self.padding_tensor = None
        if numel % alignment:
            self.padding_tensor = torch.zeros(
                alignment - numel % alignment, dtype=first.dtype, device=first.device
            ).ensure_bagua_tensor(f"bagua_padding_tensor_bucket_{name}", self.bagua_module_name)
        self._all = self.tensors + (
            [self.padding_tensor] if self.padding_tensor is not None else []
        )
        self._fused = Bucket(self._all)
        self._index = {id(t): i for i, t in enumerate(self._all)}
        for t in self._all:
            t._bagua_bucket = self
        if flatten:
            self._fused.flat.zero_()  # a missing gradient is a zero one
            for t in self._all:
                self._repoint(t)
        self._ops: list[_Op] = []
        self._ready: set[int] = set()

    def __getattr__(self, name: str) -> Any:
        # Reached only for attributes the bucket does not have.
        if name == "_peer_weight":
            raise AttributeError(
                "BaguaBucket has no _peer_weight: DecentralizedAlgorithm swaps the averaged "
                "weights into the model after backward instead of keeping a copy of them "
                "(see 'Not ported' in docs/bagua-migration.md)"
            )
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ------------------------------------------------------------------ data

    def _in_place(self, index: int) -> bool:
        """Whether tensor ``index``'s effective tensor is its slice of the flat buffer."""
        effective = self._all[index].bagua_getter_closure()
        view = self._fused.views[index]
        return (
            effective is not None
            and effective.data_ptr() == view.data_ptr()
            and effective.shape == view.shape
            and effective.is_contiguous()
        )

    def _repoint(self, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s effective tensor into its slice, then make it that slice."""
        index = self._index[id(tensor)]
        effective = tensor.bagua_getter_closure()
        if effective is None and isinstance(tensor, torch.nn.Parameter):
            effective = _writable(tensor)  # an unused parameter's zero gradient
        if effective is None or self._in_place(index):
            return
        view = self._fused.views[index]
        with torch.no_grad():
            view.copy_(effective)
        tensor.bagua_set_storage(self._fused.flat.untyped_storage(), view.storage_offset())

    def pack(self) -> torch.Tensor:
        """The effective tensors (and padding) in the bucket's flat buffer (reused).

        With ``flatten`` only the tensors not already in it are copied.
        """
        if not self.flatten:
            return self._fused.pack(lambda t: t.bagua_getter_closure())
        with torch.no_grad():
            for i, (t, view) in enumerate(zip(self._all, self._fused.views, strict=True)):
                if self._in_place(i):
                    continue
                effective = t.bagua_getter_closure()
                if effective is None:
                    view.zero_()
                else:
                    view.copy_(effective)
        return self._fused.flat

    def unpack(self, flat: torch.Tensor) -> None:
        """Copy ``flat`` (laid out like the bucket) into the effective tensors.

        With ``flatten``: one copy into the flat buffer (nothing when ``flat`` is it), then
        a copy for each effective tensor outside it.
        """
        if not self.flatten:
            self._fused.unpack(flat, _writable)
            return
        own = self._fused.flat
        with torch.no_grad():
            if flat.data_ptr() != own.data_ptr():
                own.copy_(flat.reshape(-1))
            for i, (t, view) in enumerate(zip(self._all, self._fused.views, strict=True)):
                if not self._in_place(i):
                    _writable(t).copy_(view)

    def swap_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """Re-point the effective tensors into ``flat`` (no copy); return the old buffer.

        For a bucket flattened in place (:meth:`check_flatten`); ``flat`` is laid out like
        the bucket, and the tensors take its values.
        """
        old = self._fused.flat
        self._fused.rebase(flat)
        for t, view in zip(self._all, self._fused.views, strict=True):
            t.bagua_set_storage(flat.untyped_storage(), view.storage_offset())
        return old

    def add_to_effective(self, flat: torch.Tensor) -> None:
        """Add the slices of ``flat`` (laid out like the bucket) to the effective tensors."""
        offset = 0
        with torch.no_grad():
            for t in self.tensors:
                effective = _writable(t)
                part = flat[offset : offset + effective.numel()]
                effective.add_(part.view_as(effective).to(effective.device))
                offset += effective.numel()

    def flattened_tensor(self) -> torch.Tensor:
        """A new contiguous tensor holding the effective tensors (and padding)."""
        return self.pack().clone()

    def check_flatten(self) -> bool:
        """Whether the effective tensors are consecutive slices of one flat buffer.

        Always True with ``flatten=True`` after the tensors are marked ready; with
        ``flatten=False`` they keep their own storage (and are packed before each use).
        """
        return all(self._in_place(i) for i in range(len(self._all)))

    def bytes(self) -> int:
        """Bytes of the effective tensors."""
        return sum(t.numel() * t.element_size() for t in self.tensors)

    # ------------------------------------------------------------------ operations
    def clear_ops(self) -> BaguaBucket:
        """Remove the operations appended so far."""
        self._ops.clear()
        return self

    def append_python_op(
        self, python_function: Callable[[str], None], group: BaguaProcessGroup | None = None
    ) -> None:
        """Append ``python_function(bucket_name)``, run in order with the other operations."""
        _group(group)
        self._ops.append(PythonOp(python_function))

    def append_centralized_synchronous_op(
        self,
        hierarchical: bool = False,
        average: bool = True,
        scattergather: bool = False,
        compression: str | None = None,
        group: BaguaProcessGroup | None = None,
    ) -> CentralizedSynchronousOp:
        """Append the sum (or average) of the bucket over all ranks of ``group``.

        Args:
            hierarchical (bool): average inside machines first, then between machines.
            average (bool): average instead of sum.
            scattergather (bool): reduce-scatter then allgather (needed by compression).
            compression (str, optional): ``"MinMaxUInt8"`` (or any name
                ``gossamer.compression.get_compressor`` knows); needs ``scattergather``.
            group (BaguaProcessGroup, optional): default: the default group.

        Raises:
            ValueError: ``compression`` without ``scattergather``.
        """
        pg = _group(group)
        if compression is not None:
            if not scattergather:
                raise ValueError("compression needs scattergather=True")
            from gossamer.bagua.compressed import ScatterGatherCompressed

            comm: GroupCommunicator = ScatterGatherCompressed(
                compression, average=average, hierarchical=hierarchical, group=pg.torch_group
            )
        else:
            # Scatter-gather without compression gives the same sum as an allreduce. In place:
            # the packed buffer (or, flattened, the gradients themselves) takes the result,
            # so nothing is copied back.
            comm = CentralizedAllreduce(
                average, hierarchical=hierarchical, group=pg.torch_group, inplace=True
            )
        op = CentralizedSynchronousOp(comm)
        self._ops.append(op)
        return op

    def append_decentralized_synchronous_op(
        self,
        peer_weight: torch.Tensor,
        hierarchical: bool = True,
        peer_selection_mode: str = "all",
        group: BaguaProcessGroup | None = None,
    ) -> DecentralizedSynchronousOp:
        """Append gossip averaging of the weights into ``peer_weight``; return the operation.

        See :class:`~gossamer.bagua.communicators.PeerAverage`. The operation's
        ``copy_back_peer_weight(bucket)`` writes the result into the weights.
        """
        pg = _group(group)
        comm = PeerAverage(peer_selection_mode, hierarchical=hierarchical, group=pg.torch_group)
        op = DecentralizedSynchronousOp(comm, peer_weight)
        self._ops.append(op)
        return op

    def append_low_precision_decentralized_synchronous_op(
        self,
        weight: torch.Tensor,
        left_peer_weight: torch.Tensor,
        right_peer_weight: torch.Tensor,
        hierarchical: bool = True,
        compression: Any = "MinMaxUInt8",
        group: BaguaProcessGroup | None = None,
        *,
        topology: Topology | None = None,
    ) -> LowPrecisionDecentralizedSynchronousOp:
        """Append the compressed difference ring (:class:`~.compressed.LowPrecisionGossip`).

        ``weight``, ``left_peer_weight`` and ``right_peer_weight`` are the replicas (all
        start as x0) and are updated in place. Beyond Bagua, ``compression`` may be any
        compressor of :mod:`gossamer.compression`, and ``topology`` (keyword only) mixes over
        a gossamer topology instead of the ring (the replicas are then allocated inside).
        """
        from gossamer.bagua.compressed import LowPrecisionGossip

        pg = _group(group)
        comm = LowPrecisionGossip(
            compression,
            topology=topology,
            hierarchical=hierarchical,
            group=pg.torch_group,
            replicas=None
            if topology is not None
            else (weight, left_peer_weight, right_peer_weight),
        )
        comm.bind([self])  # replicas start at x0, before the first local step
        op = LowPrecisionDecentralizedSynchronousOp(comm)
        self._ops.append(op)
        return op

    def append_asynchronous_model_average_op(
        self, peer_selection_mode: str, group: BaguaProcessGroup | None = None
    ):
        """Create the asynchronous averaging operation of this bucket and return it.

        It does not run when the bucket is ready: the algorithm's background thread calls
        its rounds (see :class:`gossamer.bagua.asynchronous.AsyncModelAverageOp`).
        """
        from gossamer.bagua.asynchronous import AsyncModelAverageOp

        return AsyncModelAverageOp(self, peer_selection_mode, _group(group))

    # ------------------------------------------------------------------ running
    def mark_ready(self, tensor: torch.Tensor) -> bool:
        """Record that ``tensor`` is ready; True once all the bucket's tensors are.

        With ``flatten``, an effective tensor that is no longer in the flat buffer is put
        back there (copied, then re-pointed), so later steps copy nothing.
        """
        if self.flatten:
            self._repoint(tensor)
        self._ready.add(id(tensor))
        return self.all_ready()

    def all_ready(self) -> bool:
        """True when every tensor (not the padding) was marked since the last reset."""
        return all(id(t) in self._ready for t in self.tensors)

    def reset_ready(self) -> None:
        """Forget which tensors were marked."""
        self._ready.clear()

    def runs_inline(self) -> bool:
        """Whether every operation may run on the caller's thread (see ``_Op.inline``)."""
        return bool(self._ops) and all(op.inline(self) for op in self._ops)

    def execute(self) -> None:
        """Run the operations in order (a job of gossamer's communication thread, or inline)."""
        for op in list(self._ops):
            op.run(self)

    # ------------------------------------------------------------------ state
    def state_dict(self) -> list[dict]:
        """Each operation's communication state (rounds, replicas, compressor streams)."""
        return [{} if op.communicator is None else op.communicator.state_dict() for op in self._ops]

    def load_state_dict(self, state: list[dict]) -> None:
        """Restore :meth:`state_dict`'s output.

        Raises:
            ValueError: ``state`` holds another number of operations.
        """
        if not isinstance(state, list) or len(state) != len(self._ops):
            count = len(state) if isinstance(state, list) else state
            raise ValueError(f"bucket {self.name!r} has {len(self._ops)} operations; got {count}")
        for op, ours in zip(self._ops, state, strict=True):
            if op.communicator is not None:
                op.communicator.load_state_dict(ours)

    def __repr__(self) -> str:
        return f"BaguaBucket({self.name!r}, {len(self.tensors)} tensors, {len(self._ops)} ops)"
