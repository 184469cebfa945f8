"""An emulated cluster on one machine: network namespaces as hosts, shaped veth links.

Layout for ``hosts`` hosts under a name prefix ``P``::

    namespace P-sw:  bridge br0 <- v0, v1, ...        (the "switch")
    namespace P-hK:  eth0 (10.77.0.K+1/24) <-> vK     (host K; loopback up)

Every host's link is shaped with ``tc tbf`` in both directions: on ``eth0`` inside the host
(what the host sends) and on ``vK`` inside the switch namespace (what it receives). Nothing
is created in the root namespace, so removing the namespaces removes everything; the
:class:`Cluster` context manager removes exactly the namespaces it created, also when the
body raises or is interrupted (SIGINT, SIGTERM). Hosts run TCP with ``congestion``
(default cubic, Linux's own default) whatever the machine's default is.

The pure parts (rate parsing, host plan, tc arguments) need neither root nor iproute2.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass

__all__ = [
    "Cluster",
    "HostSpec",
    "format_rate",
    "parse_rate",
    "parse_rates",
    "plan_hosts",
    "preflight",
    "tbf_args",
]

SUBNET = "10.77.0"
IFACE = "eth0"
# Linux's default. Under bbr (some machines' default) a connection that idles every other
# step, as the one-peer schedule's do, moved 21 MB in 207-215 ms against cubic's 192 ms
# at 1 Gbit (docs/benchmarks.md, session 10).
CONGESTION = "cubic"
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


def parse_rate(text: str) -> int | None:
    """Bits per second of a tc-style rate (``10gbit``, ``100mbit``, ``1.5gbit``).

    ``unshaped`` (or ``none``, ``inf``) gives None: no shaping at all.

    Raises:
        ValueError: anything else, or a rate that is not positive.
    """
    word = text.strip().lower()
    if word in ("unshaped", "none", "inf"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(bit|bps)?", word)
    if not match:
        raise ValueError(f"not a rate: {text!r} (try 1gbit, 100mbit or unshaped)")
    value = float(match.group(1)) * _UNITS[match.group(2)]
    if match.group(3) == "bps":  # tc's "bps" means bytes per second
        value *= 8
    if value <= 0:
        raise ValueError(f"rate must be positive: {text!r}")
    return int(value)


def parse_rates(text: str) -> list[int | None]:
    """A comma-separated list of rates, in the given order, without duplicates."""
    rates: list[int | None] = []
    for part in text.split(","):
        if part.strip():
            rate = parse_rate(part)
            if rate not in rates:
                rates.append(rate)
    if not rates:
        raise ValueError("no rates given")
    return rates


def format_rate(bits: int | None) -> str:
    """The short label of a rate: ``unshaped``, ``10gbit``, ``100mbit``, ``1.5gbit``."""
    if bits is None:
        return "unshaped"
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits >= scale:
            return f"{bits / scale:g}{unit}"
    return f"{bits}bit"


def tbf_args(bits: int) -> list[str]:
    """``tc qdisc`` arguments of a token bucket at ``bits`` per second.

    The bucket holds 5 ms of traffic, at least 256 KiB: veth hands tc segments of up to
    64 KiB (GSO), and a bucket smaller than one segment would drop it for ever. The queue
    holds 50 ms, enough for TCP to keep the link busy without a standing delay to speak of.
    """
    burst = max(256 * 1024, bits // 8 // 200)
    return ["tbf", "rate", f"{bits}bit", "burst", str(burst), "latency", "50ms"]


@dataclass(frozen=True)
class HostSpec:
    """One emulated host: its namespace, address, link names and global ranks."""

    index: int
    namespace: str
    address: str
    switch_port: str
    ranks: tuple[int, ...]

    @property
    def interface(self) -> str:
        """The host's network interface (inside its namespace)."""
        return IFACE


def plan_hosts(hosts: int, ranks_per_host: int, prefix: str) -> list[HostSpec]:
    """The hosts of a cluster; host ``k`` holds ranks ``k*p .. k*p+p-1`` (node-rank order).

    Raises:
        ValueError: fewer than 1 host or rank per host, or more hosts than the subnet holds.
    """
    if hosts < 1 or ranks_per_host < 1:
        raise ValueError(f"need >= 1 host and rank per host; got {hosts}, {ranks_per_host}")
    if hosts > 250:
        raise ValueError(f"at most 250 hosts; got {hosts}")
    return [
        HostSpec(
            index=k,
            namespace=f"{prefix}-h{k}",
            address=f"{SUBNET}.{k + 1}",
            switch_port=f"v{k}",
            ranks=tuple(range(k * ranks_per_host, (k + 1) * ranks_per_host)),
        )
        for k in range(hosts)
    ]


