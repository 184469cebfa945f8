"""Run a function on N ranks from one process: the harness of gossamer's distributed tests.

``run_distributed(fn, world_size)`` runs ``fn(*args)`` on every rank of a world of
``world_size`` processes and returns the per-rank results. Processes are kept alive in a pool
per world size, so a test costs a round trip, not a process start. Ranks
meet through a ``FileStore`` under a private temporary directory, every call has a deadline,
a rank's exception comes back with its traceback, and a pool whose call failed is killed and
replaced, so one broken test cannot poison the next.

``fn`` must be picklable by reference: a module-level function of an importable module.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing as mp
import os
import pickle
import random
import shutil
import socket
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from multiprocessing.connection import Connection, wait
from typing import Any

__all__ = ["RankError", "RankPool", "free_port", "run_distributed"]

# After one rank fails, how long the others get to finish before the pool is killed.
_GRACE_S = 3.0
_START_TIMEOUT_S = 180.0
# Pools beyond this many processes in total are closed, least recently used first.
_MAX_POOLED_PROCESSES = 16


class RankError(AssertionError):
    """One or more ranks raised, died or missed the deadline; the message holds their reports."""


def _apply_env(env: dict[str, str], applied: dict[str, str | None]) -> dict[str, str | None]:
    """Undo the previous call's variables, set this call's; return what to undo next time."""
    for key, old in applied.items():
        if old is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = old
    undo = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    return undo


def _worker(rank: int, world_size: int, store: str, conn: Connection, pg_timeout: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from gossamer import context

    # Ranks share two cores: one thread each keeps them from starving one another.
    torch.set_num_threads(1)
    # Forks of one server share its generators' state: each rank draws its own numbers, as
    # separately started processes do.
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        # The same store goes to gossamer, which keeps each rank's heartbeat there.
        file_store = dist.FileStore(store, world_size)
        dist.init_process_group(
            "gloo",
            store=file_store,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        context.init(timeout=pg_timeout, store=file_store)
        conn.send(("ok", None))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    env: dict[str, str] = {}
    undo: dict[str, str | None] = {}
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            break  # the parent is gone
        if task is None:
            break
        fn, args, kwargs, call_env = task
        try:
            if call_env != env:
                # Variables such as GOSSAMER_NODES_PER_MACHINE are read at init: re-init.
                undo, env = _apply_env(call_env, undo), call_env
                context.shutdown()
                context.init(timeout=pg_timeout, store=file_store)
            reply: tuple[str, Any] = ("ok", fn(*args, **kwargs))
        except BaseException:
            reply = ("error", traceback.format_exc())
        try:
            conn.send(reply)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            conn.send(("error", f"rank {rank}: result of {fn.__name__} is not picklable: {err}"))
    context.shutdown()
    dist.destroy_process_group()


class RankPool:
    """``world_size`` live rank processes that run functions on request.

    Args:
        world_size (int): number of ranks.
        pg_timeout (float): deadline of the ranks' own blocking waits, in seconds.
    """

    def __init__(self, world_size: int, pg_timeout: float = 60.0) -> None:
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be an integer >= 1; got {world_size!r}")
        self.world_size = world_size
        self._dir = tempfile.mkdtemp(prefix="gossamer-pool-")
        ctx = _context()
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker,
                daemon=True,
                name=f"gossamer-rank-{rank}",
                args=(rank, world_size, os.path.join(self._dir, "store"), child, pg_timeout),
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
        self.alive = True
        self._collect("start-up", _START_TIMEOUT_S)

    def pids(self) -> list[int]:
        """Process ids of the ranks, in rank order."""
        return [p.pid for p in self._procs if p.pid is not None]

    def run(
        self,
        fn: Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 60.0,
        dies: Collection[int] = (),
    ) -> list[Any]:
        """Run ``fn(*args, **kwargs)`` on every rank; return the results in rank order.

        ``env`` holds variables set on every rank for this call (gossamer is re-initialized
        when they change, e.g. ``{"GOSSAMER_NODES_PER_MACHINE": "2"}``). A rank in ``dies``
        may die during the call (a test that kills it): its result is None, not an error.

        Raises:
            RankError: a rank raised, died, or did not finish within ``timeout`` seconds; the
                pool is then closed.
        """
        if not self.alive:
            raise RuntimeError("this RankPool is closed")
        task = (fn, tuple(args), dict(kwargs or {}), dict(env or {}))
        try:
            pickle.dumps(task)
        except Exception as err:
            raise TypeError(
                f"fn and its arguments must be picklable (a module-level function); "
                f"got {fn!r}: {err}"
            ) from err
        for conn in self._conns:
            conn.send(task)
        return self._collect(getattr(fn, "__qualname__", repr(fn)), timeout, set(dies))

    def _collect(self, what: str, timeout: float, dies: Collection[int] = ()) -> list[Any]:
        results: list[Any] = [None] * self.world_size
        reports: dict[int, str] = {}
        pending = dict(enumerate(self._conns))
        deadline = time.monotonic() + timeout
        while pending:
            left = deadline - time.monotonic()
            if reports:
                left = min(left, _GRACE_S)
            ready = wait(list(pending.values()), timeout=max(left, 0.0)) if left > 0 else []
            if not ready:
                break
            for rank in [r for r, c in pending.items() if c in ready]:
                conn = pending.pop(rank)
                try:
                    status, payload = conn.recv()
                except (EOFError, OSError):
                    self._procs[rank].join(1.0)
                    if rank in dies:
                        continue  # an expected death: result None
                    status = "error"
                    payload = f"rank {rank} died (exit code {self._procs[rank].exitcode})"
                if status == "ok":
                    results[rank] = payload
                else:
                    reports[rank] = payload
        if not reports and not pending:
            return results
        self.close(force=True)
        lines = [f"{what} failed on {len(reports) + len(pending)} of {self.world_size} ranks"]
        lines += [f"--- rank {r} raised ---\n{text}" for r, text in sorted(reports.items())]
        if pending and reports:
            lines.append(
                f"--- ranks {sorted(pending)} were still running {_GRACE_S:g} s after "
                "the first failure (waiting for a failed rank?); the pool was killed ---"
            )
        elif pending:
            lines.append(
                f"--- ranks {sorted(pending)} did not finish within {timeout:g} s "
                "(deadline); the pool was killed ---"
            )
        raise RankError("\n".join(lines))

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``) and remove the rendezvous directory."""
        if not self.alive:
            return
        self.alive = False
        for conn in self._conns:
            with contextlib.suppress(OSError, ValueError):
                conn.send(None)
        deadline = time.monotonic() + (0.0 if force else 5.0)
        for proc in self._procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self._conns:
            conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, below the kernel's ephemeral range.

    For the store of ranks that a test starts itself. A port from ``bind(0)`` comes from
    the ephemeral range, where the outgoing connections of other ranks (gloo opens one per
    pair) can take it before the store listens (``EADDRINUSE``, seen in the fault tests).
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ports:
            low = int(ports.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768  # Linux's default
    for _ in range(200):
        port = random.randrange(10_000, max(low, 10_001))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_pools: OrderedDict[int, RankPool] = OrderedDict()


def _context() -> mp.context.BaseContext:
    # Ranks fork from a server that has imported torch once, so a pool starts in a fraction
    # of a second instead of one torch import per rank.
    ctx = mp.get_context("forkserver")
    # torch._dynamo is what the first torch.optim optimizer imports: seconds per rank.
    ctx.set_forkserver_preload(
        [
            "torch",
            "torch.distributed",
            "torch._dynamo",
            "gossamer.context",
            "gossamer.ops",
            "gossamer.windows",
        ]
    )
    return ctx


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is not None and pool.alive:
        _pools.move_to_end(world_size)
        return pool
    _pools.pop(world_size, None)
    while _pools and sum(_pools) + world_size > _MAX_POOLED_PROCESSES:
        _pools.popitem(last=False)[1].close()
    _pools[world_size] = pool = RankPool(world_size)
    return pool


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    dies: Collection[int] = (),
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results in order.

    Inside ``fn`` gossamer is initialized (gloo), so ``gossamer.rank()`` and every operation
    work. Ranks come from a pool kept alive across calls with the same ``world_size``.

    Args:
        fn (Callable): a module-level function.
        world_size (int): number of ranks, >= 1.
        args (Sequence, optional): positional arguments for ``fn`` (the same on every rank).
        kwargs (Mapping, optional): keyword arguments for ``fn``.
        env (Mapping[str, str], optional): variables set on every rank for this call;
            gossamer is re-initialized when they differ from the previous call's.
        timeout (float): seconds before the call fails and the pool is killed.
        dies (Collection[int]): ranks that may die during the call (fault tests kill
            them): their result is None. The call runs on fresh ranks, outside the pool,
            which are stopped afterwards (a world with a dead rank cannot be reused).

    Returns:
        list: ``fn``'s return value on rank 0, 1, ...

    Raises:
        RankError: with every failed rank's traceback, or the ranks that missed the deadline.

    Example:
        >>> run_distributed(gossamer.rank, 3)  # doctest: +SKIP
        [0, 1, 2]
    """
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or not timeout > 0:
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    dies = set(dies)
    if not dies <= set(range(world_size)):
        raise ValueError(f"dies must be ranks in [0, {world_size}); got {sorted(dies)}")
    if not dies:
        return _pool(world_size).run(fn, args, kwargs, env, timeout)
    pool = RankPool(world_size)
    try:
        return pool.run(fn, args, kwargs, env, timeout, dies)
    finally:
        pool.close(force=True)


def close_pools() -> None:
    """Stop every pooled rank process."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)
