"""The transport: how gossamer's operations and windows reach other ranks.

One communication thread per process (:mod:`~gossamer.transport.engine`), one call header
(:mod:`~gossamer.transport.header`), payloads as raw bytes
(:mod:`~gossamer.transport.payload`), point-to-point exchanges in chunks with same-call
checks (:mod:`~gossamer.transport.p2p`), errors that name the peer or the dead rank
(:mod:`~gossamer.transport.failures`, :mod:`~gossamer.transport.liveness`), the live set the
survivors agree on (:mod:`~gossamer.transport.membership`), argument checks at the public
boundary (:mod:`~gossamer.transport.checks`), bucket allreduces and exchanges posted from
the caller's thread (:mod:`~gossamer.transport.posted`), rejected calls that peers learn of
at once (:mod:`~gossamer.transport.rejection`), agreement among the live ranks through the
store where collectives cannot run (:mod:`~gossamer.transport.survivors`), and device
tensors staged
through host memory on gloo (:mod:`~gossamer.transport.staging`). ``gossamer.ops`` and
``gossamer.windows`` stand on it.
"""

from __future__ import annotations

from gossamer import context
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
from gossamer.transport.failures import find_lost, lost_error, wait_works
from gossamer.transport.handle import Handle
from gossamer.transport.header import (
    DTYPES,
    HEADER_LEN,
    OPS,
    Header,
    codec_name,
    explains_aux,
    name_codec,
)
from gossamer.transport.liveness import get_liveness, leave
from gossamer.transport.membership import (
    Membership,
    MembershipChange,
    get_membership,
    live_ranks,
    membership_epoch,
    on_membership_change,
)
from gossamer.transport.p2p import Survived, check_same_call
from gossamer.transport.payload import as_bytes, from_bytes, nbytes_of
from gossamer.transport.posted import (
    Posted,
    PostedExchange,
    can_post,
    post_allreduce,
    post_exchange,
    post_exchange_works,
)
from gossamer.transport.rejection import gather_reasons, peer_argument_error, reject

# The exchanges that reach other modules are staged: device tensors travel through host
# memory on gloo (transport.staging).
from gossamer.transport.staging import (
    exchange,
    exchange_rejected,
    exchange_surviving,
    needs_staging,
    staged,
    to_device,
    to_host,
)
from gossamer.transport.survivors import gather_live, known_dead, lead

# Every rank's heartbeat starts at init, so a rank that dies before its first operation is
# still seen to die; a rank that leaves by shutdown() says so (transport.liveness).
context.on_init(get_liveness)
context.on_shutdown(leave)

__all__ = [
    "AVERAGING_DTYPES",
    "DTYPES",
    "HEADER_LEN",
    "OPS",
    "Handle",
    "Header",
    "Membership",
    "MembershipChange",
    "Posted",
    "PostedExchange",
    "Survived",
    "as_bytes",
    "can_post",
    "check_flag",
    "check_rank",
    "check_rank_list",
    "check_same_call",
    "check_tensor",
    "check_topology",
    "check_weight",
    "check_weights",
    "codec_name",
    "explains_aux",
    "exchange",
    "exchange_rejected",
    "exchange_surviving",
    "find_lost",
    "from_bytes",
    "gather_live",
    "gather_reasons",
    "get_liveness",
    "get_membership",
    "known_dead",
    "group_rank",
    "group_size",
    "lead",
    "live_ranks",
    "membership_epoch",
    "lost_error",
    "name_codec",
    "nbytes_of",
    "needs_staging",
    "on_membership_change",
    "peer_argument_error",
    "post_allreduce",
    "post_exchange",
    "post_exchange_works",
    "reject",
    "run",
    "staged",
    "submit",
    "to_device",
    "to_host",
    "wait_works",
]
