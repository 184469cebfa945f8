"""The rendezvous of a single-machine job: one TCP store that listens on 127.0.0.1 only.

torchrun's ``--standalone`` starts its c10d rendezvous store and a second store for the
ranks with ``TCPStore(..., is_master=True)``, and a TCPStore server listens on every
interface whatever host it is given (``*:port``), with no authentication. Here the agent
binds a socket to ``127.0.0.1`` itself and hands it to one ``TCPStore``
(``master_listen_fd``), which serves both the agent and the ranks (``MASTER_ADDR``).

Importing this module imports torch; :func:`register` makes the backend known to torchrun
as :data:`BACKEND`.
"""

from __future__ import annotations

import socket
from datetime import timedelta

from torch.distributed import PrefixStore, Store, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)
from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

__all__ = ["BACKEND", "LoopbackRendezvous", "register"]

BACKEND = "gossamer-loopback"
_LOOPBACK = "127.0.0.1"


class LoopbackRendezvous(RendezvousHandler):
    """A rendezvous of one node whose store listens on ``127.0.0.1`` only.

    Args:
        run_id (str): the job id; the agent's keys live under it.
        port (int): port to listen on; 0 picks a free one.
        timeout (float): seconds a store operation may wait.
    """

    def __init__(self, run_id: str, port: int = 0, timeout: float = 600.0) -> None:
        self._run_id = run_id
        self._timeout = timedelta(seconds=timeout)
        # Bound and listening before torchrun asks, so the port is ours from now on.
        self._socket: socket.socket | None = socket.create_server((_LOOPBACK, port), backlog=512)
        self.port: int = self._socket.getsockname()[1]
        self._store: Store | None = None

    def get_backend(self) -> str:
        """The name torchrun knows this handler by."""
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        """The ranks use the agent's store (``MASTER_ADDR:MASTER_PORT``) instead of their own."""
        return True

    def next_rendezvous(self) -> RendezvousInfo:
        """Start the store on the first call; the node is always rank 0 of 1."""
        if self._store is None:
            if self._socket is None:
                raise RuntimeError("the loopback rendezvous was shut down before it started")
            # TCPStore takes the listening descriptor over (libuv closes it at the end).
            fd = self._socket.detach()
            self._socket = None
            self._store = TCPStore(
                _LOOPBACK,
                self.port,
                is_master=True,
                timeout=self._timeout,
                wait_for_workers=False,
                multi_tenant=True,
                master_listen_fd=fd,
            )
        return RendezvousInfo(
            PrefixStore(self._run_id, self._store),
            0,
            1,
            RendezvousStoreInfo(_LOOPBACK, self.port),
        )

    def is_closed(self) -> bool:
        """Never closed: there is no other node to close it."""
        return False

    def set_closed(self) -> None:
        """Nothing to do for a single node."""

    def num_nodes_waiting(self) -> int:
        """No node can join a single-machine job."""
        return 0

    def get_run_id(self) -> str:
        """The job id."""
        return self._run_id

    def shutdown(self) -> bool:
        """Release the socket if the store never started; the store ends with the agent."""
        if self._socket is not None:
            self._socket.close()
            self._socket = None
        return True


def _create(params: RendezvousParameters) -> RendezvousHandler:
    host, port = parse_rendezvous_endpoint(params.endpoint, default_port=0)
    if host not in (_LOOPBACK, "localhost"):
        raise ValueError(f"--rdzv-endpoint of {BACKEND} must be on {_LOOPBACK}; got {host!r}")
    return LoopbackRendezvous(params.run_id, port, float(params.get("timeout", 600)))


def register() -> None:
    """Make :data:`BACKEND` a torchrun ``--rdzv-backend`` in this process (idempotent)."""
    rendezvous_handler_registry.register(BACKEND, _create)
