"""The transport: how gossamer's operations and windows reach other ranks.

One communication thread per process (:mod:`~gossamer.transport.engine`), one call header
(:mod:`~gossamer.transport.header`), point-to-point exchanges in chunks with same-call
checks (:mod:`~gossamer.transport.p2p`), errors that name the peer
(:mod:`~gossamer.transport.failures`), and argument checks at the public boundary
(:mod:`~gossamer.transport.checks`). ``gossamer.ops`` and ``gossamer.windows`` stand on it.
"""

from __future__ import annotations

from gossamer.transport.checks import (
    AVERAGING_DTYPES,
    check_flag,
    check_rank,
    check_rank_list,
    check_tensor,
    check_topology,
    check_weight,
    check_weights,
    group_rank,
    group_size,
)
from gossamer.transport.engine import run, submit
from gossamer.transport.failures import wait_works
from gossamer.transport.handle import Handle
from gossamer.transport.header import DTYPES, HEADER_LEN, OPS, Header
from gossamer.transport.p2p import check_same_call, exchange

__all__ = [
    "AVERAGING_DTYPES",
    "DTYPES",
    "HEADER_LEN",
    "OPS",
    "Handle",
    "Header",
    "check_flag",
    "check_rank",
    "check_rank_list",
    "check_same_call",
    "check_tensor",
    "check_topology",
    "check_weight",
    "check_weights",
    "exchange",
    "group_rank",
    "group_size",
    "run",
    "submit",
    "wait_works",
]
