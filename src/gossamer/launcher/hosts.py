"""Parsing of ``-H host1:4,host2:4`` host lists and placement of ranks on them."""

from __future__ import annotations

import re
import socket

__all__ = ["is_local_host", "parse_hosts", "place"]

_HOST = re.compile(r"^[A-Za-z0-9_.\-\[\]:]+$")


def parse_hosts(text: str) -> list[tuple[str, int]]:
    """Parse ``"h1:4,h2:4"`` into ``[("h1", 4), ("h2", 4)]``; a host without ``:N`` has 1 slot.

    Raises:
        ValueError: naming ``-H/--hosts`` and the bad entry.
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"-H/--hosts must list hosts like 'host1:4,host2:4'; got {text!r}")
    hosts: list[tuple[str, int]] = []
    for entry in text.split(","):
        name, sep, slots = entry.strip().rpartition(":")
        if not sep:
            name, slots = slots, "1"
        if not name or not _HOST.match(name) or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"-H/--hosts entry {entry!r} is not 'host:slots' with slots >= 1")
        if any(name == seen for seen, _ in hosts):
            raise ValueError(f"-H/--hosts lists host {name!r} twice")
        hosts.append((name, int(slots)))
    return hosts


def place(num_proc: int, hosts: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """Fill hosts in order with ``num_proc`` ranks; hosts left empty are dropped.

    Raises:
        ValueError: when ``num_proc`` exceeds the slots.
    """
    total = sum(slots for _, slots in hosts)
    if num_proc > total:
        raise ValueError(f"-np {num_proc} is more than the {total} slots that -H/--hosts gives")
    placed, left = [], num_proc
    for name, slots in hosts:
        take = min(slots, left)
        if take:
            placed.append((name, take))
        left -= take
    return placed


def is_local_host(name: str) -> bool:
    """True when ``name`` is this machine (so no ssh is needed to start ranks there)."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    return name.startswith("127.") or name == "::1"
