"""Which ranks are alive: a heartbeat per rank in the rendezvous store, read when a wait stalls.

gloo does not say which rank died: a rank whose peer died gets "connection reset" from the
pair it was using, which may lead to a survivor, and a rank waiting on a survivor (that has
already failed) waits for the whole deadline. So every rank runs a small daemon thread that
writes a counter to the store every :data:`BEAT_S` (``gossamer/alive/<rank>``). The counters
are read after a transfer failed (:mod:`~gossamer.transport.failures`), and by the same
thread when the operation in progress has run for :data:`STALL_S` (the engine's watchdog);
a rank whose counter has not moved for ``GOSSAMER_DEAD_AFTER`` seconds (default
:data:`DEAD_AFTER_S`) is lost, and the operation
raises :class:`~gossamer.errors.RankLostError` naming it. A rank found lost stays lost:
every later operation raises at once.

Under ``gossamer run --elastic`` the launcher's agent sees a rank's process end at once and
writes a tombstone (``gossamer/dead/<rank>``, :data:`gossamer.env.DEAD_KEY`) to the same
store; a rank with a tombstone is lost without waiting for its counter to go stale, so a
death is confirmed within the agent's poll interval (0.1 s) instead of ``DEAD_AFTER_S``.

A rank that leaves by ``shutdown()`` (or at the program's end) writes ``gossamer/left/<rank>``
(:data:`gossamer.env.LEFT_KEY`) with the ranks it had found lost. A peer whose connection to
it then breaks reads the marks (:meth:`Liveness.check_left`) and names at once the ranks
lost: the ones the leaver had found lost (it may have left because of them), else the
leaver itself. Its heartbeat goes on while it closes, so the counters alone could take
``GOSSAMER_DEAD_AFTER`` to tell. The launcher's agent reads the marks too (an early
finisher that has not yet exited did not go on without a later loss).

Counters, not clocks, so clock skew between machines cannot make a live rank look dead; a
rank is judged only on changes this rank observed itself.

A counter can also stand still because its rank is starved, not dead: on a machine with
more busy processes than cores, a heartbeat thread that waits for the GIL behind a long
compilation can miss several beats. So every rank also writes, once, where its process can
be found (``gossamer/process/<rank>``: the kernel's boot id, the pid namespace, the pid
and the process's start time, from ``/proc``). A rank that shares this rank's kernel and
pid namespace (every rank of one machine, network namespaces included) is judged by its
process instead: lost as soon as the process has ended (at the first read, without
waiting for ``GOSSAMER_DEAD_AFTER``), never while it runs, however long its counter stands
still. A live rank that hangs there makes the operation time out instead, naming it. A
stopped process (``SIGSTOP``, a debugger) and ranks of other machines are judged by their
counters. Nothing is read while operations
complete normally, so the cost is one small store write per rank per :data:`BEAT_S`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch.distributed as dist

from gossamer import context, env

__all__ = ["BEAT_S", "DEAD_AFTER_S", "STALL_S", "Liveness", "get_liveness", "leave"]

logger = logging.getLogger("gossamer")

BEAT_S = 0.5  # a rank writes its counter this often
STALL_S = 0.5  # a wait this long starts reading the counters
DEAD_AFTER_S = 3.0  # default: a counter unchanged this long (seen here) marks its rank lost
_PREFIX = "gossamer/alive/"
_PROCESS = "gossamer/process/"


class Liveness:
    """This rank's heartbeat and its view of the other ranks' (a runtime component).

    Attributes:
        lost: global ranks found dead (or gone); never shrinks.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, store_host: int | None) -> None:
        self.lost: set[int] = set()
        # A store client is not safe to share between threads (a TCPStore's socket would
        # interleave the heartbeat with the process group's own rendezvous): one clone for
        # the heartbeat thread, one for the readers.
        self._writer, self._store = store.clone(), store.clone()
        self._rank, self._size = rank, size
        self._store_host = store_host
        self.dead_after = env.settings().dead_after
        self._seen: dict[int, tuple[bytes, float]] = {}  # rank -> (counter, when it changed)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beats = 0
        self._watchers: list[Callable[[Liveness], None]] = []
        self._activities: list[Callable[[], str]] = []  # the operation this rank is stuck in
        self._process = _process_identity()
        self._writer.set(f"{_PROCESS}{rank}", self._process)  # before the counter: read with it
        self._beat()  # the key exists before anyone reads it
        self._thread = threading.Thread(target=self._run, name="gossamer-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        self._beats += 1
        doing = next((a for a in (activity() for activity in self._activities) if a), "")
        self._writer.set(f"{_PREFIX}{self._rank}", f"{self._beats} {doing}")

    def report(self, activity: Callable[[], str]) -> None:
        """Beat with ``activity()``: the operation this rank has been waiting in, or ``""``.

        Several may report (the communication thread, the window client); the first that
        names an operation is written.
        """
        self._activities.append(activity)

    def activities(self) -> dict[int, str]:
        """The other live ranks' activity at their last beat (a peer's ``""``: none)."""
        ranks = [r for r in range(self._size) if r != self._rank and r not in self.lost]
        try:
            with self._lock:
                values = self._read([f"{_PREFIX}{r}" for r in ranks])
        except Exception:  # the store's host is gone; check() says so
            return {}
        return {
            r: v.decode().partition(" ")[2]
            for r, v in zip(ranks, values, strict=True)
            if v is not None
        }

    def on_beat(self, watcher: Callable[[Liveness], None]) -> None:
        """Call ``watcher(self)`` on the heartbeat thread after every beat."""
        self._watchers.append(watcher)

    def _run(self) -> None:
        beating = True
        while not self._stop.wait(BEAT_S):
            if beating:
                try:
                    self._beat()
                except Exception:  # the store is gone (its host died): readers find out
                    logger.debug("heartbeat of rank %d stopped", self._rank, exc_info=True)
                    beating = False
            for watcher in self._watchers:
                try:
                    watcher(self)
                except Exception:
                    logger.exception("liveness watcher failed")

    def check(self) -> set[int]:
        """Read every rank's counter; return the ranks lost (also added to :attr:`lost`)."""
        now = time.monotonic()
        ranks = [r for r in range(self._size) if r != self._rank and r not in self.lost]
        keys = [f"{_PREFIX}{r}" for r in ranks] + [f"{_PROCESS}{r}" for r in ranks]
        try:
            with self._lock:
                values = self._read(keys)
                tombstones = {r for r in ranks if self._store.check([f"{env.DEAD_KEY}{r}"])}
        except Exception:
            # The store itself is unreachable: its host is gone, if we know which rank it is.
            if self._store_host is not None and self._store_host != self._rank:
                self.lost.add(self._store_host)
            return set(self.lost)
        counters, processes = values[: len(ranks)], values[len(ranks) :]
        for rank, value, process in zip(ranks, counters, processes, strict=True):
            if value is None:
                continue  # not started yet (still in init)
            ended = _ended(process.decode() if process else "", self._process)
            if rank in tombstones or ended:
                self.lost.add(rank)
                continue
            last = self._seen.get(rank)
            if last is None or last[0] != value:
                self._seen[rank] = (value, now)
            elif now - last[1] >= self.dead_after and ended is None:
                self.lost.add(rank)
        return set(self.lost)

    def leave(self) -> None:
        """Mark this rank left, with the ranks it had found lost (why it may be leaving)."""
        try:
            with self._lock:
                lost = ",".join(map(str, sorted(self.lost)))
                self._store.set(f"{env.LEFT_KEY}{self._rank}", lost)
        except Exception:  # the store's host left first: nobody can read the mark anyway
            logger.debug("rank %d could not mark itself left", self._rank, exc_info=True)

    def check_left(self, peer: int | None = None) -> set[int]:
        """Ranks lost, as told by the ranks (``peer``, or any) that left by ``shutdown()``.

        The ranks a leaver had found lost that this rank had not (a rank that failed on a
        death and then left must not be blamed for it), else the leavers. Added to
        :attr:`lost`. Read only once a connection broke: a rank that left has finished its
        side of every call, but a transfer from it may still be arriving.
        """
        ranks = [r for r in range(self._size) if r != self._rank and peer in (None, r)]
        try:
            with self._lock:
                keys = [f"{env.LEFT_KEY}{r}" for r in ranks]
                marks = {
                    r: self._store.get(k)
                    for r, k in zip(ranks, keys, strict=True)
                    if self._store.check([k])
                }
        except Exception:  # the store's host is gone; check() says so
            return set()
        seen = {int(r) for mark in marks.values() for r in mark.decode().split(",") if r}
        found = (seen - {self._rank} - self.lost) or set(marks)
        self.lost |= found
        return found

    def _read(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        if self._store.check(keys):  # all there: one round trip (get would block on a missing key)
            return list(self._store.multi_get(keys))
        return [self._store.get(k) if self._store.check([k]) else None for k in keys]

    def close(self) -> None:
        """Stop the heartbeat."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * BEAT_S)


def _stat(pid: int) -> tuple[str, str]:
    """The state letter and the start time (clock ticks since boot) of process ``pid``."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()  # the name, in parentheses, may hold spaces
    return fields[0], fields[19]  # fields 3 and 22 of proc(5)


def _process_identity() -> str:
    """Where other processes of this kernel and pid namespace find this one; "" off Linux."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.readlink("/proc/self/ns/pid")
        start = _stat(os.getpid())[1]
    except (OSError, IndexError, ValueError):
        return ""
    return f"{boot} {namespace} {os.getpid()} {start}"


def _ended(theirs: str, mine: str) -> bool | None:
    """Whether the process ``theirs`` (a :func:`_process_identity`) has ended.

    None when this process cannot tell (another machine or pid namespace, either identity
    unknown) or when the process is stopped: its counter decides then.
    """
    parts = theirs.split(" ")  # boot id, pid namespace, pid, start time
    if len(parts) != 4 or mine.split(" ")[:2] != parts[:2]:
        return None
    pid, start = parts[2:]
    try:
        state, started = _stat(int(pid))
    except (OSError, IndexError, ValueError):
        return True  # no such process
    if started != start or state in ("Z", "X"):
        return True  # another process took the pid, or a zombie not yet reaped
    return None if state in ("T", "t") else False


def get_liveness() -> Liveness | None:
    """This process's :class:`Liveness`, started on first use; None without a store or peers."""
    runtime = context.runtime()
    found = runtime.find("transport.liveness")
    if found is not None:
        return found
    if runtime.store is None or runtime.layout.size == 1:
        return None
    return runtime.component(
        "transport.liveness",
        lambda: Liveness(
            runtime.store, runtime.layout.rank, runtime.layout.size, runtime.store_host
        ),
    )


def leave() -> None:
    """At ``shutdown()``: mark this rank left (:meth:`Liveness.leave`), if it had peers."""
    found = context.runtime().find("transport.liveness")
    if found is not None:
        found.leave()
