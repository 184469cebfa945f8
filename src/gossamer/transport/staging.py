"""Device tensors over gloo: staged through host memory at the operation's boundary.

gloo reads and writes the memory of the tensors it is given. Its point-to-point sends and
receives take the pointer as host memory, whatever the device: a CUDA tensor there aborts
the process (``writev: Bad address``). Some of its collectives accept CUDA tensors, but
not all, and not in every build, and the operations here view tensors as raw bytes and
allocate buffers on the argument's device. So a tensor that is not in host memory is
copied into pinned host memory where it enters an operation, the operation runs on the
host copy exactly as on a CPU tensor, and the result is copied back to the argument's
device (into the argument itself for in-place operations). One copy in and one copy out
per call, as gloo's own CUDA collectives do internally.

The boundary is every public operation of :mod:`gossamer.ops` (decorated with
:func:`staged`), plus the transport entry points that higher layers call directly on the
communication thread: :func:`exchange`, :func:`exchange_surviving` and
:func:`exchange_rejected` (communicators, elastic gossip, compressed gossip), and the
ops' reduction primitive. Inside that boundary every tensor is a host tensor. NCCL
(``backend="nccl"``, where CUDA tensors travel on NCCL) needs none of this: staging
happens only when the group's backend for the tensor's device is gloo.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from gossamer import context
from gossamer.transport import p2p
from gossamer.transport.handle import Handle

__all__ = [
    "exchange",
    "exchange_rejected",
    "exchange_surviving",
    "needs_staging",
    "staged",
    "to_device",
    "to_host",
]

F = TypeVar("F", bound=Callable[..., Any])


def _carried_by_gloo(group: object) -> bool:
    """True when ``group`` (None: the world) sends device tensors through gloo."""
    if group is None:
        return context.backend() == "gloo"
    if not isinstance(group, dist.ProcessGroup):
        return False  # the operation refuses it with its own error
    # A combined "cpu:gloo,cuda:nccl" group routes CUDA tensors to NCCL.
    return "nccl" not in str(dist.get_backend(group))


def needs_staging(tensor: object, group: object = None, *, over_gloo: bool = False) -> bool:
    """True when ``tensor`` lives on a device and would reach gloo over ``group``.

    ``over_gloo``: the operation's traffic goes over gloo whatever the backend (the
    machine-local groups of hierarchical operations).
    """
    if not isinstance(tensor, torch.Tensor) or tensor.device.type == "cpu":
        return False
    if tensor.is_sparse or not context.is_initialized():
        return False  # refused by the operation, with its own error
    return over_gloo or _carried_by_gloo(group)


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous host copy of ``tensor`` (pinned for CUDA, so the copy is one DMA).

    Detached: communication is not differentiable. The copy runs on the caller's current
    stream and waits for it, so it sees every kernel queued before the call.
    """
    pinned = tensor.device.type == "cuda"
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)
    host.copy_(tensor.detach())
    return host


def to_device(result: Any, device: torch.device) -> Any:
    """``result`` (a tensor, None, or a dict, list or tuple of them) moved to ``device``."""
    if isinstance(result, torch.Tensor):
        return result.to(device)
    if isinstance(result, dict):
        return {k: to_device(v, device) for k, v in result.items()}
    if isinstance(result, list | tuple):
        return type(result)(to_device(v, device) for v in result)
    return result


def _back(result: Any, tensor: torch.Tensor, host: torch.Tensor) -> Any:
    """The result for the caller: in-place results land in ``tensor``, others on its device."""
    if result is host:  # an in-place operation wrote into the host copy
        with torch.no_grad():
            tensor.copy_(host)
        return tensor
    return to_device(result, tensor.device)


def staged(fn: F | None = None, *, over_gloo: bool = False) -> Any:
    """Decorate an operation ``fn(tensor, *args, group=None, ...)`` to stage device tensors.

    When :func:`needs_staging`, ``fn`` gets a host copy of ``tensor``; its result (or its
    handle's, for ``async_op=True``) comes back on ``tensor``'s device, and a result that
    is the host copy itself (an in-place operation) is copied into ``tensor``. Either way
    ``fn`` gets ``tensor`` detached: communication is not differentiable, so no result
    carries an autograd graph (an in-place result is still ``tensor`` itself).
    """

    def wrap(op: F) -> F:
        @functools.wraps(op)
        def run(tensor: Any, *args: Any, **kwargs: Any) -> Any:
            if isinstance(tensor, torch.Tensor) and tensor.requires_grad:
                plain = tensor.detach()
                result = run(plain, *args, **kwargs)
                if isinstance(result, Handle):
                    return result.then(lambda done: tensor if done is plain else done)
                return tensor if result is plain else result
            if not needs_staging(tensor, kwargs.get("group"), over_gloo=over_gloo):
                return op(tensor, *args, **kwargs)
            host = to_host(tensor)
            result = op(host, *args, **kwargs)
            if isinstance(result, Handle):
                # Runs on the communication thread when the operation completes.
                return result.then(lambda done: _back(done, tensor, host))
            return _back(result, tensor, host)

        return run  # type: ignore[return-value]

    return wrap if fn is None else wrap(fn)


def _host_sends(sends: Mapping[int, torch.Tensor], group: object) -> dict[int, torch.Tensor]:
    """``sends`` with every tensor on the host; a tensor sent to several peers copied once."""
    copies: dict[int, torch.Tensor] = {}
    out = {}
    for peer, t in sends.items():
        if not needs_staging(t, group):
            out[peer] = t
            continue
        if id(t) not in copies:
            copies[id(t)] = to_host(t)
        out[peer] = copies[id(t)]
    return out


def _like(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor with ``tensor``'s dtype and shape: what the call header describes."""
    return torch.empty(tensor.shape, dtype=tensor.dtype)


def exchange(
    op: str,
    tensor: torch.Tensor,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> dict[int, torch.Tensor]:
    """:func:`gossamer.transport.p2p.exchange`, staged through host memory on gloo.

    The received tensors come back on ``tensor``'s device (fresh copies then; host
    buffers reused by the next exchange otherwise).
    """
    if not (needs_staging(tensor, group) or any(needs_staging(t, group) for t in sends.values())):
        return p2p.exchange(op, tensor, sends, sources, group, **options)
    got = p2p.exchange(op, _like(tensor), _host_sends(sends, group), sources, group, **options)
    return to_device(got, tensor.device)


def exchange_surviving(
    op: str,
    tensor: torch.Tensor,
    sends: Mapping[int, torch.Tensor],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    **options: Any,
) -> p2p.Survived:
    """:func:`gossamer.transport.p2p.exchange_surviving`, staged through host memory on gloo."""
    if not (needs_staging(tensor, group) or any(needs_staging(t, group) for t in sends.values())):
        return p2p.exchange_surviving(op, tensor, sends, sources, group, **options)
    host_sends = _host_sends(sends, group)
    got = p2p.exchange_surviving(op, _like(tensor), host_sends, sources, group, **options)
    got.received = to_device(got.received, tensor.device)
    return got


def exchange_rejected(
    op: str,
    reason: str,
    dsts: Sequence[int],
    sources: Sequence[int],
    group: dist.ProcessGroup | None = None,
    device: torch.device | None = None,
    origin: int | None = None,
) -> None:
    """:func:`gossamer.transport.p2p.exchange_rejected`; on gloo its buffers are host memory."""
    if device is not None and device.type != "cpu" and _carried_by_gloo(group):
        device = torch.device("cpu")
    p2p.exchange_rejected(op, reason, dsts, sources, group, device, origin)
