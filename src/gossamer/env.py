"""The only reader of environment variables in gossamer.

gossamer's own settings (all optional):

=============================  =========  ===================================================
variable                       default    meaning
=============================  =========  ===================================================
``GOSSAMER_BACKEND``           ``gloo``   ``gloo``, ``nccl`` or ``auto`` (NCCL when CUDA is
                                          available); :func:`gossamer.init` may override it
``GOSSAMER_TIMEOUT``           ``300``    seconds any blocking wait may take before it raises
                                          :class:`~gossamer.errors.CommunicationTimeout`
``GOSSAMER_DEAD_AFTER``        ``3``      seconds a peer's heartbeat may stand still, while
                                          this rank waits for it, before the peer counts
                                          as lost; peers of this machine count as lost
                                          when their process ends, not by heartbeat
                                          (unless stopped); raise it for peers elsewhere
                                          that hold the GIL that long in one C call
``GOSSAMER_NODES_PER_MACHINE`` unset      fake machine boundaries on one host: ranks
                                          ``k*m .. k*m+k-1`` form machine ``m``;
                                          ``BLUEFOG_NODES_PER_MACHINE`` is the fallback
``GOSSAMER_LOG_LEVEL``         ``WARNING`` level of the ``gossamer`` logger
``GOSSAMER_TIMELINE``          unset      path prefix: :func:`gossamer.init` starts the
                                          timeline, and rank ``k`` writes
                                          ``<prefix>.rank<k>.json`` (Chrome trace) at exit;
                                          a ``{rank}`` in it is replaced instead
``GOSSAMER_CHECKPOINT_DIR``    unset      directory of automatic checkpoints
                                          (:class:`gossamer.checkpoint.AutoResume`); set by
                                          ``gossamer run --checkpoint-dir``
``GOSSAMER_CHECKPOINT_EVERY``  unset      steps between automatic checkpoints; set by
                                          ``gossamer run --checkpoint-every``
``GOSSAMER_CHECKPOINT_RESIZE`` ``0``      ``1``: automatic checkpoints resume on another
                                          number of ranks (the saved ranks' average); set
                                          by ``gossamer run --nnodes MIN:MAX``
=============================  =========  ===================================================

BlueFog's variables, for programs run through the BlueFog facade (:mod:`gossamer.bluefog`):

=============================  =========  ===================================================
variable                       default    meaning
=============================  =========  ===================================================
``BLUEFOG_TIMELINE``           unset      file prefix: ``bf.init()`` starts the timeline,
                                          and rank ``k`` writes ``<prefix><k>.json`` (as
                                          BlueFog names it) at ``bf.shutdown()`` or exit;
                                          ``GOSSAMER_TIMELINE`` wins when both are set
``BLUEFOG_NODES_PER_MACHINE``  unset      fallback of ``GOSSAMER_NODES_PER_MACHINE``
=============================  =========  ===================================================

Set by the launcher (``torchrun``): ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK`` (the node's index), ``MASTER_ADDR``, ``MASTER_PORT``, and
``TORCHELASTIC_USE_AGENT_STORE`` (the launcher's agent hosts the rendezvous store) and
``TORCHELASTIC_RESTART_COUNT`` (how often the agent has restarted the ranks). Without them a
program runs as world size 1.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

__all__ = [
    "BACKENDS",
    "CHECKPOINT_DIR",
    "CHECKPOINT_EVERY",
    "CHECKPOINT_RESIZE",
    "DEAD_KEY",
    "DEATHS_KEY",
    "LEFT_KEY",
    "LaunchInfo",
    "Settings",
    "launch_info",
    "settings",
]

BACKENDS = ("gloo", "nccl", "auto")
# Set by `gossamer run --checkpoint-dir/--checkpoint-every`, read by checkpoint.AutoResume.
CHECKPOINT_DIR = "GOSSAMER_CHECKPOINT_DIR"
CHECKPOINT_EVERY = "GOSSAMER_CHECKPOINT_EVERY"
CHECKPOINT_RESIZE = "GOSSAMER_CHECKPOINT_RESIZE"
# The store key (plus a global rank) under which the launcher's agent marks a rank it saw
# die; the ranks' liveness reads it (the one contract between the two, hence here).
DEAD_KEY = "gossamer/dead/"
# Counts the tombstones the agent wrote (after each one): a rank waiting for every rank to
# reach init polls this one key, instead of one tombstone per rank.
DEATHS_KEY = "gossamer/deaths"
# A rank that leaves by shutdown() sets this (plus its rank) to the ranks it had found lost:
# its peers tell a leaver from a death by it, and the agent an early finisher from a survivor.
LEFT_KEY = "gossamer/left/"
_LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


@dataclass(frozen=True)
class Settings:
    """gossamer's settings as read from ``GOSSAMER_*`` variables."""

    backend: str = "gloo"
    timeout: float = 300.0
    dead_after: float = 3.0  # a heartbeat that stood still this long marks its rank lost
    nodes_per_machine: int | None = None
    log_level: str = "WARNING"
    timeline: str | None = None  # path prefix of the Chrome-trace timeline; None is off
    # BlueFog's file prefix (BLUEFOG_TIMELINE), honoured by the facade's init; None is off
    bluefog_timeline: str | None = None
    checkpoint_dir: str | None = None  # automatic checkpoints (checkpoint.AutoResume)
    checkpoint_every: int | None = None  # steps between them
    checkpoint_resize: bool = False  # resume them on another number of ranks


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher told this process about its place in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    master_addr: str | None = None
    master_port: int | None = None
    agent_store: bool = False  # the store at MASTER_ADDR:MASTER_PORT is the launcher agent's
    restart_count: int = 0  # how often torchrun's agent restarted the ranks (this attempt)

    @property
    def launched(self) -> bool:
        """True when a launcher set ``RANK`` and ``WORLD_SIZE``."""
        return self.master_addr is not None


