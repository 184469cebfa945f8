"""Forwarding of the ranks' stdout and stderr, whole lines at a time.

Every rank writes into a pipe of its own; one thread reads all pipes and writes each
batch of complete lines to the launcher's stdout or stderr with one ``write``. Ranks
therefore never share a file descriptor, and a line (of any length up to
:data:`MAX_LINE`) is never cut or mixed with another rank's.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import queue
import select
import selectors
import threading
from dataclasses import dataclass, field

__all__ = ["MAX_LINE", "Forwarder", "make_fifo"]

# A "line" without a terminator that grows past this is written as it is, so that a rank
# printing megabytes without a newline cannot exhaust the launcher's memory.
MAX_LINE = 16 * 2**20
_READ_SIZE = 2**20
# Bigger pipes let a rank write a long line at once even while the terminal is slow.
_PIPE_SIZE = 2**20
_ENDS = (b"\n", b"\r")


@dataclass(eq=False)
class _Source:
    fd: int
    dest: int
    prefix: bytes
    log_fd: int | None
    keepalive_fd: int | None
    pending: bytearray = field(default_factory=bytearray)
    midline: bool = False  # what went out last did not end a line
    discard: bool = False  # forwarding failed: read (so the rank never blocks), drop


def make_fifo(path: str) -> tuple[int, int]:
    """Create a named pipe at ``path``; return ``(read_fd, keepalive_write_fd)``.

    Both ends are opened here, so a writer opening ``path`` later does not block. The
    keepalive write end means the read end never sees end-of-file: a rank ends whenever
    it ends, and :meth:`Forwarder.close` decides when the output is complete.
    """
    os.mkfifo(path, 0o600)
    read_fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    keepalive_fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    with contextlib.suppress(OSError, AttributeError):  # Linux only; a smaller pipe works
        fcntl.fcntl(read_fd, fcntl.F_SETPIPE_SZ, _PIPE_SIZE)
    return read_fd, keepalive_fd


class Forwarder:
    """Reads pipes in a thread and writes their complete lines to stdout or stderr.

    Sources are added with :meth:`add` (any thread); :meth:`close` reads what is left in
    every pipe, writes the last unterminated piece of each (with a newline added, so the
    next line starts on a line of its own), and stops the thread.

    Args:
        stdout (int): descriptor that sources added with ``dest=1`` write to.
        stderr (int): descriptor that sources added with ``dest=2`` write to.
    """

    def __init__(self, stdout: int = 1, stderr: int = 2) -> None:
        self._dest = {1: stdout, 2: stderr}
        self._broken: set[int] = set()
        self._locks = {1: threading.Lock(), 2: threading.Lock()}
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe()
        os.set_blocking(self._wake_read, False)
        os.set_blocking(self._wake_write, False)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._requests: queue.SimpleQueue[_Source | None] = queue.SimpleQueue()
        self._sources: list[_Source] = []
        self._thread = threading.Thread(target=self._run, name="gossamer-output", daemon=True)
        self._thread.start()
        self._closed = False

    def add(
        self,
        fd: int,
        *,
        dest: int,
        prefix: str = "",
        log_path: str | None = None,
        keepalive_fd: int | None = None,
    ) -> None:
        """Forward what arrives on ``fd`` (now owned by the forwarder).

        Args:
            fd (int): read end of a pipe.
            dest (int): 1 for this process's stdout, 2 for its stderr.
            prefix (str): put before every line (``--tag-output``).
            log_path (str, optional): a file that receives the same bytes, unprefixed.
            keepalive_fd (int, optional): a write end to close together with ``fd``.

        Raises:
            ValueError: ``dest`` is not 1 or 2.
            OSError: ``log_path`` cannot be created.
        """
        if dest not in (1, 2):
            raise ValueError(f"dest must be 1 (stdout) or 2 (stderr); got {dest!r}")
        log_fd = None
        if log_path is not None:
            log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.set_blocking(fd, False)
        self._requests.put(_Source(fd, dest, prefix.encode(), log_fd, keepalive_fd))
        self._wake()

    def close(self) -> None:
        """Forward everything the pipes still hold, then stop; idempotent."""
        if self._closed:
            return
        self._closed = True
        self._requests.put(None)
        self._wake()
        self._thread.join()
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    # ------------------------------------------------------------------ the reading thread

    def _wake(self) -> None:
        with contextlib.suppress(BlockingIOError):  # a full wake pipe is awake already
            os.write(self._wake_write, b"x")

    def _run(self) -> None:
        stopping = False
        while not stopping:
            for key, _ in self._selector.select():
                if key.data is None:
                    stopping = self._take_requests()
                    continue
                try:
                    self._read(key.data)
                except Exception as err:  # a dead thread would leave the ranks blocked
                    self._report(f"forwarding a rank's output failed: {err!r}; it stops here")
                    key.data.discard = True
                    key.data.pending.clear()
                    key.data.midline = False
        for source in list(self._sources):
            self._read(source, drain=True)
            self._finish(source)

    def _take_requests(self) -> bool:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_read, 4096):
                pass
        stop = False
        while True:
            try:
                request = self._requests.get_nowait()
            except queue.Empty:
                return stop
            if request is None:
                stop = True
            else:
                self._sources.append(request)
                self._selector.register(request.fd, selectors.EVENT_READ, request)

    def _read(self, source: _Source, *, drain: bool = False) -> None:
        # Draining reads what the pipe holds, and a little more; not forever, should
        # something the rank left behind still be writing.
        for _ in range(_PIPE_SIZE // _READ_SIZE + 4 if drain else 1):
            try:
                data = os.read(source.fd, _READ_SIZE)
            except BlockingIOError:
                return
            except OSError as err:
                self._report(f"reading a rank's output failed: {err}")
                data = b""
            if not data:  # end of file: every writer is gone
                self._finish(source)
                return
            if not source.discard:
                self._take(source, data)

    def _take(self, source: _Source, data: bytes) -> None:
        pending = source.pending
        pending += data
        # A "\r" as the last byte may be the first half of "\r\n": keep it until more comes.
        end = max(pending.rfind(b"\n"), pending.rfind(b"\r", 0, len(pending) - 1)) + 1
        if end == 0 and len(pending) > MAX_LINE:
            end = len(pending)
        if end:
            chunk = bytes(pending[:end])
            del pending[:end]
            self._emit(source, chunk)

    def _emit(self, source: _Source, chunk: bytes, *, terminate: bool = False) -> None:
        if source.log_fd is not None:
            try:
                _write_all(source.log_fd, chunk)
            except OSError as err:
                self._report(f"writing a log file failed ({err}); it stops here")
                os.close(source.log_fd)
                source.log_fd = None
        if terminate and not chunk.endswith(_ENDS):
            chunk += b"\n"
        if source.prefix:
            lines = chunk.splitlines(keepends=True)
            # The rest of a line over MAX_LINE continues it: no second prefix.
            head = lines[0] if source.midline else source.prefix + lines[0]
            chunk = head + b"".join(source.prefix + line for line in lines[1:])
        source.midline = not chunk.endswith(_ENDS)
        self._write(source.dest, chunk)

    def _finish(self, source: _Source) -> None:
        if source not in self._sources:
            return
        if source.pending or source.midline:
            rest = bytes(source.pending)
            source.pending.clear()
            self._emit(source, rest, terminate=True)
        self._sources.remove(source)
        self._selector.unregister(source.fd)
        for fd in (source.fd, source.keepalive_fd, source.log_fd):
            if fd is not None:
                os.close(fd)

    def _write(self, dest: int, data: bytes) -> None:
        if dest in self._broken:
            return
        with self._locks[dest]:
            try:
                _write_all(self._dest[dest], data)
            except OSError as err:
                # The reader went away (`gossamer run ... | head`): keep draining the ranks'
                # pipes so that they do not block, but stop writing there.
                if err.errno not in (errno.EPIPE, errno.EBADF):
                    self._report(f"forwarding output failed: {err}")
                self._broken.add(dest)

    def _report(self, message: str) -> None:
        if 2 not in self._broken:
            with contextlib.suppress(OSError):
                _write_all(self._dest[2], f"gossamer run: {message}\n".encode())


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except BlockingIOError:
            # A non-blocking destination (a terminal that another program left so): wait.
            select.select([], [fd], [])
            continue
        view = view[written:]
