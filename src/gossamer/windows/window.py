r"""One-sided windows: ranks read and write each other's buffers without waiting for them.

Every rank registers a tensor :math:`x_r` and holds one buffer :math:`b_r[s]` per
in-neighbour :math:`s`. ``put`` overwrites this rank's slot at each destination,
``accumulate`` adds into it, ``get`` copies a source's current tensor into the local buffer,
and ``update`` combines :math:`x_r \leftarrow w_{rr} x_r + \sum_s w_{sr} b_r[s]`. With
push-sum on, a scalar :math:`p` travels with every put and accumulate and is combined by
``update`` the same way, so :math:`x / p` converges to the average on any strongly connected
directed graph (Kempe et al., 2003).

``put`` and ``accumulate`` take ``compression=`` (a compressor or its registry name): the
origin then sends a compressed message instead of the tensor. A compressed put sends the
*change* of what the destination holds for this rank: the origin keeps a copy
:math:`\hat x_{r \to d}` of it (zero at first, on both sides), sends
:math:`q = C(w_d x - \hat x_{r \to d})`, and both sides add :math:`D(q)` to their copy; the
destination's slot becomes its copy. What the compression drops stays in
:math:`w_d x - \hat x_{r \to d}` and is sent with the next put (error feedback on the
sender, as CHOCO-gossip's public copies). A compressed accumulate sends
:math:`C(w_d x + e_d)` with an error-feedback residual :math:`e_d` per destination, and the
destination adds :math:`D(\cdot)` into its slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Container, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from gossamer import context, transport
from gossamer.combine import is_uniform, scale, weighted_sum
from gossamer.compression import Compressor, for_rank, get_compressor
from gossamer.errors import WindowError
from gossamer.ops.defaults import get_topology
from gossamer.topology import Topology
from gossamer.transport import (
    Handle,
    check_flag,
    check_rank,
    check_same_call,
    check_weight,
    check_weights,
    reject,
)
from gossamer.windows.locks import local_locks, remote_locks
from gossamer.windows.registry import Registry, registry
from gossamer.windows.requests import issue
from gossamer.windows.service import (
    COMPRESSED,
    WINDOW_DTYPES,
    Kind,
    WindowState,
    compressed_message,
)

__all__ = ["Window", "live_windows"]


def live_windows() -> list[str]:
    """Names of the windows that exist now, sorted (empty before ``init``)."""
    if not context.is_initialized():
        return []
    found = context.runtime().find("windows")
    return [] if found is None else found.names()


def _create_rejected(reason: str) -> None:
    """This rank's part of a ``Window.create`` whose arguments it rejected."""
    check_same_call("window_create", None, None, rejection=reason)