def _int(env: Mapping[str, str], name: str, *, minimum: int) -> int | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer; got {raw!r}") from None
    if value < minimum:
        raise ValueError(f"environment variable {name} must be >= {minimum}; got {value}")
    return value


def _seconds(env: Mapping[str, str], name: str, default: str) -> float:
    raw = env.get(name, default)
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ValueError(
            f"environment variable {name} must be a positive number of seconds; got {raw!r}"
        )
    return value


def _flag(env: Mapping[str, str], name: str) -> bool:
    raw = env.get(name, "0")
    if raw not in ("0", "1"):
        raise ValueError(f"environment variable {name} must be 0 or 1; got {raw!r}")
    return raw == "1"


def settings(env: Mapping[str, str] | None = None) -> Settings:
    """Read and validate gossamer's variables (from ``os.environ`` by default)."""
    env = os.environ if env is None else env
    backend = env.get("GOSSAMER_BACKEND", "gloo").lower()
    if backend not in BACKENDS:
        raise ValueError(
            f"environment variable GOSSAMER_BACKEND must be one of {BACKENDS}; got {backend!r}"
        )
    level = env.get("GOSSAMER_LOG_LEVEL", "WARNING").upper()
    if level not in _LOG_LEVELS:
        raise ValueError(
            f"environment variable GOSSAMER_LOG_LEVEL must be one of {_LOG_LEVELS}; got {level!r}"
        )
    return Settings(
        backend=backend,
        timeout=_seconds(env, "GOSSAMER_TIMEOUT", "300"),
        dead_after=_seconds(env, "GOSSAMER_DEAD_AFTER", "3"),
        nodes_per_machine=_int(env, "GOSSAMER_NODES_PER_MACHINE", minimum=1)
        or _int(env, "BLUEFOG_NODES_PER_MACHINE", minimum=1),
        log_level=level,
        timeline=env.get("GOSSAMER_TIMELINE") or None,
        bluefog_timeline=env.get("BLUEFOG_TIMELINE") or None,
        checkpoint_dir=env.get(CHECKPOINT_DIR) or None,
        checkpoint_every=_int(env, CHECKPOINT_EVERY, minimum=1),
        checkpoint_resize=_flag(env, CHECKPOINT_RESIZE),
    )


def launch_info(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read what ``torchrun`` sets; world size 1 when nothing is set."""
    env = os.environ if env is None else env
    world_size = _int(env, "WORLD_SIZE", minimum=1)
    rank = _int(env, "RANK", minimum=0)
    if world_size is None or rank is None:
        return LaunchInfo()
    if rank >= world_size:
        raise ValueError(
            f"environment variable RANK={rank} is out of range for WORLD_SIZE={world_size}"
        )
    return LaunchInfo(
        rank=rank,
        world_size=world_size,
        local_rank=_int(env, "LOCAL_RANK", minimum=0),
        local_world_size=_int(env, "LOCAL_WORLD_SIZE", minimum=1),
        node_rank=_int(env, "GROUP_RANK", minimum=0),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=_int(env, "MASTER_PORT", minimum=1),
        agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
        restart_count=_int(env, "TORCHELASTIC_RESTART_COUNT", minimum=0) or 0,
    )
