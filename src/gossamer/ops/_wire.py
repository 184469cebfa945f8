"""What goes on the wire: call headers, point-to-point exchanges, and error translation.

Before its data, every neighbour exchange sends a 16-integer header (operation, dtype,
shape). The receiver checks it against its own call and sizes its buffer from it, so a peer
that called another operation or passed another shape produces an error naming both sides,
not garbage or a hang. Headers and data travel on different tags, so a stray data message can
never be taken for a header.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.errors import CommunicationTimeout, PeerError
from gossamer.profiling import timeline as _timeline

__all__ = [
    "DTYPES",
    "check_same_call",
    "describe",
    "exchange",
    "header",
    "wait_works",
]

_MAGIC = 0x605_5A3E
_HEADER_LEN = 16
_MAX_DIMS = 10  # header slots for dims; further dims are folded into one product
_HEADER_TAG = 0x6F01
_DATA_TAG = 0x6F02  # data chunks use 0x6F02 .. 0x6F02 + _MAX_CHUNKS - 1
# Large CPU messages between machines travel as several chunks in flight per peer.
# Measured on emulated 100 Mbit links (benchmarks/netbench, 4 hosts): a 1.2 MB exchange
# alternating between peers took 150 ms per call as one gloo message and 110 ms as 4 or 16
# chunks (wire time 96 ms). On one machine (bench_ops, loopback) chunks made 1e6-element
# exchanges about 30 % slower, so messages between ranks of one machine stay whole.
_CHUNK_BYTES = 256 * 2**10
_MAX_CHUNKS = 32

DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_OPS = (
    "allreduce",
    "broadcast",
    "allgather",
    "neighbor_allreduce",
    "neighbor_allgather",
    "hierarchical_neighbor_allreduce",
    "pair_gossip",
    "window_create",
)


def header(op: str, tensor: torch.Tensor, aux: int = 0) -> torch.Tensor:
    """Encode ``op``, ``aux`` (e.g. the root rank) and the tensor's dtype and shape."""
    shape = list(tensor.shape)
    dims = shape[:_MAX_DIMS]
    rest = 1
    for d in shape[_MAX_DIMS:]:
        rest *= d
    values = [_MAGIC, _OPS.index(op), aux, DTYPES.index(tensor.dtype), len(shape)]
    values += dims + [-1] * (_MAX_DIMS - len(dims)) + [rest]
    return torch.tensor(values, dtype=torch.int64)


def _fields(h: torch.Tensor) -> tuple[str, int, torch.dtype, list[int]]:
    values = h.tolist()
    if values[0] != _MAGIC or not 0 <= values[1] < len(_OPS) or not 0 <= values[3] < len(DTYPES):
        raise PeerError(f"received a corrupt call header {values}")
    ndim = values[4]
    shape = values[5 : 5 + min(ndim, _MAX_DIMS)]
    if ndim > _MAX_DIMS:
        shape.append(values[-1])  # folded: only used to size the drain buffer
    return _OPS[values[1]], values[2], DTYPES[values[3]], shape


def describe(h: torch.Tensor) -> str:
    """``"neighbor_allreduce of float32[3, 4]"`` (plus ``aux`` when it is set)."""
    op, aux, dtype, shape = _fields(h)
    extra = f" (root {aux})" if op == "broadcast" else ""
    return f"{op}{extra} of {str(dtype).removeprefix('torch.')}{shape}"


def _compatible(mine: torch.Tensor, theirs: torch.Tensor, any_first_dim: bool) -> bool:
    a, b = mine.tolist(), theirs.tolist()
    if a[:5] != b[:5]:
        return False
    if any_first_dim and a[4] >= 1:
        return a[6:] == b[6:]
    return a == b


# Receive buffers are reused across calls: a fresh multi-megabyte allocation costs page
# faults on every call. Operations run one at a time on the communication thread and consume
# their buffers before they return, so one buffer per (peer, dtype, size) suffices.
_CACHE_BYTES = 512 * 2**20
_cache: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _buffer_for(h: torch.Tensor, device: torch.device, peer: int) -> torch.Tensor:
    _, _, dtype, shape = _fields(h)
    numel = math.prod(shape)
    key = (peer, dtype, numel, device)
    flat = _cache.pop(key, None)
    if flat is None:
        flat = torch.empty(numel, dtype=dtype, device=device)
    _cache[key] = flat
    while sum(t.nbytes for t in _cache.values()) > _CACHE_BYTES and len(_cache) > 1:
        _cache.popitem(last=False)
    return flat.view(shape)


def _global(group: dist.ProcessGroup | None, rank: int) -> int:
    return rank if group is None else dist.get_global_rank(group, rank)


