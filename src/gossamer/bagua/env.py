"""Bagua's ``env`` helpers: this process's place in the job.

Bagua reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` directly. Here
the answers come from gossamer's rank layout once gossamer is initialized (so
``GOSSAMER_NODES_PER_MACHINE`` fakes machines for the local ones too) and from what the
launcher set before that.
"""

from __future__ import annotations

from gossamer import context
from gossamer import env as _env

__all__ = [
    "DEFAULT_BUCKET_SIZE",
    "get_default_bucket_size",
    "get_local_rank",
    "get_local_size",
    "get_node_rank",
    "get_rank",
    "get_world_size",
]

#: Bagua's default bucket size in bytes (``BAGUA_DEFAULT_BUCKET_SIZE``, 10 MiB).
DEFAULT_BUCKET_SIZE = 10 * 2**20


def get_world_size() -> int:
    """Number of processes in the default process group."""
    if context.is_initialized():
        return context.size()
    return _env.launch_info().world_size


def get_rank() -> int:
    """Rank of this process in the default process group, ``0 .. world_size - 1``."""
    if context.is_initialized():
        return context.rank()
    return _env.launch_info().rank


def get_local_rank() -> int:
    """Index of this process among the processes of its machine."""
    if context.is_initialized():
        return context.local_rank()
    local = _env.launch_info().local_rank
    return 0 if local is None else local


def get_local_size() -> int:
    """Number of processes on this process's machine."""
    if context.is_initialized():
        return context.local_size()
    local = _env.launch_info().local_world_size
    return 1 if local is None else local


def get_node_rank() -> int:
    """Index of this process's machine."""
    if context.is_initialized():
        return context.machine_rank()
    node = _env.launch_info().node_rank
    return 0 if node is None else node


def get_default_bucket_size() -> int:
    """Bytes per communication bucket before a new bucket starts (10 MiB)."""
    return DEFAULT_BUCKET_SIZE