def preflight() -> str | None:
    """Why namespaces cannot be made here (not root, no iproute2), or None if they can."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and tc); run as root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"needs iproute2 ({', '.join(missing)} not found on PATH)"
    return None


# Run inside a host: set its congestion control to argv[1] if given; print what it runs.
# Python rather than sysctl(8), which a bare machine may lack.
_CONGESTION_SCRIPT = """
import sys
path = "/proc/sys/net/ipv4/tcp_congestion_control"
if len(sys.argv) > 1:
    try:
        with open(path, "w") as f:
            f.write(sys.argv[1])
    except OSError as err:
        print(err, file=sys.stderr)
print(open(path).read().strip())
"""


def _set_congestion(ns: list[str], name: str | None) -> str:
    """Set the host's TCP congestion control to ``name`` (None: keep); return what it runs.

    A namespace starts with the machine's default. Linux lets a namespace pick only
    algorithms the machine allows to unprivileged users, so where ``name`` is refused
    this warns and keeps the default, and the results record which one ran.
    """
    argv = [*ns, sys.executable, "-c", _CONGESTION_SCRIPT, *([name] if name else [])]
    result = subprocess.run(argv, capture_output=True, text=True, check=True)
    if result.stderr.strip():
        allow = f'sysctl -w net.ipv4.tcp_allowed_congestion_control="... {name}"'
        print(
            f"netbench: {name} refused ({result.stderr.strip()}); the hosts keep the "
            f"machine's congestion control (allow it with {allow})",
            file=sys.stderr,
        )
    return result.stdout.strip()


def _sh(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True, check=False)
    if result.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed: {result.stderr.strip()}")


class Cluster:
    """Namespaces, bridge and shaped links for ``hosts`` hosts at ``rate`` bits/s (None: unshaped).

    Use as a context manager; :meth:`close` removes what :meth:`open` created.
    """

    def __init__(
        self,
        hosts: int,
        rate: int | None,
        *,
        prefix: str | None = None,
        congestion: str | None = CONGESTION,
    ) -> None:
        self.rate = rate
        self.congestion = congestion
        self.congestion_used: str | None = None  # what the hosts run, read back at open
        # The pid keeps concurrent runs apart; namespace names allow far more than this.
        self.prefix = prefix or f"gnb{os.getpid()}"
        self.switch = f"{self.prefix}-sw"
        self.hosts = plan_hosts(hosts, 1, self.prefix)
        self._created: list[str] = []
        self._old_handlers: dict[int, object] = {}

    def netns_exec(self, host: HostSpec) -> list[str]:
        """The command prefix that runs a program inside ``host``."""
        return ["ip", "netns", "exec", host.namespace]

    def open(self) -> Cluster:
        """Create the namespaces and links; on any failure, remove what was made and raise."""
        reason = preflight()
        if reason:
            raise RuntimeError(reason)
        # SIGTERM would skip the finally blocks; make it unwind like Ctrl-C does.
        self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, _raise_interrupt)
        try:
            self._add_netns(self.switch)
            sw = ["ip", "netns", "exec", self.switch]
            _sh(*sw, "ip", "link", "add", "br0", "type", "bridge")
            _sh(*sw, "ip", "link", "set", "br0", "up")
            _sh(*sw, "ip", "link", "set", "lo", "up")
            for host in self.hosts:
                self._add_host(host, sw)
        except BaseException:
            self.close()
            raise
        return self

    def _add_netns(self, name: str) -> None:
        _sh("ip", "netns", "add", name)
        self._created.append(name)

    def _add_host(self, host: HostSpec, sw: list[str]) -> None:
        self._add_netns(host.namespace)
        ns = self.netns_exec(host)
        _sh(*sw, "ip", "link", "add", host.switch_port, "type", "veth",
            "peer", "name", IFACE, "netns", host.namespace)  # fmt: skip
        _sh(*sw, "ip", "link", "set", host.switch_port, "master", "br0")
        _sh(*sw, "ip", "link", "set", host.switch_port, "up")
        _sh(*ns, "ip", "addr", "add", f"{host.address}/24", "dev", IFACE)
        _sh(*ns, "ip", "link", "set", IFACE, "up")
        # Ranks on one host talk to each other over loopback.
        _sh(*ns, "ip", "link", "set", "lo", "up")
        self.congestion_used = _set_congestion(ns, self.congestion)
        if self.rate is not None:
            _sh(*ns, "tc", "qdisc", "add", "dev", IFACE, "root", *tbf_args(self.rate))
            _sh(*sw, "tc", "qdisc", "add", "dev", host.switch_port, "root", *tbf_args(self.rate))

    def close(self) -> None:
        """Delete the namespaces this cluster created (veths and bridge go with them)."""
        errors = []
        for name in reversed(self._created):
            result = subprocess.run(
                ["ip", "netns", "del", name], capture_output=True, text=True, check=False
            )
            if result.returncode:
                errors.append(f"{name}: {result.stderr.strip()}")
        self._created.clear()
        for signum, handler in self._old_handlers.items():
            signal.signal(signum, handler)
        self._old_handlers.clear()
        if errors:
            raise RuntimeError("could not remove namespaces: " + "; ".join(errors))

    def __enter__(self) -> Cluster:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()


def _raise_interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