class Window:
    """A tensor that neighbours can put into, accumulate into and get from.

    Create with :meth:`create` (collective), release with :meth:`free` (collective) or use
    as a context manager. Operations take a lock-free path by default; ``require_mutex`` or
    :meth:`mutex` serialise access to one (owner, peer) slot.

    Example:
        >>> with Window.create(x, zero_init=True) as win:  # doctest: +SKIP
        ...     win.put()             # x lands in my slot at every out-neighbour
        ...     gossamer.barrier()
        ...     win.update()          # x <- average of x and the received buffers
    """

    def __init__(self, state: WindowState, topology: Topology) -> None:
        self._state: WindowState | None = state
        self._topology = topology
        self.name = state.name
        me = context.rank()
        self.in_neighbors: tuple[int, ...] = topology.in_neighbors(me)
        self.out_neighbors: tuple[int, ...] = topology.out_neighbors(me)

    # ----------------------------------------------------------------- lifecycle
    @classmethod
    def create(
        cls,
        tensor: torch.Tensor,
        *,
        zero_init: bool = False,
        name: str | None = None,
        push_sum: bool = False,
        topology: Topology | None = None,
        elastic: bool = False,
    ) -> Window:
        """Register ``tensor`` (the object itself) as this rank's window. Collective.

        Buffers start as copies of ``tensor`` (zeros with ``zero_init``); their push-sum
        weights start at 0 and this rank's own ``p`` at 1. The window captures the topology
        (``topology`` or the default), which cannot change while windows exist.

        Any dtype of :data:`gossamer.transport.DTYPES` (payloads travel as bytes). Weighted
        puts, gets and updates of integer and bool windows are computed in float64 and rounded
        to the nearest integer; accumulates add in the window's dtype, wrapping around as its
        integer arithmetic does (bool: a logical or) -- see :mod:`gossamer.combine`.

        With ``elastic=True`` the window outlives dead ranks: puts, accumulates and gets
        without ``require_mutex`` skip the ranks the survivors agreed are dead (see
        :func:`gossamer.live_ranks`), a peer that dies before answering is dropped from the
        operation (and reported) instead of failing it, and :meth:`free` is collective over
        the live ranks only, through the rendezvous store. Which weights to use without the
        dead is the caller's choice (``dst_weights``, ``update(src_weights=...)``). Creation
        itself is collective over every rank.

        Raises:
            TypeError: not a tensor, a dtype without a wire code, or a flag that is not a bool.
            ValueError: a name already in use. PeerError: ranks passed different shapes,
                dtypes, ``push_sum`` or ``elastic``.
            PeerArgumentError: on the other ranks, when a rank rejected its arguments.
        """
        windows = registry()
        try:
            if not isinstance(tensor, torch.Tensor) or tensor.dtype not in WINDOW_DTYPES:
                raise TypeError(
                    "Window.create: tensor must be a torch.Tensor of a dtype in "
                    "gossamer.transport.DTYPES; got "
                    f"{getattr(tensor, 'dtype', type(tensor).__name__)}"
                )
            if tensor.is_sparse:
                raise TypeError("Window.create: tensor must be dense; got a sparse tensor")
            check_flag(zero_init, "zero_init", "Window.create")
            check_flag(push_sum, "push_sum", "Window.create")
            check_flag(elastic, "elastic", "Window.create")
            if name is not None and not isinstance(name, str):
                raise TypeError(f"Window.create: name must be a str; got {name!r}")
            if name in windows.windows:
                raise ValueError(f"Window.create: a window named {name!r} already exists")
            graph = (
                get_topology()
                if topology is None
                else transport.check_topology(topology, None, "topology")
            )
        except (TypeError, ValueError) as err:
            # Creation is collective: the others learn why instead of waiting for this rank.
            reject("window_create", err, None, _create_rejected)
            raise

        def body() -> Window:
            check_same_call("window_create", tensor, None, aux=push_sum + 2 * elastic)
            wid = windows.next_id()
            service = windows.start_service()
            me = context.rank()
            init = torch.zeros_like if zero_init else torch.clone
            host = tensor.detach().to("cpu")
            state = WindowState(
                wid=wid,
                name=name or _default_name(wid, windows.windows),
                tensor=tensor,
                buffers={s: init(host) for s in graph.in_neighbors(me)},
                versions=dict.fromkeys(graph.in_neighbors(me), 0),
                p_buffers=dict.fromkeys(graph.in_neighbors(me), 0.0),
                push_sum=push_sum,
                elastic=elastic,
            )
            if service is not None:
                service.windows[wid] = state
            # Every rank registered it: nobody's request can arrive before its target knows.
            transport.wait_works("Window.create", [(-1, dist.barrier(async_op=True))])
            return cls(state, graph)

        window = transport.run("Window.create", body, False)
        windows.windows[window.name] = window
        return window

    def free(self) -> None:
        """Release the window on every rank (collective); waits for this rank's operations.

        An elastic window is freed by the live ranks: a barrier among them through the
        rendezvous store, so that no request of theirs is still on its way.
        """
        state = self._require()
        windows = registry()
        windows.client().submit(lambda: None).result()  # drain queued operations

        def body() -> None:
            # A rank that called something else (or freed another window) raises at once,
            # naming the calls, instead of meeting another collective's barrier.
            transport.check_same_call("window_free", torch.empty(0), None, aux=state.wid)
            transport.wait_works("Window.free", [(-1, dist.barrier(async_op=True))])
            forget()

        def forget(ring: list[int] | None = None) -> None:
            if windows.service is not None:
                windows.service.windows.pop(state.wid, None)
                windows.stop_service_if_idle(ring)

        if state.elastic and context.size() > 1:
            self._forget_name(windows)
            forget(list(transport.gather_live(f"window.free/{state.wid}", 0)))
        else:
            # A mismatched call raises here, before the window is forgotten: it can still
            # be freed (at shutdown, collectively, with the others').
            transport.run("Window.free", body, False)
            self._forget_name(windows)

    def _forget_name(self, windows: Registry) -> None:
        self._state = None
        windows.windows.pop(self.name, None)

    def __enter__(self) -> Window:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if self._state is None:
            return
        if exc_type is None:
            self.free()
            return
        # An error is on its way out: free() would wait at a barrier for the ranks that did
        # not fail (until the timeout, hiding the error); release this rank's side only.
        state, self._state = self._state, None
        windows = registry()
        windows.windows.pop(self.name, None)
        if windows.service is not None:
            windows.service.windows.pop(state.wid, None)

    def _require(self) -> WindowState:
        if self._state is None:
            raise WindowError(f"window {self.name!r} has been freed")
        return self._state

    def __repr__(self) -> str:
        state = "freed" if self._state is None else f"shape {tuple(self._state.tensor.shape)}"
        return f"Window({self.name!r}, {state})"

    # ------------------------------------------------------------------ reading state
    @property
    def topology(self) -> Topology:
        """The graph the window captured at :meth:`create`."""
        return self._topology

    @property
    def tensor(self) -> torch.Tensor:
        """The registered tensor (the object passed to :meth:`create`)."""
        return self._require().tensor

    @property
    def p(self) -> float:
        """This rank's push-sum weight (1.0 until puts, accumulates or updates change it)."""
        return self._require().p

    @p.setter
    def p(self, value: float) -> None:
        self._require().p = check_weight(value, "Window.p")

    @property
    def push_sum(self) -> bool:
        """Whether puts, accumulates and updates carry the push-sum weight ``p``."""
        return self._require().push_sum

    @push_sum.setter
    def push_sum(self, on: bool) -> None:
        if not isinstance(on, bool):
            raise TypeError(f"push_sum must be a bool; got {on!r}")
        self._require().push_sum = on

    def versions(self) -> dict[int, int]:
        """``{in-neighbour: puts and gets that arrived from it since the last update}``."""
        state = self._require()
        with state.lock:
            return dict(state.versions)

    def buffers(self) -> dict[int, torch.Tensor]:
        """A copy of every in-neighbour's buffer."""
        state = self._require()
        with state.lock:
            return {s: b.clone() for s, b in state.buffers.items()}

    def p_buffers(self) -> dict[int, float]:
        """The push-sum weight held in every in-neighbour's slot."""
        state = self._require()
        with state.lock:
            return dict(state.p_buffers)

    def sent_copies(self) -> dict[int, torch.Tensor]:
        """What each destination holds for this rank after compressed puts (host copies).

        Empty before the first compressed put; see :meth:`put`.
        """
        state = self._require()
        return {d: t.clone() for d, t in state.sent.items()}

    def compression_state(self) -> dict[str, dict]:
        """The copies compressed puts keep, for a checkpoint.

        ``sent`` (this rank's copy per destination), ``replicas`` (each source's copy here),
        ``residuals`` (accumulate's error feedback per destination) and ``steps`` (the
        stochastic compressors' stream positions).
        """
        state = self._require()
        with state.lock:
            return {
                "sent": {d: t.clone() for d, t in state.sent.items()},
                "replicas": {s: t.clone() for s, t in state.replicas.items()},
                "residuals": {d: t.clone() for d, t in state.residuals.items()},
                "steps": {n: c.state_dict() for n, c in state.compressors.items()},
            }

    def load_compression_state(self, saved: Mapping[str, Mapping]) -> None:
        """Restore :meth:`compression_state`'s output (on every rank, before communicating).

        Raises:
            TypeError: ``saved`` is not a mapping.
            ValueError: it has keys :meth:`compression_state` does not write.
        """
        if not isinstance(saved, Mapping):
            raise TypeError(f"saved must be a compression_state() mapping; got {saved!r}")
        unknown = sorted(map(str, set(saved) - {"sent", "replicas", "residuals", "steps"}))
        if unknown:
            raise ValueError(f"saved has keys compression_state() does not write: {unknown}")
        state = self._require()
        with state.lock:
            state.sent = {int(d): t.clone() for d, t in saved.get("sent", {}).items()}
            state.replicas = {int(s): t.clone() for s, t in saved.get("replicas", {}).items()}
            state.residuals = {int(d): t.clone() for d, t in saved.get("residuals", {}).items()}
            for name, steps in saved.get("steps", {}).items():
                self._compressor(name, "load_compression_state", state.tensor.dtype)
                state.compressors[name].load_state_dict(steps)

    def load_slots(
        self, buffers: Mapping[int, torch.Tensor], p_buffers: Mapping[int, float] | None = None
    ) -> None:
        """Overwrite the in-neighbours' slots (to restore a checkpoint); versions are cleared.

        Raises:
            TypeError: a value that is not a tensor of the window's dtype, or a weight that is
                not a real number.
            ValueError: a key that is not an in-neighbour, or a tensor of another shape.
            Nothing is changed when an error is raised.
        """
        state = self._require()
        p_buffers = dict(p_buffers or {})
        for name, given in (("buffers", buffers), ("p_buffers", p_buffers)):
            extra = sorted(set(given) - set(state.buffers))
            if extra:
                raise ValueError(
                    f"{name} keys must be in-neighbours {self.in_neighbors}; got {extra}"
                )
        for src, value in buffers.items():
            slot = state.buffers[src]
            if not isinstance(value, torch.Tensor) or value.dtype != slot.dtype:
                got = value.dtype if isinstance(value, torch.Tensor) else type(value).__name__
                raise TypeError(f"buffers[{src}] must be a {slot.dtype} tensor; got {got}")
            if value.shape != slot.shape:
                raise ValueError(
                    f"buffers[{src}] has shape {tuple(value.shape)}; the window's is "
                    f"{tuple(slot.shape)}"
                )
        weights = {src: check_weight(p, f"p_buffers[{src}]") for src, p in p_buffers.items()}
        with state.lock:
            for src, value in buffers.items():
                state.buffers[src].copy_(value)
                state.versions[src] = 0
            state.p_buffers.update(weights)

    # ------------------------------------------------------------------ operations
    def _targets(self, weights, what: str) -> dict[int, float]:
        me, n = context.rank(), context.size()
        if weights is None:
            return dict.fromkeys(self.out_neighbors, 1.0)
        if not isinstance(weights, Mapping):
            raise TypeError(
                f"{what}: dst_weights must be a mapping {{rank: weight}}; "
                f"got {type(weights).__name__}"
            )
        return check_weights(weights, "dst_weights", n, me, self.out_neighbors, "out-neighbours")

    def _compressor(self, compression, what: str, dtype: torch.dtype) -> Compressor | None:
        """This rank's compressor for ``compression`` (None: send the tensor as it is)."""
        if compression is None:
            return None
        compressor = get_compressor(compression, argument="compression")
        if compressor.name == "none":
            return None
        if not dtype.is_floating_point:
            raise TypeError(
                f"{what}: compression={compressor.name!r} needs a floating window; got {dtype}"
            )
        state = self._require()
        mine = state.compressors.get(compressor.name)
        if mine is None:  # kept, so that a stochastic compressor's stream advances per call
            mine = for_rank(compressor, context.rank())
            if mine is compressor:
                # This window's own: one shared by every window (an optimizer's buckets)
                # would advance once per window, which a resumed job, whose windows each
                # restore their own, would not; and the caller's object stays as given.
                mine = dataclasses.replace(compressor)
                mine.load_state_dict(compressor.state_dict())
            state.compressors[compressor.name] = mine
        return mine

    def _compressed(self, state: WindowState, kind: Kind, target: torch.Tensor, dst: int, c):
        """The message of a compressed put or accumulate of ``target`` to ``dst``."""
        if kind == Kind.PUT:
            sent = state.sent.get(dst)
            if sent is None:
                sent = state.sent[dst] = torch.zeros_like(target)
            payload = c.compress_add_(target - sent, sent)  # sent: what dst's copy becomes
        else:
            residual = state.residuals.get(dst)
            corrected = target if residual is None else target + residual
            payload = c.compress(corrected)
            state.residuals[dst] = corrected - c.decompress(payload)
        return compressed_message(c, payload)

    def _write(
        self, kind: Kind, tensor, self_weight, dst_weights, require_mutex, async_op, compression
    ):
        what = f"Window.{kind.name.lower()} on {self.name!r}"
        state = self._require()
        check_flag(require_mutex, "require_mutex", what)
        check_flag(async_op, "async_op", what)
        x = state.tensor if tensor is None else tensor
        if (
            not isinstance(x, torch.Tensor)
            or x.shape != state.tensor.shape
            or (x.dtype != state.tensor.dtype)
        ):
            raise ValueError(
                f"{what}: tensor must match the window's "
                f"{state.tensor.dtype}{list(state.tensor.shape)}; got {x!r:.80}"
            )
        dsts = self._targets(dst_weights, what)
        sw = None if self_weight is None else check_weight(self_weight, "self_weight")
        check_flag(require_mutex, "require_mutex", what)
        check_flag(async_op, "async_op", what)
        compressor = self._compressor(compression, what, x.dtype)
        me, n = context.rank(), context.size()
        host = x.detach().to("cpu").contiguous()
        p = state.p
        requests = []
        for dst, w in sorted(dsts.items(), key=lambda d: (d[0] - me) % n):  # clockwise
            target = host if w == 1.0 else scale(host, w)
            value = w * p if state.push_sum else 0.0
            if compressor is None:
                requests.append((dst, kind, target, value))
            else:
                message = self._compressed(state, kind, target, dst, compressor)
                requests.append((dst, kind, message, value, COMPRESSED))

        def finish() -> None:
            if sw is not None and sw != 1.0:
                with torch.no_grad():
                    x.copy_(scale(x, sw))
                if state.push_sum:
                    state.p *= sw

        return issue(self._require(), what, requests, require_mutex, finish, async_op)

    def put(
        self,
        tensor: torch.Tensor | None = None,
        *,
        self_weight: float | None = None,
        dst_weights: Mapping[int, float] | None = None,
        require_mutex: bool = False,
        async_op: bool = False,
        compression: str | Compressor | None = None,
    ) -> Handle | None:
        r"""Overwrite this rank's slot at each destination: :math:`b_d[r] \leftarrow w_d x`.

        Then scale ``tensor`` in place by ``self_weight`` (if given). With push-sum,
        :math:`p_d[r] \leftarrow w_d p` and :math:`p \leftarrow` ``self_weight`` :math:`p`.
        Each arrival bumps the target's version for this rank. A completed put is visible
        at the target.

        Args:
            tensor (torch.Tensor, optional): what to send; default: the registered tensor.
            self_weight (float, optional): in-place scale of ``tensor`` afterwards.
            dst_weights (Mapping[int, float], optional): weight per destination; keys must be
                out-neighbours; default: every out-neighbour with weight 1.
            require_mutex (bool): hold the (destination, this rank) mutex while writing.
            async_op (bool): return a :class:`Handle` instead of waiting.
            compression (str | Compressor, optional): send a compressed delta of
                :math:`w_d x` against the copy the destination holds (see the module);
                the slot then holds that copy. Floating windows only.

        Raises:
            TypeError: ``compression`` on an integer window.
            ValueError: an unknown ``compression``, a tensor unlike the window's, or
                destinations that are not out-neighbours.
        """
        return self._write(
            Kind.PUT, tensor, self_weight, dst_weights, require_mutex, async_op, compression
        )

    def accumulate(
        self,
        tensor: torch.Tensor | None = None,
        *,
        self_weight: float | None = None,
        dst_weights: Mapping[int, float] | None = None,
        require_mutex: bool = False,
        async_op: bool = False,
        compression: str | Compressor | None = None,
    ) -> Handle | None:
        r"""Add into this rank's slot at each destination: :math:`b_d[r] \mathrel{+}= w_d x`.

        Like :meth:`put` otherwise, but versions are not bumped (as in BlueFog). With
        ``compression`` the destination adds :math:`D(C(w_d x + e_d))` and this rank keeps
        the residual :math:`e_d` for the next accumulate to ``d`` (error feedback).
        """
        return self._write(
            Kind.ACCUMULATE, tensor, self_weight, dst_weights, require_mutex, async_op, compression
        )

    def get(
        self,
        *,
        src_weights: Mapping[int, float] | None = None,
        require_mutex: bool = False,
        async_op: bool = False,
    ) -> Handle | None:
        r"""Fetch each source's current tensor: :math:`b_r[s] \leftarrow w_s x_s`.

        Keys of ``src_weights`` must be in-neighbours (default: all, weight 1). The push-sum
        weight is not transferred. Each arrival bumps the version of ``s``.
        """
        what = f"Window.get on {self.name!r}"
        state = self._require()
        check_flag(require_mutex, "require_mutex", what)
        check_flag(async_op, "async_op", what)
        me, n = context.rank(), context.size()
        srcs = (
            dict.fromkeys(self.in_neighbors, 1.0)
            if src_weights is None
            else check_weights(
                src_weights, "src_weights", n, me, self.in_neighbors, "in-neighbours"
            )
        )

        def finish() -> None:
            with state.lock:
                for src, w in srcs.items():
                    if w != 1.0:
                        state.buffers[src].copy_(scale(state.buffers[src], w))

        requests = [(src, Kind.GET, None, 0.0) for src in sorted(srcs)]
        return issue(self._require(), what, requests, require_mutex, finish, async_op)

    def update(
        self,
        *,
        self_weight: float | None = None,
        src_weights: Mapping[int, float] | None = None,
        reset: bool = False,
        clone: bool = False,
        require_mutex: bool = False,
    ) -> torch.Tensor:
        r"""Combine: :math:`x \leftarrow w_{rr} x + \sum_s w_{sr} b[s]`; return the result.

        With no weights, the topology's; when those are uniform the result is
        :math:`(x + \sum_{s} b[s]) / (k + 1)` over all in-neighbours (sum, then divide).
        With push-sum, :math:`p` is combined the same way. ``reset`` zeroes the buffers
        (and their ``p``) that were used; the versions are cleared. ``clone`` leaves the
        registered tensor untouched and returns a new one; otherwise it is updated in place
        and returned.

        Raises:
            ValueError: only one of ``self_weight``/``src_weights``; keys that are not
                in-neighbours.
        """
        state = self._require()
        me, n = context.rank(), context.size()
        for flag, value in (("reset", reset), ("clone", clone), ("require_mutex", require_mutex)):
            check_flag(value, flag, "Window.update")
        if (self_weight is None) != (src_weights is None):
            raise ValueError("Window.update: self_weight and src_weights must be given together")
        if src_weights is None:
            sw, weights = self._topology.recv_weights(me)
        else:
            sw = check_weight(self_weight, "self_weight")
            weights = check_weights(
                src_weights, "src_weights", n, me, self.in_neighbors, "in-neighbours"
            )
        # Uniform only if the self weight is too: with no in-neighbours it must be 1.
        uniform = src_weights is None and is_uniform(sw, weights, list(weights))
        slots = sorted(weights) if require_mutex else []
        with local_locks(registry().service, state, slots), state.lock:
            x = state.tensor
            bufs = {s: state.buffers[s].to(x.device) for s in weights}
            out = weighted_sum(x.detach(), sw, bufs, None if uniform else weights)
            if uniform:
                new_p = (state.p + sum(state.p_buffers[s] for s in weights)) / (len(weights) + 1)
            else:
                new_p = sw * state.p + sum(weights[s] * state.p_buffers[s] for s in weights)
            if state.push_sum:
                state.p = new_p
            if reset:
                for s in weights:
                    state.buffers[s].zero_()
                    state.p_buffers[s] = 0.0
            for s in state.versions:
                state.versions[s] = 0
            if clone:
                return out
            with torch.no_grad():
                x.copy_(out)
            return x

    def update_then_collect(self, *, require_mutex: bool = True) -> torch.Tensor:
        r""":math:`x \leftarrow x + \sum_s b[s]`, then zero the buffers (a second call adds 0)."""
        check_flag(require_mutex, "require_mutex", "Window.update_then_collect")
        return self.update(
            self_weight=1.0,
            src_weights=dict.fromkeys(self.in_neighbors, 1.0),
            reset=True,
            require_mutex=require_mutex,
        )

    # ------------------------------------------------------------------ mutexes
    def mutex(self, ranks: Sequence[int] | None = None, *, for_self: bool = False):
        """Hold the distributed mutexes of ``ranks`` (default: the out-neighbours).

        By default this takes, at each rank ``r`` in ``ranks``, the mutex of this rank's slot
        there (what a put with ``require_mutex`` takes). With ``for_self`` it takes this
        rank's own mutexes of the slots of ``ranks`` (what ``update(require_mutex=True)``
        takes). Waiters are served first come, first served.
        """
        me, n = context.rank(), context.size()
        check_flag(for_self, "for_self", "Window.mutex")
        if ranks is not None and (isinstance(ranks, str) or not isinstance(ranks, Iterable)):
            raise TypeError(f"Window.mutex: ranks must be a list of ranks; got {ranks!r}")
        chosen = (
            list(self.out_neighbors)
            if ranks is None
            else [check_rank(r, "ranks entry", n) for r in ranks]
        )
        if me in chosen:
            raise ValueError(f"Window.mutex: ranks must not contain this rank ({me})")
        if len(set(chosen)) < len(chosen):  # a second take of one mutex waits for itself
            raise ValueError(f"Window.mutex: ranks must not repeat a rank; got {ranks!r}")
        state, svc = self._require(), registry().service
        return local_locks(svc, state, chosen) if for_self else remote_locks(svc, state, chosen)


@transport.explains_aux("window_free")
def _explain_free(aux: int) -> str:
    return f"window id {aux}"


@transport.explains_aux("window_create")
def _explain_create(aux: int) -> str:
    return f"push_sum={bool(aux & 1)}, elastic={bool(aux & 2)}"


def _default_name(wid: int, taken: Container[str]) -> str:
    """``window<id>``, unless a window was given that name: the same on every rank."""
    name, k = f"window{wid}", 0
    while name in taken:
        k += 1
        name = f"window{wid}.{k}"
    return name
