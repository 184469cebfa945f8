"""Runtime context: process-group setup and the rank layout (world, machine, local).

A *machine* is a set of ranks that share a host. Ranks are grouped by the node index the
launcher gives (``GROUP_RANK``) or, failing that, by host name; ``GOSSAMER_NODES_PER_MACHINE=k``
overrides both and makes ranks ``k*m .. k*m+k-1`` machine ``m``, so machine-level code can be
tested on one host.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gossamer import env, profiling
from gossamer.errors import CommunicationTimeout, NotInitializedError, RankLostError

__all__ = [
    "Layout",
    "Runtime",
    "backend",
    "device",
    "host_group",
    "init",
    "is_homogeneous",
    "is_initialized",
    "layout",
    "local_rank",
    "local_size",
    "machine_rank",
    "machine_size",
    "on_init",
    "on_shutdown",
    "rank",
    "shared_device_error",
    "runtime",
    "shutdown",
    "size",
    "timeout",
]

logger = logging.getLogger("gossamer")
T = TypeVar("T")


@dataclass(frozen=True)
class Layout:
    """Where every rank sits: ``machine_of[r]`` is the machine index of rank ``r``."""

    rank: int
    machine_of: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of ranks in the world."""
        return len(self.machine_of)

    @property
    def machine_rank(self) -> int:
        """Index of this rank's machine (machines numbered in order of their lowest rank)."""
        return self.machine_of[self.rank]

    @property
    def machine_size(self) -> int:
        """Number of machines."""
        return max(self.machine_of) + 1

    def ranks_on(self, machine: int) -> tuple[int, ...]:
        """Ranks on ``machine``, ascending."""
        return tuple(r for r, m in enumerate(self.machine_of) if m == machine)

    @property
    def local_rank(self) -> int:
        """Index of this rank among the ranks of its machine."""
        return self.ranks_on(self.machine_rank).index(self.rank)

    @property
    def local_size(self) -> int:
        """Number of ranks on this rank's machine."""
        return len(self.ranks_on(self.machine_rank))

    @property
    def homogeneous(self) -> bool:
        """True when every machine holds the same number of ranks and its ranks are contiguous."""
        per = len(self.ranks_on(0))
        return self.size % per == 0 and all(m == r // per for r, m in enumerate(self.machine_of))


class Runtime:
    """Everything gossamer holds for one process between :func:`init` and :func:`shutdown`.

    The fixed facts of the job (layout, backend, device, host group, timeout), the default
    topologies, and the *components* that higher layers start on first use (the
    communication engine, the window service, the BlueFog facade's tables). ``shutdown()``
    closes the components in reverse order of creation and drops this one object, so
    recovery rebuilds exactly one thing.
    """

    def __init__(
        self,
        layout: Layout,
        backend: str,
        device: torch.device,
        host_group: dist.ProcessGroup,
        timeout: float,
        owns_process_group: bool,
        store: dist.Store | None = None,
        store_host: int | None = None,
        reverse_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.layout = layout
        self.backend = backend
        self.device = device
        self.host_group = host_group
        self.timeout = timeout
        self.owns_process_group = owns_process_group
        # The rendezvous store (if known) and the rank hosting it (None: agent, file).
        self.store = store
        self.store_host = store_host
        # A second gloo group over the world: messages from a higher to a lower rank travel
        # on it (see reverse_group()). None on one machine and under NCCL.
        self.reverse_group = reverse_group
        # Default topologies, keyed by group ("world" for the whole world): ops read them.
        self.topologies: dict[object, Any] = {}
        self.machine_topology: Any = None
        self._components: dict[str, Any] = {}
        self._lock = threading.RLock()  # a factory may start another component

    def component(self, name: str, factory: Callable[[], T]) -> T:
        """The component ``name``, created with ``factory()`` on first use.

        A component with a ``close()`` method is closed at :func:`shutdown`.
        """
        with self._lock:
            found = self._components.get(name)
            if found is None:
                found = self._components[name] = factory()
            return found

    def find(self, name: str) -> Any:
        """The component ``name`` if it was created, else None (never creates it)."""
        return self._components.get(name)

    def close(self) -> None:
        """Close every component, newest first; a failing close does not stop the others."""
        for name in reversed(list(self._components)):
            closer = getattr(self._components[name], "close", None)
            if closer is not None:
                try:
                    closer()
                except Exception:
                    logger.exception("closing %s at shutdown failed", name)
        self._components.clear()


_state: Runtime | None = None
_inits = 0  # process groups this process started: a re-init's keys must not meet the last's
# Rendezvous stores by (address, port, hosting): kept across re-inits, because a peer that
# re-inits first would otherwise reach the closing store of the last init, or none at all.
_stores: dict[tuple[str, int, bool], dist.Store] = {}
_USER_INITS = "gossamer/inits"  # inits on a store the user passed (their generations)
_JOINED = "gossamer/joined"  # ranks that reached init: a count, and one key per rank
_shutdown_hooks: list[Callable[[], None]] = []
_init_hooks: list[Callable[[], object]] = []


def on_shutdown(hook: Callable[[], None]) -> None:
    """Register ``hook`` to run at every :func:`shutdown`, before the runtime closes."""
    if hook not in _shutdown_hooks:
        _shutdown_hooks.append(hook)


def on_init(hook: Callable[[], object]) -> None:
    """Register ``hook`` to run at the end of every :func:`init` (higher layers start there)."""
    if hook not in _init_hooks:
        _init_hooks.append(hook)


def _resolve_backend(requested: str) -> str:
    if requested not in env.BACKENDS:
        raise ValueError(f"backend must be one of {env.BACKENDS}; got {requested!r}")
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested == "nccl" and not torch.cuda.is_available():
        raise ValueError("backend='nccl' needs CUDA, but torch.cuda.is_available() is False")
    return requested


def _start_process_group(backend: str, timeout: float) -> tuple[dist.Store, int | None]:
    """Start the default process group; return its store and the rank that hosts it."""
    info = env.launch_info()
    # A combined backend routes CUDA tensors to NCCL and CPU tensors to gloo in one group.
    pg_backend = "cpu:gloo,cuda:nccl" if backend == "nccl" else "gloo"
    if info.world_size > 1 and not info.launched:
        raise RuntimeError(
            f"WORLD_SIZE={info.world_size} but MASTER_ADDR is not set; start the "
            "program with `gossamer run -np N` or torchrun"
        )
    wait = timedelta(seconds=timeout)
    store: dist.Store = dist.HashStore()  # no launcher: a world of one, so every op works
    pg_store, host = store, None
    if info.launched:  # what init_method="env://" does, keeping the store (torchrun's agent's)
        global _inits
        agent = info.agent_store
        hosting = info.rank == 0 and not agent
        key = (info.master_addr, info.master_port, hosting)
        if key not in _stores:
            args = (info.master_addr, info.master_port, info.world_size)
            _stores[key] = dist.TCPStore(*args, is_master=hosting, timeout=wait)
        store = attempt = _stores[key]
        if agent:
            # The agent's store outlives a restart of the ranks (--max-restarts): keys of an
            # earlier attempt (gloo's addresses, heartbeats, membership epochs) must not be
            # read by this one. The prefix is the one torch's env:// rendezvous uses.
            store = attempt = dist.PrefixStore(f"/worker/attempt_{info.restart_count}", store)
        _inits += 1
        if _inits > 1:
            # Likewise a re-init after shutdown() (the agent's tombstones, written under the
            # attempt's prefix, are then not seen by the liveness: deaths after init are
            # found by heartbeat alone).
            store = dist.PrefixStore(f"gossamer/init_{_inits}", store)
        if agent:
            _wait_for_every_rank(store, attempt, info.rank, info.world_size, timeout)
        pg_store, host = dist.PrefixStore("default_pg", store), None if agent else 0
    dist.init_process_group(
        pg_backend, store=pg_store, rank=info.rank, world_size=info.world_size, timeout=wait
    )
    return store, host


def _wait_for_every_rank(
    store: dist.Store, attempt: dist.Store, rank: int, world_size: int, timeout: float
) -> None:
    """Return once every rank has reached :func:`init`; raise if one died on the way.

    torch's rendezvous would wait out the whole timeout for a rank that died before its
    ``init`` (an import error, an OOM kill at start-up) and then fail with a store error
    naming a key. Under ``gossamer run --elastic`` the agent tombstones a rank whose process
    ended (``env.DEAD_KEY`` under the attempt's prefix, where this reads it) and counts it
    in ``env.DEATHS_KEY``; this rank polls that count while it waits. A job starts with
    every rank even under ``--elastic`` (a process group cannot be made without one), so
    the death fails this rank's ``init`` at once, naming the dead rank.
    """
    store.set(f"{_JOINED}/{rank}", "1")
    store.add(_JOINED, 1)
    deadline = time.monotonic() + timeout
    pause = 0.01
    while store.add(_JOINED, 0) < world_size:
        if attempt.check([env.DEATHS_KEY]):
            dead = [r for r in range(world_size) if attempt.check([f"{env.DEAD_KEY}{r}"])]
            named = f"rank {dead[0]}" if len(dead) == 1 else f"ranks {dead}"
            raise RankLostError(
                f"gossamer.init() on rank {rank}: {named} died before joining the job, "
                "which cannot start without every rank (--elastic survives deaths only "
                "once every rank has passed gossamer.init())",
                dead,
            )
        if time.monotonic() >= deadline:
            missing = [r for r in range(world_size) if not store.check([f"{_JOINED}/{r}"])]
            raise CommunicationTimeout(
                f"gossamer.init(): ranks {missing} did not reach gossamer.init() within "
                f"{timeout:g} s (GOSSAMER_TIMEOUT)"
            )
        time.sleep(pause)
        # Backs off so that thousands of waiting ranks do not flood the agent's store.
        pause = min(2 * pause, 0.2)


def _keys_of_this_init(store: dist.Store | None, group: dist.ProcessGroup) -> dist.Store | None:
    """``store`` under a prefix of this init's own, for a store the user passed to init.

    A runtime after ``shutdown()`` on the same store must not read the last one's keys
    (heartbeats, membership epochs, checkpoint manifests' votes). Rank 0 alone counts the
    inits on the store and every rank takes its count, so the ranks agree whatever jobs
    used the store before: a count of every rank's inits split into generations only
    while every job there had this world size (a job of 3 after one of 2 disagreed).

    Raises:
        ValueError: on every rank, when some ranks passed a store and others did not.
    """
    mine = None if store is None else store.add(_USER_INITS, 1) if dist.get_rank() == 0 else 0
    counts: list[int | None] = [None] * dist.get_world_size()
    dist.all_gather_object(counts, mine, group=group)
    without = [r for r, count in enumerate(counts) if count is None]
    if without and len(without) < len(counts):
        raise ValueError(
            f"init(store=...) must be given a store on every rank or on none; ranks "
            f"{without} gave none"
        )
    if store is None or counts[0] == 1:
        return store
    return dist.PrefixStore(f"gossamer/init_{counts[0]}", store)


def _machine_key(settings: env.Settings, rank: int) -> str:
    if settings.nodes_per_machine is not None:
        return f"fake:{rank // settings.nodes_per_machine}"
    info = env.launch_info()
    if info.node_rank is not None:
        return f"node:{info.node_rank}"
    return f"host:{socket.gethostname()}"


def _discover_layout(settings: env.Settings, group: dist.ProcessGroup) -> Layout:
    me = dist.get_rank()
    keys: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, _machine_key(settings, me), group=group)
    index: dict[str | None, int] = {}
    for key in keys:
        index.setdefault(key, len(index))
    return Layout(rank=me, machine_of=tuple(index[k] for k in keys))


def _device_label(index: int) -> str:
    """``cuda:<index>``, with the device's UUID when torch knows it (it names the GPU)."""
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    return f"cuda:{index}" if uuid is None else f"cuda:{index} (GPU-{uuid})"


def shared_device_error(machine_of: tuple[int, ...], devices: list[str]) -> str | None:
    """Why NCCL cannot run this layout, or None: the first device two ranks would share.

    NCCL runs one rank per GPU; two ranks of one machine on the same device fail every
    operation with ``ncclInvalidUsage``. ``devices[r]`` identifies rank ``r``'s device
    (a label with its UUID), ``machine_of[r]`` its machine.
    """
    users: dict[tuple[int, str], list[int]] = {}
    for rank, (machine, dev) in enumerate(zip(machine_of, devices, strict=True)):
        users.setdefault((machine, dev), []).append(rank)
    for (machine, dev), ranks in users.items():
        if len(ranks) > 1:
            on_machine = sum(1 for m in machine_of if m == machine)
            return (
                f"backend='nccl': ranks {ranks} of machine {machine} would share {dev}, and "
                f"NCCL runs one rank per GPU ({on_machine} ranks on that machine). Start at "
                "most as many ranks per machine as it has visible GPUs (CUDA_VISIBLE_DEVICES), "
                "or use backend='gloo', which stages CUDA tensors through host memory"
            )
    return None


def _check_nccl_devices(found: Layout, dev: torch.device, host: dist.ProcessGroup) -> None:
    """Raise on every rank when two ranks of a machine would share a GPU under NCCL."""
    devices: list[str | None] = [None] * found.size
    dist.all_gather_object(devices, _device_label(dev.index), group=host)
    error = shared_device_error(found.machine_of, devices)  # type: ignore[arg-type]
    if error is not None:
        raise ValueError(error)


def _gather_on_host(obj: object) -> list[object] | None:
    """Every rank's ``obj`` in rank order on rank 0 (None elsewhere): a host-group collective."""
    state = _require()
    gathered: list[object] | None = [None] * state.layout.size if state.layout.rank == 0 else None
    dist.gather_object(obj, gathered, dst=0, group=state.host_group)
    return gathered


def init(
    *, backend: str | None = None, timeout: float | None = None, store: dist.Store | None = None
) -> None:
    """Join the job: set up ``torch.distributed`` and learn the rank layout.

    Reads what ``torchrun`` (or ``gossamer run``) sets; started with plain ``python`` the
    program is a world of size 1. If ``torch.distributed`` is already initialized, gossamer
    uses that process group and leaves it alone at :func:`shutdown`. Calling ``init`` again
    while initialized does nothing.

    Args:
        backend (str, optional): ``"gloo"``, ``"nccl"`` (CUDA tensors over NCCL, CPU tensors
            over gloo) or ``"auto"``. Defaults to ``GOSSAMER_BACKEND`` (``"gloo"``).
        timeout (float, optional): seconds a blocking wait may take. Defaults to
            ``GOSSAMER_TIMEOUT`` (300).
        store (torch.distributed.Store, optional): the rendezvous store of a process group
            started before ``init`` (the one given to ``init_process_group``). gossamer
            keeps a heartbeat per rank there, so that errors after a rank's death name it;
            without it they cannot. Give it on every rank or on none. Each ``init`` on one
            store keeps keys of its own (rank 0 numbers the inits there), so a runtime
            after :func:`shutdown`, or a later job of any size on the store, never reads
            an earlier one's. Ignored when gossamer starts the process group itself.

    Raises:
        ValueError: for an unknown backend, NCCL without CUDA, a non-positive timeout, or
            NCCL with two ranks of a machine on one GPU (more ranks than visible GPUs): the
            message names the ranks and the device. Also, on every rank, for a ``store``
            given on some ranks only (naming those without).
        RankLostError: under ``gossamer run --elastic``, when a rank died before it
            reached ``init`` (the job cannot start without it); it names the rank.
        CommunicationTimeout: under ``gossamer run``, when some rank did not reach
            ``init`` within ``timeout``; it names the ranks.

    Example:
        >>> import gossamer
        >>> gossamer.init()
        >>> gossamer.rank(), gossamer.size()
        (0, 1)
    """
    global _state
    settings = env.settings()
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend must be a str; got {type(backend).__name__}")
    if timeout is not None and (
        isinstance(timeout, bool)
        or not isinstance(timeout, int | float)
        or not 0 < timeout < float("inf")
    ):
        raise ValueError(f"timeout must be a positive number of seconds; got {timeout!r}")
    if store is not None and not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store; got {type(store).__name__}")
    if _state is not None:
        return
    logging.getLogger("gossamer").setLevel(settings.log_level)
    timeout = float(timeout if timeout is not None else settings.timeout)
    owns = not dist.is_initialized()
    store_host = None
    if owns:
        resolved = _resolve_backend((backend or settings.backend).lower())
        store, store_host = _start_process_group(resolved, timeout)
    else:
        resolved = "nccl" if "nccl" in str(dist.get_backend()) else "gloo"
    # Window traffic and small host-side messages always go over gloo.
    host = (
        dist.group.WORLD
        if resolved == "gloo"
        else dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    )
    if not owns:
        store = _keys_of_this_init(store, host)
    found = _discover_layout(settings, host)
    if resolved == "nccl":
        dev = torch.device("cuda", found.local_rank % torch.cuda.device_count())
        # Every rank learns every rank's device, so all raise alike instead of some hanging.
        try:
            _check_nccl_devices(found, dev, host)
        except ValueError:
            if owns:  # leave nothing behind: the program may init again with gloo
                dist.destroy_process_group()
            raise
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    reverse = None
    if resolved == "gloo" and found.machine_size > 1:
        reverse = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
    _state = Runtime(
        layout=found,
        backend=resolved,
        device=dev,
        host_group=host,
        timeout=timeout,
        owns_process_group=owns,
        store=store,
        store_host=store_host,
        reverse_group=reverse,
    )
    profiling.attach(found.rank, found.size, _gather_on_host)
    profiling.maybe_start_from_env()
    for hook in _init_hooks:
        hook()
    logger.debug("initialized rank %d of %d (%s)", _state.layout.rank, _state.layout.size, resolved)


def shutdown() -> None:
    """Leave the job; a no-op when not initialized. Destroys the process group gossamer made."""
    global _state
    if _state is not None:
        for hook in reversed(_shutdown_hooks):
            hook()
        _state.close()
        profiling.detach()
    state, _state = _state, None
    if state is not None and state.owns_process_group and dist.is_initialized():
        dist.destroy_process_group()


atexit.register(shutdown)


def is_initialized() -> bool:
    """True between :func:`init` and :func:`shutdown`."""
    return _state is not None


def runtime() -> Runtime:
    """The runtime of this process.

    Raises:
        NotInitializedError: before :func:`init` or after :func:`shutdown`.
    """
    return _require()


def _require() -> Runtime:
    if _state is None:
        raise NotInitializedError(
            "gossamer is not initialized; call gossamer.init() first (under the facades: "
            "bluefog's bf.init(), Bagua's bagua.init_process_group())"
        )
    return _state


def layout() -> Layout:
    """The rank layout of the job."""
    return _require().layout


def rank() -> int:
    """The rank of this process in the world, between 0 and ``size() - 1``."""
    return _require().layout.rank


def size() -> int:
    """Number of ranks in the world."""
    return _require().layout.size


def local_rank() -> int:
    """This rank's index on its machine."""
    return _require().layout.local_rank


def local_size() -> int:
    """Number of ranks on this rank's machine."""
    return _require().layout.local_size


def machine_rank() -> int:
    """Index of this rank's machine."""
    return _require().layout.machine_rank


def machine_size() -> int:
    """Number of machines in the job."""
    return _require().layout.machine_size


def is_homogeneous() -> bool:
    """True when all machines hold the same number of ranks, numbered contiguously."""
    return _require().layout.homogeneous


def backend() -> str:
    """``"gloo"`` or ``"nccl"``."""
    return _require().backend


def device() -> torch.device:
    """The device this rank computes on (``cpu``, or its CUDA device under NCCL)."""
    return _require().device


def host_group() -> dist.ProcessGroup:
    """A gloo process group over the whole world, for host-side traffic."""
    return _require().host_group


def reverse_group() -> dist.ProcessGroup | None:
    """The world's second gloo group, which carries point-to-point bytes from high to low ranks.

    gloo moves the two directions of one pair's connection in turn, so a pair swap
    (r <-> r + n/2, half of every one-peer exponential schedule) ran at half the link:
    measured on the emulated 1 Gbit/s network (``benchmarks/netbench``, 4 hosts, 21 MB),
    360 ms on one group against 214-235 ms with each direction on its own group, the same
    as a ring shift (215 ms). Made at :func:`init` when the job spans machines under gloo;
    None otherwise (on one machine the links are not the limit).
    """
    return _require().reverse_group


def timeout() -> float:
    """Seconds a blocking wait may take before it raises."""
    return _require().timeout
