"""Point-to-point exchanges and same-call checks, each preceded by a call header.

With its data, every neighbour exchange sends a :class:`~gossamer.transport.header.Header`
(operation, dtype, shape), or a payload that stands for the edge's last header (below). The
receiver checks it against its own call, so a peer that called another operation or passed
another shape produces an error naming both sides, not garbage or a hang. A payload of up to
256 KiB (less the header) travels in its header's message: every header receive is sized for
one (see :func:`_firsts`). Larger payloads and CUDA tensors travel apart, on tags of their
own, so a stray data message can never be taken for a header. On gloo, the data travels at
once, into receives sized from the receiver's own call, under a tag that depends on the byte
count: a payload of another size matches none of them and is received, once its header has
arrived, at the size the header gives (see :func:`_data_tag` and :func:`_receive`). Between
two ranks of one machine, a payload of 512 KiB or more travels without its header while the
call repeats exactly, on the headers' tag of that edge, told apart from a header by content
(see :class:`_Edges`): one message instead of two. Data travels as raw bytes
(:mod:`~gossamer.transport.payload`), so every dtype works on every backend. On the world
group, bytes from a higher to a lower rank travel on :func:`~gossamer.context.reverse_group`
where there is one, so the two directions of a pair swap use two connections.

:func:`exchange_surviving` is the exchange of elastic gossip. Every transfer is waited for
on its own, so a transfer with a dead peer fails alone, and the data phase still runs with
every peer whose header arrived: every message between two survivors of the round is
matched on both sides, whichever of them saw the death. No survivor is then left waiting
for a message that will never come (which would stall it until the deadline and leave a
posted receive behind to swallow a later message). A failed transfer is taken as a death
only once the peer's heartbeat (:mod:`~gossamer.transport.liveness`) has stopped too,
which takes up to ``GOSSAMER_DEAD_AFTER`` seconds plus a beat. Measured on loopback (4 ranks, gloo,
torch 2.13): after a SIGKILL, the neighbours' transfers with the dead rank fail within
0.07 s, and transfers among the survivors on the same (world) process group keep working.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.errors import PeerError
from gossamer.profiling import count_collective, count_sent, timeline
from gossamer.transport.failures import is_backend_error, wait_works
from gossamer.transport.header import HEADER_LEN, Header
from gossamer.transport.liveness import BEAT_S, DEAD_AFTER_S, get_liveness
from gossamer.transport.payload import as_bytes, from_bytes, nbytes_of
from gossamer.transport.rejection import (
    REJECTED,
    gather_reasons,
    peer_argument_error,
    rejected_header,
)

__all__ = [
    "MAX_CHUNKS",
    "Survived",
    "check_same_call",
    "exchange",
    "exchange_rejected",
    "exchange_surviving",
    "post_chunks",
]

_HEADER_TAG = 0x6F01
_HEAD_BYTES = HEADER_LEN * 8
_CPU = torch.device("cpu")
_DATA_TAGS = 1 << 30  # payload tags: 2^30 + MAX_CHUNKS * (hash of the byte count) + chunk
# Large CPU messages between machines travel as several chunks in flight per peer.
# Measured on emulated 100 Mbit links (benchmarks/netbench, 4 hosts): a 1.2 MB exchange
# alternating between peers took 150 ms per call as one gloo message and 110 ms as 4 or 16
# chunks (wire time 96 ms). On one machine (bench_ops, loopback) chunks made 1e6-element
# exchanges about 30 % slower, so messages between ranks of one machine stay whole.
_CHUNK_BYTES = 256 * 2**10
_PEER_ARG = {dist.isend: "group_dst", dist.irecv: "group_src"}
MAX_CHUNKS = 32
# A payload that fits beside its header in one such piece travels in the header's message,
# and every header receive is sized for one. Measured on loopback (bench_ops, 4 ranks on
# two cores, medians of 4 runs): the one-peer exchange of 1e4 float32 went from 2.36 to
# 2.11 ms and the exponential-two one from 4.28 to 2.78 ms. A 4 MB payload inline made the
# exchange of 1e6 floats slower: its copy (about 1 ms with four ranks on two cores) costs
# more than the header's own message (0.3-0.8 ms).
_INLINE_BYTES = _CHUNK_BYTES - _HEAD_BYTES
# Between two ranks of one machine, a payload of at least this size travels without its
# header while the call repeats (see _Edges). A header's message (at most _CHUNK_BYTES)
# into such a receive never reaches the receive's last 8 bytes.
_STICKY_TAG = 0x6F02
_STICKY_BYTES = 2 * _CHUNK_BYTES


class Buffers:
    """Receive buffers reused across calls, at most ``limit_bytes`` in all.

    A fresh multi-megabyte allocation costs page faults on every call. Operations run one
    at a time on each thread that communicates (the communication thread; Bagua's
    asynchronous averaging has a thread and a gloo group of its own) and consume their
    buffers before they return, so one buffer per (thread, peer, size in bytes) suffices.
    Buffers are bytes, viewed as the dtype.
    """

    def __init__(self, limit_bytes: int = 512 * 2**20) -> None:
        self.limit_bytes = limit_bytes
        self._cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, size: int, device: torch.device, peer: int) -> torch.Tensor:
        """A flat ``uint8`` tensor of ``size`` bytes for what ``peer`` sends."""
        key = (threading.get_ident(), peer, size, device)
        with self._lock:
            flat = self._cache.pop(key, None)
            if flat is None:
                flat = torch.empty(size, dtype=torch.uint8, device=device)
            self._cache[key] = flat
            total = sum(t.nbytes for t in self._cache.values())
            while total > self.limit_bytes and len(self._cache) > 1:
                total -= self._cache.popitem(last=False)[1].nbytes
        return flat

    def release(self, peer: int, flat: torch.Tensor) -> None:
        """Hand ``flat`` out no more (a receive into it stays posted)."""
        with self._lock:
            self._cache.pop((threading.get_ident(), peer, flat.nbytes, flat.device), None)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def _path(
    fn: Callable,
    peer: int,
    nbytes: int,
    host: bool,
    group: dist.ProcessGroup | None,
    reverse: dist.ProcessGroup | None,
) -> tuple[dist.ProcessGroup | None, int]:
    """Where a message of ``nbytes`` sent or received (``fn``) with ``peer`` goes.

    Returns its group and the number of pieces it travels in (``host``: the bytes are in
    host memory). Both ends pick both from (source, destination, size) alone, so they
    always agree. Only host messages between machines are split, in pieces of about
    ``_CHUNK_BYTES``: on one machine the pieces cost more than they gain (NCCL coalesces a
    batch itself).
    """
    layout = context.layout()
    downward = (layout.rank > peer) == (fn is dist.isend)
    remote = layout.machine_of[_global(group, peer)] != layout.machine_rank
    whole = not remote or not host or nbytes <= _CHUNK_BYTES
    pieces = 1 if whole else min(MAX_CHUNKS, math.ceil(nbytes / _CHUNK_BYTES))
    return (reverse if reverse is not None and downward else group), pieces


def post_chunks(
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None,
    tag: int | Callable[[int, int], int],
    failed: dict[int, str] | None = None,
    reverse: dist.ProcessGroup | None = None,
) -> list[tuple[int, dist.Work]]:
    """Post every send and receive (flat bytes) at once, in chunks with tags ``tag``, ...

    ``tag`` is a number, or a function of a message's byte count and piece count that
    gives its first tag. Returns ``(global peer, work)`` per posted piece (peer -1 when
    the backend coalesced). With ``failed`` (elastic exchanges), pieces are posted one by
    one and a peer whose post raises a backend error (gloo refuses a pair whose peer died)
    is recorded there with the error, and not posted to again, instead of stopping the
    whole batch. ``reverse``: the group of messages from a higher to a lower rank, when
    ``group`` is not None (over the world, the runtime's second group).
    """
    if group is None:
        reverse = context.reverse_group()
    # Receives before sends: when both ends of a pair post their sends first (a pair
    # swap), gloo can run the pair's two directions in turn, at half the link (a raw
    # 21 MB swap on the emulated 1 Gbit network: 343 ms, against 177-188 ms with
    # receives first; see docs/benchmarks.md).
    ops, peers = [], []
    for fn, pairs in ((dist.irecv, recvs), (dist.isend, sends)):
        for peer, t in pairs:
            via, pieces = _path(fn, peer, t.nbytes, t.device.type == "cpu", group, reverse)
            first = tag(t.nbytes, pieces) if callable(tag) else tag
            for k, piece in enumerate(t.tensor_split(pieces) if pieces > 1 else [t]):
                ops.append(dist.P2POp(fn, piece, group=via, group_peer=peer, tag=first + k))
                peers.append(_global(group, peer))
    if not ops:
        return []
    if failed is not None:
        return _post_each(ops, peers, failed)
    # batch_isend_irecv takes one group; on two groups (gloo) it would post one by one too.
    works = [_post_one(op) for op in ops] if reverse is not None else dist.batch_isend_irecv(ops)
    if len(works) != len(peers):  # a coalescing backend (NCCL) returns one work
        peers = [-1] * len(works)
    return list(zip(peers, works, strict=True))


def _post_one(op: dist.P2POp) -> dist.Work:
    return op.op(op.tensor, group=op.group, tag=op.tag, **{_PEER_ARG[op.op]: op.group_peer})


def _post_each(
    ops: Sequence[dist.P2POp], peers: Sequence[int], failed: dict[int, str]
) -> list[tuple[int, dist.Work]]:
    """Post ``ops`` one at a time; a peer whose post fails goes into ``failed``."""
    posted = []
    for op, peer in zip(ops, peers, strict=True):
        if peer in failed:
            continue
        try:
            work = _post_one(op)
        except RuntimeError as err:
            if not is_backend_error(err):
                raise
            failed[peer] = str(err)
            continue
        posted.append((peer, work))
    return posted


def _data_tag(nbytes: int, pieces: int) -> int:
    """The first tag of an exchange's payload of ``nbytes`` bytes in ``pieces`` pieces.

    A payload of another size never matches a receive posted for this one: gloo aborts the
    process when a message outgrows its receive, and receives are posted before the
    header that would show a mismatched call. The piece count is in the tag too, so that
    no piece matches a receive posted, under another layout of the machines, for a whole
    payload. Both are hashed to 25 bits (Fibonacci hashing), so two sizes share a tag with
    probability 2^-25.
    """
    mixed = ((nbytes * MAX_CHUNKS + pieces) * 0x9E3779B97F4A7C15) % 2**64
    return _DATA_TAGS + (mixed >> 39) * MAX_CHUNKS


# Receives that a mismatched call left posted (gloo cannot withdraw one), by where they
# wait: (group, source, bytes, pieces, device). They belong to the gloo group, which
# outlives gossamer's runtime (a re-init keeps the process group), so they live here.
_UNCLAIMED: dict[tuple, tuple[torch.Tensor, list[tuple[int, dist.Work]]]] = {}


def _unclaimed_key(
    group: dist.ProcessGroup | None, source: int, nbytes: int, device: torch.device
) -> tuple:
    """Where a receive of ``nbytes`` from ``source`` waits, as :data:`_UNCLAIMED` keys it."""
    reverse = context.reverse_group() if group is None else None
    host = device.type == "cpu"
    via, pieces = _path(dist.irecv, source, nbytes, host, group, reverse)
    world = dist.group.WORLD if via is None else via
    return (world, _global(group, source), nbytes, pieces, device)


def _receive(
    sizes: Mapping[int, int],
    group: dist.ProcessGroup | None,
    device: torch.device,
    sends: Sequence[tuple[int, torch.Tensor]] = (),
    failed: dict[int, str] | None = None,
) -> tuple[dict[int, torch.Tensor], list[tuple[int, dist.Work]]]:
    """Post a receive of ``sizes[s]`` bytes from every ``s``, with ``sends`` in one batch.

    Returns each source's buffer and the posted work. One batch, because NCCL runs a
    batch's transfers together but the batches of a stream in turn: two ends that each
    post their receive before their send would each wait for the other. A receive that an
    earlier mismatched call left posted for the same source and size would take this
    one's payload first (gloo matches in order), so it is taken over instead.
    """
    buffers = context.runtime().component("transport.buffers", Buffers)
    flats, works, fresh = {}, [], {}
    for s, n in sizes.items():
        # Almost always empty: the key's routing is then not worked out on every call.
        left = _UNCLAIMED.pop(_unclaimed_key(group, s, n, device), None) if _UNCLAIMED else None
        if left is not None:
            flats[s], adopted = left
            works += adopted
        else:
            flats[s] = fresh[s] = buffers.get(n, device, s)
    works += post_chunks(sends, list(fresh.items()), group, _data_tag, failed)
    return flats, works


class _Edges:
    """The last header this rank sent to, and received from, each peer (a runtime component).

    Both ends of a directed edge record the same header at the same call, because every
    header message sent is received, in order. Where that header is large and the two
    ranks share a machine (:func:`_sticky`), the edge's next first message travels on its
    own tag, and a call that repeats the header exactly sends its payload alone: one gloo
    message instead of two. The receiver cannot know in advance which of the two comes, so
    it writes 8 random bytes at the end of its receive: a payload fills the receive and
    overwrites them, a header's message (at most ``_CHUNK_BYTES``) leaves them.
    """

    def __init__(self) -> None:
        self.sent: dict[tuple[str, int], Header] = {}
        self.got: dict[tuple[str, int], Header] = {}


def _edge(group: dist.ProcessGroup | None, peer: int) -> tuple[str, int]:
    return ("" if group is None else group.group_name, _global(group, peer))


def _sticky(last: Header | None, peer: int, group: dist.ProcessGroup | None) -> bool:
    """Whether an edge whose last header was ``last`` may carry a payload without it."""
    if last is None or nbytes_of(last.dtype, last.numel) < _STICKY_BYTES:
        return False
    layout = context.layout()
    same = layout.machine_of[_global(group, peer)] == layout.machine_rank
    return same and context.backend() == "gloo"


def _wire(header: Header) -> Header:
    """``header`` as its receiver decodes it (dims past the tenth folded)."""
    return Header.decode(header.encode())


def _firsts(
    mine: Header, sends: Mapping[int, torch.Tensor], group: dist.ProcessGroup | None
) -> tuple[dict[int, list[tuple[int, torch.Tensor]]], list[tuple[int, torch.Tensor]]]:
    """Each destination's first message by tag, and the payloads that travel apart.

    A first message is the header, then the payload if that fits (a gloo message costs a
    round of notifications between the pair's threads; a header that carries its payload
    saves one, at the price of copying the payload), or, on an edge where the call
    repeats (:class:`_Edges`), the payload alone.
    """
    staging = context.runtime().component("transport.firsts_out", Buffers)
    edges = context.runtime().component("transport.edges", _Edges)
    wire = _wire(mine)
    firsts: dict[int, list[tuple[int, torch.Tensor]]] = {_HEADER_TAG: [], _STICKY_TAG: []}
    rests = []
    for d, t in sends.items():
        head, head_wire = mine, wire
        if tuple(t.shape) != mine.shape or t.dtype != mine.dtype:  # e.g. per-edge STC sizes
            head = replace(mine, dtype=t.dtype, shape=tuple(t.shape))
            head_wire = _wire(head)
        payload, edge = as_bytes(t), _edge(group, d)
        last = edges.sent.get(edge)
        sticky = _sticky(last, d, group)
        if sticky and last == head_wire and payload.device.type == "cpu":
            firsts[_STICKY_TAG].append((d, payload))
            continue
        fits = payload.device.type == "cpu" and payload.nbytes <= _INLINE_BYTES
        inline = payload.nbytes if fits else 0
        first = staging.get(_HEAD_BYTES + inline, _CPU, d)
        first[:_HEAD_BYTES].copy_(as_bytes(replace(head, inline=inline).encode()))
        first[_HEAD_BYTES:].copy_(payload[:inline])
        firsts[_STICKY_TAG if sticky else _HEADER_TAG].append((d, first))
        edges.sent[edge] = head_wire
        if payload.nbytes > inline:
            rests.append((d, payload))
    return firsts, rests


@dataclass
class _Inbox:
    """Each source's receive for its first message.

    Attributes:
        buffers: source -> receive buffer.
        repeats: source -> the header its payload alone stands for (a sticky edge).
        mark: the 8 bytes written at the end of each sticky edge's receive.
    """

    buffers: dict[int, torch.Tensor]
    repeats: dict[int, Header]
    mark: torch.Tensor


def _inbox(sources: Sequence[int], group: dist.ProcessGroup | None) -> _Inbox:
    """A receive buffer per source for its first message, as large as it may be."""
    runtime = context.runtime()
    edges = runtime.component("transport.edges", _Edges)
    # A repeated payload arrives in the buffer it would arrive in apart: no extra memory.
    data = runtime.component("transport.buffers", Buffers)
    plain = runtime.component("transport.firsts_in", Buffers)
    mark = torch.frombuffer(bytearray(os.urandom(8)), dtype=torch.uint8)
    buffers, repeats = {}, {}
    for s in sources:
        last = edges.got.get(_edge(group, s))
        if _sticky(last, s, group):
            buffers[s] = data.get(nbytes_of(last.dtype, last.numel), _CPU, s)
            buffers[s][-8:].copy_(mark)
            repeats[s] = last
        else:
            buffers[s] = plain.get(_CHUNK_BYTES, _CPU, s)
    return _Inbox(buffers, repeats, mark)


def _post_firsts(
    firsts: Mapping[int, list[tuple[int, torch.Tensor]]],
    inbox: _Inbox,
    group: dist.ProcessGroup | None,
    failed: dict[int, str] | None = None,
) -> list[tuple[int, dist.Work]]:
    """Post the first messages and their receives, one batch per tag."""
    recvs: dict[int, list[tuple[int, torch.Tensor]]] = {_HEADER_TAG: [], _STICKY_TAG: []}
    for s, buffer in inbox.buffers.items():
        recvs[_STICKY_TAG if s in inbox.repeats else _HEADER_TAG].append((s, buffer))
    posted = []
    for tag, pairs in recvs.items():
        if pairs or firsts[tag]:
            posted += post_chunks(firsts[tag], pairs, group, tag, failed)
    return posted


def _read(
    inbox: _Inbox, sources: Sequence[int], group: dist.ProcessGroup | None
) -> tuple[dict[int, Header], dict[int, torch.Tensor]]:
    """The headers of ``sources``' first messages and the payload bytes they carried."""
    edges = context.runtime().component("transport.edges", _Edges)
    theirs, carried = {}, {}
    for s in sources:
        first, last = inbox.buffers[s], inbox.repeats.get(s)
        if last is not None and not torch.equal(first[-8:], inbox.mark):
            theirs[s], carried[s] = replace(last, inline=first.nbytes), first
            continue
        theirs[s] = _decode(first)
        carried[s] = first[_HEAD_BYTES : _HEAD_BYTES + theirs[s].inline]
        edges.got[_edge(group, s)] = replace(theirs[s], inline=0)
    return theirs, carried


def _sent_bytes(
    firsts: Mapping[int, list[tuple[int, torch.Tensor]]], rests: list[tuple[int, torch.Tensor]]
) -> int:
    return sum(t.nbytes for _, t in [*firsts[_HEADER_TAG], *firsts[_STICKY_TAG], *rests])


def _decode(first: torch.Tensor) -> Header:
    return Header.decode(first[:_HEAD_BYTES].view(torch.int64))


def _rest_sizes(theirs: Mapping[int, Header]) -> dict[int, int]:
    """The byte count of each source's payload that travels apart from its header."""
    sizes = {s: nbytes_of(h.dtype, h.numel) - h.inline for s, h in theirs.items()}
    return {s: n for s, n in sizes.items() if n > 0}


def _payloads(
    theirs: Mapping[int, Header],
    carried: Mapping[int, torch.Tensor],
    rests: Mapping[int, torch.Tensor],
    device: torch.device,
) -> dict[int, torch.Tensor]:
    """Each source's payload bytes: from its first message, or its own receive."""
    return {s: rests[s] if s in rests else carried[s].to(device) for s in theirs}


def _headers_and_data(
    op: str,
    mine: Header,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None,
    device: torch.device,
    early: bool = False,
) -> tuple[dict[int, Header], dict[int, torch.Tensor]]:
    """Send ``mine`` and ``sends[d]`` to every ``d``; receive both from every source.

    Returns the sources' headers and their payloads (flat bytes, sized from the headers).
    A payload that fits travels in its header's message, and on an edge that repeats its
    last call, a payload travels alone in its place (:func:`_firsts`). With ``early``
    (gloo only: it posts receives and sends apart), the other payloads are sent and
    received with the headers, each receive sized from ``mine``, and a payload of another
    size (a mismatched call) is received once its header arrived: the header costs no
    round trip before the data. Otherwise they move after every header arrived.
    """
    firsts, rests = _firsts(mine, sends, group)
    inbox = _inbox(sources, group)
    expected = nbytes_of(mine.dtype, mine.numel)
    # A sticky edge's payload of this size arrives in its first message's buffer, or after
    # its header, into the same buffer.
    alone = [s for s in inbox.repeats if inbox.buffers[s].nbytes == expected]
    apart = {s: expected for s in sources if s not in alone and expected > _INLINE_BYTES}
    with timeline.record(op, "communicating"):
        first_works = _post_firsts(firsts, inbox, group)
        flats, works = _receive(apart, group, device) if early else ({}, [])
        sent = post_chunks(rests, [], group, _data_tag) if early else []
        wait_works(op, first_works)
        theirs, carried = _read(inbox, sources, group)
        sizes = _rest_sizes(theirs)
        buffers = context.runtime().component("transport.buffers", Buffers)
        for s in [s for s in flats if flats[s].nbytes != sizes.get(s)]:
            peer = _global(group, s)  # gloo gives a work per transfer: keep the peer's
            buffers.release(s, flats[s])
            kept = (flats.pop(s), [w for w in works if w[0] == peer])
            _UNCLAIMED[_unclaimed_key(group, s, expected, device)] = kept
            works = [w for w in works if w[0] != peer]
        late, late_works = _receive(
            {s: n for s, n in sizes.items() if s not in flats},
            group,
            device,
            [] if early else rests,
        )
        count_sent(op, _sent_bytes(firsts, rests))
        wait_works(op, works + late_works + sent)
    return theirs, _payloads(theirs, carried, flats | late, device)


def _text(data: torch.Tensor) -> str:
    return bytes(data.cpu().tolist()).decode(errors="replace")


def exchange(
    op: str,
    tensor: torch.Tensor,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    any_first_dim: bool = False,
    codec: int = 0,
) -> dict[int, torch.Tensor]:
    """Send ``sends[d]`` to every ``d`` and receive one tensor from every rank in ``sources``.

    Ranks are ranks of ``group``. ``tensor`` is this rank's argument, against which the
    peers' headers are checked (all dims, or all but the first with ``any_first_dim``),
    and the payload codec: a compressed payload names its compressor with ``codec``. A
    ``sends[d]`` of another shape or dtype than ``tensor`` (a per-edge payload of variable
    size) travels under a header of its own shape.

    The returned tensors are reused by the next exchange: consume them before returning.

    Raises:
        PeerArgumentError: a source rejected its arguments (see
            :mod:`~gossamer.transport.rejection`); raised after every transfer completed.
        PeerError: a source called another operation, dtype or shape. The data is still
            received (and dropped) first, so the sender does not hang.
    """
    mine = Header.of(op, tensor, codec=codec)
    early = not any_first_dim and tensor.device.type == "cpu" and context.backend() == "gloo"
    theirs, raw = _headers_and_data(op, mine, sends, sources, group, tensor.device, early)
    refused = {h.slot: _text(raw[s]) for s, h in theirs.items() if h.op == REJECTED}
    if refused:
        raise peer_argument_error(op, refused)
    _check_match(op, mine, theirs, group, any_first_dim)
    return {s: from_bytes(raw[s], h.dtype, _shape(h, mine)) for s, h in theirs.items()}


def _check_match(
    op: str,
    mine: Header,
    theirs: Mapping[int, Header],
    group: dist.ProcessGroup | None,
    any_first_dim: bool = False,
) -> None:
    """Raise :class:`PeerError` naming every source whose call differs from ``mine``."""
    # The peers' headers were decoded, dims past the tenth folded: fold this rank's too.
    folded = any(len(h.shape) != len(mine.shape) for h in theirs.values())
    wire = _wire(mine) if folded else mine
    wrong = [s for s, h in theirs.items() if not wire.matches(h, any_first_dim)]
    if wrong:
        text = "; ".join(f"rank {_global(group, s)} called {theirs[s].describe()}" for s in wrong)
        raise PeerError(
            f"{op}: mismatched call: rank {context.rank()} called {mine.describe()}, but {text}"
        )


def _shape(theirs: Header, mine: Header) -> tuple[int, ...]:
    """The shape of a matching source's tensor: its header's, unfolded by this rank's own."""
    if len(theirs.shape) == len(mine.shape):
        return theirs.shape
    return (theirs.shape[0], *mine.shape[1:])


def exchange_rejected(
    op: str,
    reason: str,
    dsts: Sequence[int],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    origin: int | None = None,
) -> None:
    """This rank's part of an :func:`exchange` whose arguments it (or ``origin``) rejected.

    Sends a ``"rejected"`` header and ``reason`` to ``dsts`` (group ranks), and receives and
    drops what ``sources`` send, so that no peer's message goes unmatched.
    """
    device = device if device is not None else context.device()
    data = torch.frombuffer(bytearray(reason.encode()), dtype=torch.uint8).to(device)
    _headers_and_data(
        op, rejected_header(op, reason, origin), dict.fromkeys(dsts, data), sources, group, device
    )


def check_same_call(
    op: str,
    tensor: torch.Tensor | None,
    group: dist.ProcessGroup | None,
    aux: int = 0,
    *,
    any_first_dim: bool = False,
    rejection: str | None = None,
    codec: int = 0,
    explain: Callable[[int], str] | None = None,
) -> list[tuple[int, ...]]:
    """Check that every rank of ``group`` made the same call; return every rank's shape.

    ``codec`` names the compressor of a compressed payload (checked like the dtype);
    ``explain(aux)`` says what ``aux`` means, for the error (``"root 2"``).

    With ``rejection`` (a reason), this rank takes part in a call whose arguments it
    rejected: ``tensor`` is ignored, every other rank raises, and this one returns ``[]``.

    Raises:
        PeerArgumentError: on every other rank, when a rank rejected its arguments.
        PeerError: on every rank alike, naming the ranks whose call differs from rank 0's.
    """
    if rejection is not None:
        mine = rejected_header(op, rejection).encode()
    else:
        mine = Header.of(op, tensor, aux=aux, codec=codec).encode()
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    with timeline.record(op, "communicating"):
        wait_works(op, [(-1, dist.all_gather(gathered, mine, group=group, async_op=True))])
    count_collective(op, "all_gather", mine.nbytes, size)
    heads = [Header.decode(h) for h in gathered]
    if any(h.op == REJECTED for h in heads):
        lengths = [h.numel if h.op == REJECTED else 0 for h in heads]
        texts = gather_reasons(op, lengths, rejection, group)
        if rejection is not None:
            return []
        refused = {h.slot: texts[r] for r, h in enumerate(heads) if h.op == REJECTED}
        raise peer_argument_error(op, refused)
    first = heads[0]
    wrong = [r for r, h in enumerate(heads) if not first.matches(h, any_first_dim)]
    if wrong:

        def said(head: Header) -> str:  # explain() knows this op's aux, not another's
            return head.describe(explain if head.op == op else None)

        text = "; ".join(f"rank {r} called {said(heads[r])}" for r in wrong)
        raise PeerError(f"{op}: mismatched call: rank 0 called {said(first)}, but {text}")
    return [h.shape for h in heads]


_CONFIRM_POLL_S = 0.1


@dataclass
class Survived:
    """The result of :func:`exchange_surviving`.

    Attributes:
        received: group rank -> tensor, from every source that delivered.
        lost: global ranks whose transfers failed and whose heartbeats stopped.
        epoch: the highest membership epoch among the received headers.
    """

    received: dict[int, torch.Tensor] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    epoch: int = 0


def _wait_each(works: Sequence[tuple[int, dist.Work]]) -> dict[int, str]:
    """Wait for every work; return the peers whose work failed (backend error), with it."""
    failed: dict[int, str] = {}
    for peer, work in works:
        try:
            work.wait()
        except RuntimeError as err:
            if not is_backend_error(err):
                raise
            failed.setdefault(peer, str(err))
    return failed


def _confirm_dead(op: str, failed: dict[int, str]) -> None:
    """Return once every rank of ``failed`` is found dead by its heartbeat, else raise."""
    if -1 in failed:
        raise PeerError(f"{op}: a coalesced transfer failed (elastic gossip needs gloo)")
    live = get_liveness()
    deadline = time.monotonic() + (live.dead_after if live else DEAD_AFTER_S) + 2 * BEAT_S
    while True:
        lost = live.check() if live is not None else set()
        if set(failed) <= lost:
            return
        if time.monotonic() >= deadline:
            alive = sorted(set(failed) - lost)
            raise PeerError(
                f"{op}: transfers with ranks {alive} failed, but their heartbeats go on; "
                f"this is not a death the survivors can train through ({failed[alive[0]]})"
            )
        time.sleep(_CONFIRM_POLL_S)


def exchange_surviving(
    op: str,
    tensor: torch.Tensor,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    epoch: int = 0,
    codec: int = 0,
) -> Survived:
    """Send ``sends[d]`` to every ``d``, receive from ``sources``; survive dead peers.

    Ranks are ranks of ``group``; the header of this rank carries ``epoch`` and the payload
    ``codec`` (checked against the sources' as the shape is). Transfers with
    dead peers are dropped (the result names them in ``lost``); the returned tensors are
    reused by the next exchange: consume them first.

    Raises:
        PeerArgumentError: a source rejected its arguments.
        PeerError: a source called another operation or shape, or a transfer failed with a
            rank whose heartbeat goes on.
    """
    mine = Header.of(op, tensor, epoch=epoch, codec=codec)
    firsts, rests = _firsts(mine, sends, group)
    inbox = _inbox(sources, group)
    with timeline.record(op, "communicating"):
        failed: dict[int, str] = {}
        posted = _post_firsts(firsts, inbox, group, failed)
        failed.update(_wait_each(posted))
        alive = [s for s in sources if _global(group, s) not in failed]
        theirs, carried = _read(inbox, alive, group)
        rests = [(d, t) for d, t in rests if _global(group, d) not in failed]
        apart, posted = _receive(_rest_sizes(theirs), group, tensor.device, rests, failed)
        count_sent(op, _sent_bytes(firsts, rests))
        failed.update(_wait_each(posted))
    if failed:
        _confirm_dead(op, failed)
    theirs = {s: h for s, h in theirs.items() if _global(group, s) not in failed}
    raw = _payloads(theirs, carried, apart, tensor.device)
    refused = {h.slot: _text(raw[s]) for s, h in theirs.items() if h.op == REJECTED}
    if refused:
        raise peer_argument_error(op, refused)
    _check_match(op, mine, theirs, group)
    received = {s: from_bytes(raw[s], h.dtype, _shape(h, mine)) for s, h in theirs.items()}
    top = max([epoch, *(h.epoch for h in theirs.values())])
    return Survived(received, set(failed), top)
