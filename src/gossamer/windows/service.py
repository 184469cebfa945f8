"""The window service: progress threads, one per peer, that serve one-sided requests.

torch.distributed has no remote memory access, so a put is a message: the origin sends a
header and a payload, the target's progress thread for that origin writes the payload into
the origin's slot under the window's lock and acknowledges, and the origin's request
completes on the acknowledgement. The target never has to call anything for a put to land.

Every message is a :class:`~gossamer.transport.Header` (the same codec as the operations')
on one tag; each payload travels on a tag of its own request, so concurrent requests never
mix. Each peer has its own progress thread, receiving from that peer only: gloo fails a
receive from *any* source for good once one peer's connection breaks in the middle of a
message, so with one thread per peer a dead peer ends only its own thread, and elastic
windows serve on. The progress threads only post non-blocking sends, so two ranks
answering each other cannot deadlock; one more thread waits for those sends in order and
then drops them (a gloo send reports completion only to ``wait``, so the sends cannot be
polled). A peer's thread stops on a STOP message from that peer (stopping is collective),
never on a timeout.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from datetime import timedelta
from enum import Enum

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.combine import add_into
from gossamer.compression import Compressor, Payload, get_compressor
from gossamer.errors import CommunicationTimeout, PeerError, WindowError
from gossamer.profiling import count_sent
from gossamer.transport import (
    DTYPES,
    HEADER_LEN,
    Header,
    as_bytes,
    find_lost,
    get_liveness,
    get_membership,
    lost_error,
    nbytes_of,
)

__all__ = ["COMPRESSED", "WINDOW_DTYPES", "Kind", "Service", "WindowState", "compressed_message"]

logger = logging.getLogger("gossamer.windows")

_HEADER_TAG = 0x7701
# How long the progress thread may wait for the next request (a window may sit unused).
_IDLE = timedelta(days=365)
_PAYLOAD_TAG_BASE = 1 << 20
# Payloads travel as bytes (gloo has no kernels for some dtypes), so any dtype with a wire code.
WINDOW_DTYPES = DTYPES
# The header codec of a compressed put or accumulate: the payload names its compressor.
COMPRESSED = 1


class Kind(Enum):
    """Message kinds; each value is the operation name in the call header."""

    PUT = "window.put"
    ACCUMULATE = "window.accumulate"
    GET = "window.get"
    REPLY = "window.reply"
    ACK = "window.ack"
    NACK = "window.nack"
    LOCK = "window.lock"
    GRANT = "window.grant"
    UNLOCK = "window.unlock"
    STOP = "window.stop"


@dataclass
class _Mutex:
    """One (owner, peer) lock: its holder and a FIFO of waiters."""

    holder: object = None
    waiters: deque = field(default_factory=deque)


@dataclass
class WindowState:
    """What a rank holds for one window: its tensor, one buffer per in-neighbour, and so on."""

    wid: int
    name: str
    tensor: torch.Tensor
    buffers: dict[int, torch.Tensor]
    versions: dict[int, int]
    p_buffers: dict[int, float]
    p: float = 1.0
    push_sum: bool = False
    elastic: bool = False  # operations skip dead peers (requests.issue)
    lock: threading.Lock = field(default_factory=threading.Lock)
    mutexes: dict[int, _Mutex] = field(default_factory=dict)
    staging: dict[int, torch.Tensor] = field(default_factory=dict)
    # Compressed puts (all host tensors of the window's shape). At the origin: what each
    # destination's copy of this rank holds, and accumulate's error-feedback residuals;
    # at the target: the copy of each source, which compressed puts update by their deltas.
    sent: dict[int, torch.Tensor] = field(default_factory=dict)
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    replicas: dict[int, torch.Tensor] = field(default_factory=dict)
    compressors: dict[str, Compressor] = field(default_factory=dict)

    def stage(self, peer: int) -> torch.Tensor:
        """A host buffer of the window's shape to receive ``peer``'s payload into."""
        if peer not in self.staging:
            self.staging[peer] = torch.empty(self.tensor.shape, dtype=self.tensor.dtype)
        return self.staging[peer]


def _drain(h: Header) -> torch.Tensor:
    """Bytes to receive (and drop) the payload that header ``h`` announced."""
    return torch.empty(nbytes_of(h.dtype, h.numel), dtype=torch.uint8)


def _header(
    kind: Kind,
    wid: int,
    req: int,
    numel: int = 0,
    dtype: torch.dtype = torch.float32,
    value: float = 0.0,
    slot: int = 0,
    codec: int = 0,
) -> torch.Tensor:
    return Header(
        kind.value, dtype, (numel,), seq=req, aux=wid, slot=slot, codec=codec, value=value
    ).encode()


def compressed_message(compressor: Compressor, payload: Payload) -> torch.Tensor:
    """One byte of name length, the compressor's registry name, then the payload's bytes.

    Self-describing, so the target decodes with what the origin chose (one call's choice,
    not a setting both sides must share); the name costs ``1 + len(name)`` bytes.
    """
    name = compressor.name.encode()
    if len(name) > 255:
        raise ValueError(f"compression name must be at most 255 bytes; got {compressor.name!r}")
    head = torch.tensor([len(name), *name], dtype=torch.uint8)
    return torch.cat([head, payload.buffer.to("cpu")])


class Service:
    """Messaging, lock tables and the progress threads of one rank."""

    def __init__(self, groups: tuple[dist.ProcessGroup, dist.ProcessGroup]) -> None:
        # Messages to a higher rank travel on the first group, to a lower one on the second,
        # so each direction of a pair has a connection of its own. On one group, two ranks
        # that put to each other ran their payloads in turn: a 21 MB put to both
        # exponential-two neighbours took 524-531 ms on 4 emulated 1 Gbit hosts, the raw
        # exchange of the same bytes 357-370 ms; 369-397 ms on two groups.
        self.groups = groups
        self.rank = dist.get_rank(groups[0])
        self.size = dist.get_world_size(groups[0])
        self.windows: dict[int, WindowState] = {}
        self._codecs: dict[str, Compressor] = {}  # compressed puts' decoders, by name
        self._ids = itertools.count(1)
        self._pending: dict[int, concurrent.futures.Future] = {}
        # The progress thread's sends, oldest first, until the reaper has waited for them.
        self._sends: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._broken: Exception | None = None
        self._aborted = False
        self._stopping = threading.Lock()  # orders abort()'s STOP after every reply
        self._threads = {
            peer: threading.Thread(
                target=self._serve, args=(peer,), name=f"gossamer-windows-{peer}", daemon=True
            )
            for peer in range(self.size)
            if peer != self.rank
        }
        for thread in self._threads.values():
            thread.start()
        self._reaper = threading.Thread(
            target=self._reap, name="gossamer-windows-reaper", daemon=True
        )
        self._reaper.start()

    # ----------------------------------------------------------------- origin side
    def request(
        self,
        kind: Kind,
        target: int,
        wid: int,
        *,
        payload: torch.Tensor | None = None,
        value: float = 0.0,
        slot: int = 0,
        codec: int = 0,
    ) -> tuple[concurrent.futures.Future, list]:
        """Send a request to ``target``; the future completes on its answer."""
        self.check()
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            req = next(self._ids)
            self._pending[req] = future
        numel = 0 if payload is None else payload.numel()
        dtype = torch.float32 if payload is None else payload.dtype
        head = _header(kind, wid, req, numel, dtype, value, slot, codec)
        try:
            group = self._to(target)
            sends = [(group.send([head], target, _HEADER_TAG), head)]
            if payload is not None:
                tag = _PAYLOAD_TAG_BASE + req % (1 << 30)
                data = as_bytes(payload)
                sends.append((group.send([data], target, tag), data))
        except RuntimeError as err:
            with self._lock:
                self._pending.pop(req, None)
            raise PeerError(
                f"window {kind.name.lower()}: cannot reach rank {target} ({err}); "
                "did that rank crash or exit?"
            ) from err
        count_sent(kind.value, sum(t.nbytes for _, t in sends))
        return future, sends

    def wait(
        self, what: str, target: int, future: concurrent.futures.Future, sends: list
    ) -> object:
        """Wait for a request's sends and its answer, within the deadline.

        The answer is waited for a second at a time: a target that died after taking the
        request raises :class:`~gossamer.errors.RankLostError` once its heartbeat stops,
        instead of holding this thread to the deadline (and the process's exit, which
        joins the thread, with it).
        """
        for work, _ in sends:
            try:
                work.wait()
            except RuntimeError as err:
                raise PeerError(
                    f"{what}: sending to rank {target} failed ({err}); did that rank crash or exit?"
                ) from err
        limit = context.timeout()
        deadline = time.monotonic() + limit
        while True:
            try:
                return future.result(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
            except concurrent.futures.TimeoutError:
                if future.done():
                    raise
            if target in find_lost(patient=False):
                raise lost_error(what, {target})
            if time.monotonic() >= deadline:
                raise CommunicationTimeout(
                    f"{what}: rank {target} did not answer within {limit:g} s"
                ) from None

    def _to(self, peer: int) -> dist.ProcessGroup:
        """The group of this rank's messages to ``peer``."""
        return self.groups[peer < self.rank]

    def _from(self, peer: int) -> dist.ProcessGroup:
        """The group of ``peer``'s messages to this rank."""
        return self.groups[self.rank < peer]

    def check(self) -> None:
        """Raise if the progress thread has failed."""
        if self._broken is not None:
            raise PeerError(f"the window service of rank {self.rank} failed: {self._broken}")

    # ------------------------------------------------------------------ lock tables
    def acquire_local(self, state: WindowState, slot: int) -> None:
        """Take this rank's own mutex ``slot`` of ``state`` (FIFO with remote requests)."""
        event = threading.Event()
        with state.lock:
            mutex = state.mutexes.setdefault(slot, _Mutex())
            if mutex.holder is None:
                mutex.holder = ("local", event)
                event.set()
            else:
                mutex.waiters.append(("local", event))
        deadline = context.timeout()
        while not event.wait(timeout=min(deadline, 1.0)):
            self.check()
            with state.lock:
                holder = mutex.holder
            if holder and holder[0] == "remote" and holder[1] in find_lost(patient=False):
                with state.lock:
                    mutex.waiters = deque(w for w in mutex.waiters if w[1] is not event)
                raise lost_error(
                    f"window {state.name!r}: mutex slot {slot} of rank {self.rank}", {holder[1]}
                )
            deadline -= 1.0
            if deadline <= 0:
                with state.lock:
                    mutex.waiters = deque(w for w in mutex.waiters if w[1] is not event)
                    holder = mutex.holder
                who = f"rank {holder[1]}" if holder and holder[0] == "remote" else "this rank"
                raise CommunicationTimeout(
                    f"window {state.name!r}: mutex slot {slot} of rank {self.rank}, held by "
                    f"{who}, was not released within {context.timeout():g} s (did it die?)"
                )

    def release(self, state: WindowState, slot: int) -> None:
        """Release mutex ``slot`` of ``state`` and hand it to the next waiter."""
        with state.lock:
            mutex = state.mutexes.setdefault(slot, _Mutex())
            mutex.holder = mutex.waiters.popleft() if mutex.waiters else None
            nxt = mutex.holder
        if nxt is None:
            return
        if nxt[0] == "local":
            nxt[1].set()
        else:
            _, origin, req = nxt
            self._post(origin, _header(Kind.GRANT, state.wid, req))

    # ------------------------------------------------------------------ target side
    def _post(self, dst: int, *tensors_and_tags: object) -> None:
        """Non-blocking sends from the progress thread (kept alive until they complete)."""
        head = tensors_and_tags[0]
        # Called from the progress thread and from release() on any thread. A dropped Work
        # would cancel its send, so each one stays queued until the reaper has waited for it.
        with self._stopping:
            if self._aborted:
                # The peer stops reading this rank at abort()'s STOP: a send after it would
                # keep the reaper, and this rank's exit, waiting for the group's timeout.
                return
            group = self._to(dst)
            self._sends.put((group.send([head], dst, _HEADER_TAG), head))
            sent = head.nbytes
            if len(tensors_and_tags) > 1:
                payload, tag = tensors_and_tags[1], tensors_and_tags[2]
                self._sends.put((group.send([payload], dst, tag), payload))
                sent += payload.nbytes
        count_sent(Header.decode(head).op, sent)

    def _reap(self) -> None:
        """Wait for the progress thread's sends in order and drop them (until ``None``).

        ``Work.is_completed()`` of a gloo send stays False until ``wait`` is called, so the
        sends cannot be polled (and a ``wait`` with a timeout closes the group's pairs when
        it expires). A blocking ``wait`` is safe here, off the progress thread: a peer's
        progress thread keeps a header receive posted while it runs.
        """
        while (item := self._sends.get()) is not None:
            work, _ = item
            try:
                work.wait()
            except RuntimeError as err:  # the peer is gone; its requester reports that
                logger.debug("window service: a send from rank %d failed: %s", self.rank, err)

    def _recv_payload(self, src: int, req: int, out: torch.Tensor) -> None:
        self._from(src).recv([out], src, _PAYLOAD_TAG_BASE + req % (1 << 30)).wait()

    def _serve(self, src: int) -> None:
        """Serve ``src``'s messages in order until its STOP (or its death)."""
        handlers: dict[int, Callable] = {
            Kind.PUT: self._on_write,
            Kind.ACCUMULATE: self._on_write,
            Kind.GET: self._on_get,
            Kind.REPLY: self._on_reply,
            Kind.ACK: self._on_answer,
            Kind.NACK: self._on_answer,
            Kind.GRANT: self._on_answer,
            Kind.LOCK: self._on_lock,
            Kind.UNLOCK: self._on_unlock,
        }
        encoded = torch.empty(HEADER_LEN, dtype=torch.int64)
        while True:
            try:
                # Waiting for the next request is idle time, not a deadline: the group's
                # timeout (the runtime's) bounds every other wait of the service.
                self._from(src).recv([encoded], src, _HEADER_TAG).wait(_IDLE)
                head = Header.decode(encoded)
                try:
                    kind = Kind(head.op)
                except ValueError:
                    raise PeerError(
                        f"rank {src} sent {head.describe()} to the window service"
                    ) from None
                if kind == Kind.STOP:
                    return
                handlers[kind](kind, src, head)
            except Exception as err:
                if self._aborted:  # abort() ended the receive
                    return
                if src in find_lost(peer=src):
                    self._peer_died(src)
                else:  # a live peer spoke nonsense, or the group broke: fail every waiter
                    self._fail(err)
                return

    def _peer_died(self, src: int) -> None:
        """``src``'s thread ends; the service serves the others on.

        A request of this rank to ``src`` fails through the loss watchdog (or is dropped,
        on an elastic window), so nothing else changes here. When every window is elastic
        the death is reported to the membership.
        """
        if self.windows and all(s.elastic for s in self.windows.values()):
            get_membership().report({src})
        logger.warning("window service of rank %d serves on without rank %d", self.rank, src)

    def _fail(self, err: Exception) -> None:
        logger.error("window service of rank %d stopped: %s", self.rank, err)
        self._broken = err
        with self._lock:
            pending, self._pending = self._pending, {}
        for future in pending.values():
            if not future.done():
                future.set_exception(PeerError(f"window service failed: {err}"))

    def _state(self, wid: int) -> WindowState | None:
        return self.windows.get(wid)

    def _decode(self, data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """The tensor a :func:`compressed_message` encodes (ValueError if it does not fit)."""
        length = int(data[0])
        name = bytes(data[1 : 1 + length].tolist()).decode()
        if name not in self._codecs:
            self._codecs[name] = get_compressor(name)
        payload = Payload(data[1 + length :].clone(), like.shape, like.dtype)
        return self._codecs[name].decompress(payload)

    def _on_compressed(self, kind: Kind, src: int, h: Header) -> None:
        """A compressed put (a delta to this source's copy) or accumulate (a summand)."""
        wid, req, value = h.aux, h.seq, h.value
        state = self._state(wid)
        data = torch.empty(h.numel, dtype=torch.uint8)
        self._recv_payload(src, req, data)
        try:
            if state is None or src not in state.buffers:
                raise ValueError("no such window or slot")
            delta = self._decode(data, state.buffers[src])
        except (ValueError, TypeError, UnicodeDecodeError):
            self._post(src, _header(Kind.NACK, wid, req))
            return
        with state.lock:
            if kind == Kind.PUT:
                replica = state.replicas.get(src)
                if replica is None:
                    replica = state.replicas[src] = torch.zeros_like(delta)
                replica.add_(delta)
                state.buffers[src].copy_(replica)
                state.versions[src] += 1
                state.p_buffers[src] = value
            else:
                state.buffers[src].add_(delta)
                state.p_buffers[src] += value
        self._post(src, _header(Kind.ACK, wid, req))

    def _on_write(self, kind: Kind, src: int, h: Header) -> None:
        if h.codec == COMPRESSED:
            self._on_compressed(kind, src, h)
            return
        wid, req, value = h.aux, h.seq, h.value
        state = self._state(wid)
        if (
            state is None
            or src not in state.buffers
            or state.tensor.numel() != h.numel
            or state.tensor.dtype != h.dtype
        ):
            self._recv_payload(src, req, _drain(h))
            self._post(src, _header(Kind.NACK, wid, req))
            return
        stage = state.stage(src)
        self._recv_payload(src, req, as_bytes(stage))
        with state.lock:
            if kind == Kind.PUT:
                state.buffers[src].copy_(stage)
                state.versions[src] += 1
                state.p_buffers[src] = value
            else:
                add_into(state.buffers[src], stage)
                state.p_buffers[src] += value
        self._post(src, _header(Kind.ACK, wid, req))

    def _on_get(self, kind: Kind, src: int, h: Header) -> None:
        wid, req = h.aux, h.seq
        state = self._state(wid)
        if state is None:
            self._post(src, _header(Kind.NACK, wid, req))
            return
        with state.lock:
            copy = state.tensor.detach().to("cpu", copy=True).contiguous()
        self._post(
            src,
            _header(Kind.REPLY, wid, req, copy.numel(), copy.dtype),
            as_bytes(copy),
            _PAYLOAD_TAG_BASE + req % (1 << 30),
        )

    def _on_reply(self, kind: Kind, src: int, h: Header) -> None:
        wid, req = h.aux, h.seq
        state = self._state(wid)
        stage = state.stage(src) if state is not None else None
        self._recv_payload(src, req, _drain(h) if stage is None else as_bytes(stage))
        if state is not None:
            with state.lock:
                state.buffers[src].copy_(stage)
                state.versions[src] += 1
        self._on_answer(Kind.ACK, src, h)

    def _on_answer(self, kind: Kind, src: int, h: Header) -> None:
        with self._lock:
            future = self._pending.pop(h.seq, None)
        if future is None:
            return
        if kind == Kind.NACK:
            future.set_exception(
                WindowError(
                    f"rank {src} refused the request: it has no such window (freed?), or this "
                    "rank is not its in-neighbour there, or the shape differs"
                )
            )
        else:
            future.set_result(None)

    def _on_lock(self, kind: Kind, src: int, h: Header) -> None:
        wid, req, slot = h.aux, h.seq, h.slot
        state = self._state(wid)
        if state is None:
            self._post(src, _header(Kind.NACK, wid, req))
            return
        with state.lock:
            mutex = state.mutexes.setdefault(slot, _Mutex())
            granted = mutex.holder is None
            if granted:
                mutex.holder = ("remote", src, req)
            else:
                mutex.waiters.append(("remote", src, req))
        if granted:
            self._post(src, _header(Kind.GRANT, wid, req))

    def _on_unlock(self, kind: Kind, src: int, h: Header) -> None:
        state = self._state(h.aux)
        if state is not None:
            self.release(state, h.slot)
        self._post(src, _header(Kind.ACK, h.aux, h.seq))

    # ------------------------------------------------------------------ lifecycle
    def abort(self, told: Collection[int] = ()) -> None:
        """Stop without the peers (a rank was lost, so the collective stop cannot run).

        ``told``: peers :meth:`stop` has already sent STOP. They get no second one: a peer
        that has stopped its service receives nothing more, and a send to it would wait for
        the group's timeout.

        A progress thread left inside gloo's wait when the interpreter exits would abort
        the process, and aborting the group does not end a receive from one peer: so this
        rank sends STOP to every peer not known lost, which ends their threads for it (they
        do the same when they stop), and the threads for dead peers end on their broken
        connections.
        """
        live = get_liveness()
        lost = live.lost if live is not None else set()
        head = _header(Kind.STOP, 0, 0)
        stops = []
        with self._stopping:  # no reply is posted after the STOP (see _post)
            self._aborted = True
            for peer in self._threads:
                if peer not in lost and peer not in told:
                    try:
                        stops.append((peer, self._to(peer).send([head], peer, _HEADER_TAG)))
                    except RuntimeError:  # gone as well
                        logger.debug("window service: no STOP to rank %d", peer, exc_info=True)
        for peer, work in stops:  # waited for outside the lock: a peer may be aborting too
            try:
                work.wait()
            except RuntimeError:
                logger.debug("window service: no STOP to rank %d", peer, exc_info=True)
        for group in self.groups:
            try:
                group.abort()
            except Exception:  # already broken: nothing is left to end
                logger.debug("window service: abort failed", exc_info=True)
        end = time.monotonic() + 2.0  # for all of them: a rank that raised exits soon
        for thread in self._threads.values():
            thread.join(timeout=max(end - time.monotonic(), 0.0))
        self._end_reaper()

    def stop(self, ring: list[int] | None = None) -> None:
        """Every rank of ``ring`` (default: all) tells the others' threads for it to stop.

        Collective over ``ring``, which must be the same list on its ranks and hold this
        one; each then joins its threads for those ranks. Threads for ranks outside the
        ring (dead) are ended by aborting the groups.
        """
        ring = list(range(self.size)) if ring is None else ring
        peers = [r for r in ring if r != self.rank]
        if self._broken is None:
            head = _header(Kind.STOP, 0, 0)
            for peer in peers:
                try:
                    self._to(peer).send([head], peer, _HEADER_TAG).wait()
                except RuntimeError as err:
                    logger.warning("window service: stop message not delivered: %s", err)
        deadline = context.timeout()
        for peer in peers:
            self._threads[peer].join(timeout=deadline)
        left = [p for p, t in self._threads.items() if t.is_alive()]
        if left:
            if any(p in peers for p in left):
                logger.warning("window service threads of rank %d did not stop", self.rank)
            self.abort(told=peers)
            return
        self._end_reaper()

    def _end_reaper(self) -> None:
        """End the reaper once the sends before the end mark are done, and wait for it.

        A reaper left inside gloo's ``wait`` when the process group is destroyed at
        shutdown aborts the process ("terminate called without an active exception").
        """
        self._sends.put(None)
        self._reaper.join(timeout=context.timeout())