def wait_works(op: str, works: Iterable[tuple[int, dist.Work]]) -> None:
    """Wait for each ``(peer, work)``; turn gloo's errors into errors that name the peer."""
    for peer, work in works:
        try:
            work.wait()
        except RuntimeError as err:
            text = str(err)
            who = "all ranks" if peer < 0 else f"rank {peer}"
            if "Timed out" in text or "timeout" in text.lower():
                raise CommunicationTimeout(
                    f"{op}: rank {context.rank()} timed out after {context.timeout():g} s "
                    f"waiting for {who}"
                ) from err
            if "closed" in text or "reset" in text or "Broken pipe" in text:
                raise PeerError(
                    f"{op}: {who} closed its connection to rank {context.rank()}; "
                    "did that rank crash or exit?"
                ) from err
            raise PeerError(f"{op}: communication with {who} failed: {text}") from err


def _chunks(tensor: torch.Tensor, remote: bool) -> list[torch.Tensor]:
    """``tensor`` as consecutive pieces of about ``_CHUNK_BYTES`` (views where it can be).

    Only messages to or from another machine are split: on one machine the pieces cost
    more than they gain. Both sides split by element count and by machine alone, so a
    sender's pieces match its receiver's.
    """
    if not remote or tensor.device.type != "cpu" or tensor.nbytes <= _CHUNK_BYTES:
        return [tensor]  # NCCL coalesces a batch itself
    pieces = min(_MAX_CHUNKS, math.ceil(tensor.nbytes / _CHUNK_BYTES))
    return list(tensor.reshape(-1).tensor_split(pieces))


def _p2p(
    op: str,
    sends: Sequence[tuple[int, torch.Tensor]],
    recvs: Sequence[tuple[int, torch.Tensor]],
    group: dist.ProcessGroup | None,
    tag: int,
) -> None:
    """Post every send and receive at once, in chunks with tags ``tag``, ``tag + 1``, ..."""
    layout = context.layout()

    def pieces(peer: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        remote = layout.machine_of[_global(group, peer)] != layout.machine_rank
        return _chunks(tensor, remote)

    posts = [(dist.isend, p, c) for p, t in sends for c in pieces(p, t)]
    posts += [(dist.irecv, p, c) for p, t in recvs for c in pieces(p, t)]
    if not posts:
        return
    ops, index = [], {}
    for fn, peer, chunk in posts:
        k = index[fn, peer] = index.get((fn, peer), -1) + 1
        ops.append(dist.P2POp(fn, chunk, group=group, group_peer=peer, tag=tag + k))
    works = dist.batch_isend_irecv(ops)
    peers = [p for _, p, _ in posts]
    if len(works) != len(peers):  # a coalescing backend (NCCL) returns one work
        peers = [-1] * len(works)
    wait_works(op, [(_global(group, p), w) for p, w in zip(peers, works, strict=True)])


def exchange(
    op: str,
    tensor: torch.Tensor,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    *,
    any_first_dim: bool = False,
) -> dict[int, torch.Tensor]:
    """Send ``sends[d]`` to every ``d`` and receive one tensor from every rank in ``sources``.

    Ranks are ranks of ``group``. ``tensor`` is this rank's argument, against which the
    peers' headers are checked (all dims, or all but the first with ``any_first_dim``).

    The returned tensors are reused by the next exchange: consume them before returning.

    Raises:
        PeerError: a source called another operation, dtype or shape. The data is still
            received (and dropped) first, so the sender does not hang.
    """
    mine = header(op, tensor)
    heads = {s: torch.empty(_HEADER_LEN, dtype=torch.int64) for s in sources}
    with _timeline.record(op, "communicating"):
        _p2p(op, [(d, mine) for d in sends], list(heads.items()), group, _HEADER_TAG)
        received = {s: _buffer_for(h, tensor.device, s) for s, h in heads.items()}
        _p2p(op, list(sends.items()), list(received.items()), group, _DATA_TAG)
    wrong = [s for s, h in heads.items() if not _compatible(mine, h, any_first_dim)]
    if wrong:
        theirs = "; ".join(f"rank {_global(group, s)} called {describe(heads[s])}" for s in wrong)
        raise PeerError(
            f"{op}: mismatched call: rank {context.rank()} called {describe(mine)}, but {theirs}"
        )
    return received


def check_same_call(
    op: str,
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    aux: int = 0,
    *,
    any_first_dim: bool = False,
) -> list[list[int]]:
    """Check that every rank of ``group`` made the same call; return every rank's shape.

    Raises:
        PeerError: on every rank alike, naming the ranks whose call differs from rank 0's.
    """
    mine = header(op, tensor, aux)
    size = dist.get_world_size(group)
    gathered = [torch.empty_like(mine) for _ in range(size)]
    with _timeline.record(op, "communicating"):
        wait_works(op, [(-1, dist.all_gather(gathered, mine, group=group, async_op=True))])
    first = gathered[0]
    wrong = [r for r, h in enumerate(gathered) if not _compatible(first, h, any_first_dim)]
    if wrong:
        theirs = "; ".join(f"rank {r} called {describe(gathered[r])}" for r in wrong)
        raise PeerError(f"{op}: mismatched call: rank 0 called {describe(first)}, but {theirs}")
    return [_fields(h)[3] for h in gathered]
