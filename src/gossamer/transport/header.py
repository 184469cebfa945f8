"""The one call header of gossamer's wire: what a message is, before its payload.

Every message that carries data (a neighbour exchange, a window request) is preceded by, or
is, a header of :data:`HEADER_LEN` int64 values: a magic number, the operation, a sequence
number, an auxiliary integer (a root rank, a window id), a slot, the payload codec, a float
value (its bits), the dtype, the sender's membership epoch
(:mod:`~gossamer.transport.membership`), how many payload bytes travel in the header's own
message (:mod:`~gossamer.transport.p2p`), and the shape. The receiver checks it against its
own call and sizes its buffer from it, so a peer that called something else produces an
error naming both sides instead of garbage or a hang. Compressed payloads name their codec here.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from dataclasses import dataclass

import torch

from gossamer.errors import PeerError

__all__ = ["DTYPES", "HEADER_LEN", "OPS", "Header", "codec_name", "explains_aux", "name_codec"]

_MAGIC = 0x605_5A3E
_MAX_DIMS = 10  # header slots for dims; further dims are folded into one product
HEADER_LEN = 11 + _MAX_DIMS + 1  # 176 bytes: a payload after it is 16-byte aligned

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    # Appended, so the indices above keep their meaning on the wire.
    torch.complex64,
    torch.complex128,
    torch.uint16,
    torch.uint32,
    torch.uint64,
)
OPS = (
    "allreduce",
    "broadcast",
    "allgather",
    "neighbor_allreduce",
    "neighbor_allgather",
    "hierarchical_neighbor_allreduce",
    "pair_gossip",
    "window_create",
    # One-sided window messages (served by the window service's progress thread).
    "window.put",
    "window.accumulate",
    "window.get",
    "window.reply",
    "window.ack",
    "window.nack",
    "window.lock",
    "window.grant",
    "window.unlock",
    "window.stop",
    "alltoall",
    "compressed_gossip",
    # Neighbourhood gradient clustering: a gradient computed for one neighbour's model.
    "cross_gradient",
    # A rank that rejected its arguments sends this instead of its call (transport.rejection).
    "rejected",
    "reduce",
    "gather",
    "scatter",
    "reduce_scatter",
    "alltoall_v",
    "point_to_point",
    # Random-k's values summed over ranks; the header's aux is the (seed, step) of its positions.
    "compressed_allreduce",
    "barrier",
    # Averaging inside a group of ranks among its live members (Moshpit's grid lines).
    "group_average",
    # Making a process group: every rank names the same members (aux: their checksum).
    "new_group",
    # Freeing a window (aux: its id).
    "window_free",
)


# Codec ids are hashes of a configuration: the names this process gave them, for errors.
_CODEC_NAMES: dict[int, str] = {}


def name_codec(codec: int, name: str) -> int:
    """Remember that ``codec`` stands for ``name`` (``"compression='uint8'"``); return it.

    A mismatched call's error then names this rank's configuration, and says of a peer's
    that this rank does not use it.
    """
    _CODEC_NAMES[codec] = name
    return codec


def codec_name(codec: int) -> str:
    """What :func:`name_codec` named ``codec`` in this process (a peer's: its number)."""
    return _CODEC_NAMES.get(codec, f"a configuration this rank does not use (codec {codec})")


# What an operation's aux means (``"root 2"``), for errors naming another rank's call.
_AUX_MEANINGS: dict[str, Callable[[int], str]] = {}


def explains_aux(*ops: str) -> Callable[[Callable[[int], str]], Callable[[int], str]]:
    """Decorator: the function says what the aux of ``ops`` means, in every error.

    Registered where the operation is defined, so a rank describes a peer's call of an
    operation it never made itself (``"broadcast (root 0)"``, not ``"(aux 0)"``).
    """

    def register(explain: Callable[[int], str]) -> Callable[[int], str]:
        for op in ops:
            _AUX_MEANINGS[op] = explain
        return explain

    return register


def _bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", value))[0]


def _float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", bits))[0]


@dataclass(frozen=True)
class Header:
    """A decoded call header.

    Attributes:
        op: the operation (one of :data:`OPS`).
        dtype: the payload's dtype; shape: its shape (dims past the tenth folded into one).
        seq: a sequence number (a request id); aux: an operation's integer (root, window id).
        slot: a secondary integer (a mutex slot); codec: the payload codec (0: raw).
        value: a float that travels with the call (a push-sum weight).
        epoch: the sender's membership epoch (how many membership changes it has adopted);
            a receiver that sees a newer one adopts it (elastic gossip). Not part of
            :meth:`matches`.
        inline: how many payload bytes follow the header in its own message (the rest
            travels apart). Not part of :meth:`matches`.
    """

    op: str
    dtype: torch.dtype = torch.float32
    shape: tuple[int, ...] = ()
    seq: int = 0
    aux: int = 0
    slot: int = 0
    codec: int = 0
    value: float = 0.0
    epoch: int = 0
    inline: int = 0

    @classmethod
    def of(cls, op: str, tensor: torch.Tensor, **fields: int | float) -> Header:
        """The header of a call of ``op`` on ``tensor``."""
        return cls(op, tensor.dtype, tuple(tensor.shape), **fields)  # type: ignore[arg-type]

    @property
    def numel(self) -> int:
        """Number of payload elements."""
        return math.prod(self.shape)

    def encode(self) -> torch.Tensor:
        """The header as :data:`HEADER_LEN` int64 values."""
        dims = list(self.shape[:_MAX_DIMS])
        rest = math.prod(self.shape[_MAX_DIMS:])
        values = [
            _MAGIC,
            OPS.index(self.op),
            self.seq,
            self.aux,
            self.slot,
            self.codec,
            _bits(float(self.value)),
            DTYPES.index(self.dtype),
            len(self.shape),
            self.epoch,
            self.inline,
        ]
        values += dims + [-1] * (_MAX_DIMS - len(dims)) + [rest]
        return torch.tensor(values, dtype=torch.int64)

    @classmethod
    def decode(cls, encoded: torch.Tensor) -> Header:
        """Parse what :meth:`encode` produced.

        Raises:
            PeerError: the values are not a header (a corrupt or foreign message).
        """
        v = encoded.tolist()
        if v[0] != _MAGIC or not 0 <= v[1] < len(OPS) or not 0 <= v[7] < len(DTYPES):
            raise PeerError(f"received a corrupt call header {v}")
        ndim = v[8]
        shape = v[11 : 11 + min(ndim, _MAX_DIMS)]
        if ndim > _MAX_DIMS:
            shape.append(v[-1])  # folded: only used to size the drain buffer
        fields = (v[2], v[3], v[4], v[5], _float(v[6]), v[9], v[10])
        return cls(OPS[v[1]], DTYPES[v[7]], tuple(shape), *fields)

    def matches(self, other: Header, any_first_dim: bool = False) -> bool:
        """Same call: operation, aux, codec, dtype and shape (all but dim 0 if asked)."""
        same = (self.op, self.aux, self.codec, self.dtype, len(self.shape)) == (
            other.op,
            other.aux,
            other.codec,
            other.dtype,
            len(other.shape),
        )
        if any_first_dim and self.shape:
            return same and self.shape[1:] == other.shape[1:]
        return same and self.shape == other.shape

    def describe(self, explain: Callable[[int], str] | None = None) -> str:
        """``"allreduce (op sum) of float32[3, 4]"``: ``explain(aux)`` says what aux means.

        Without ``explain``, what :func:`explains_aux` registered for the operation. A codec
        is named as :func:`codec_name` says (``"... with compression='uint8'"``).
        """
        explain = explain or _AUX_MEANINGS.get(self.op)
        if explain is not None:
            extra = f" ({explain(self.aux)})"
        else:
            extra = f" (aux {self.aux})" if self.aux else ""
        of = f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}"
        coded = f" with {codec_name(self.codec)}" if self.codec else ""
        return f"{self.op}{extra} of {of}{coded}"
