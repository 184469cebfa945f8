r"""Asynchronous patterns over one-sided windows: no rank waits for another's compute.

- :class:`WindowPutGossip` (BlueFog's win-put): a round puts each bucket into the
  out-neighbours' windows; waiting on it combines whatever has arrived,
  :math:`x \leftarrow w_{ii} x + \sum_j w_{ji} b_j`.
- :class:`PushSumGossip` (push-sum, Kempe et al., 2003; stochastic gradient push, Assran
  et al., 2019): each rank keeps :math:`x_i = p_i z_i` and a weight :math:`p_i`, pushes a
  share :math:`1/(d_i+1)` of :math:`(x_i, p_i)` to each of its :math:`d_i` out-neighbours
  and adds what it received. Mass is conserved, so on any strongly connected directed graph
  the :math:`z_i = x_i / p_i` reach consensus.

With ``elastic=True`` both outlive dead ranks (the windows are elastic,
:meth:`~gossamer.windows.Window.create`): a round skips the ranks the survivors agreed are
dead. Push-sum then pushes shares :math:`1/(d_i' + 1)` over its :math:`d_i'` live
out-neighbours, which keeps every column stochastic among the survivors (the dead rank's
mass, and what was pushed to it, is lost; :math:`z` stays a weighted average of the
survivors' values). Win-put, plain or compressed, on a static topology or a schedule,
combines with the weights of :meth:`Topology.without(dead)
<gossamer.topology.Topology.without>`; the compressed combine's own copy
:math:`\hat x_i` then weighs the live destinations' copies only, by that topology's
weights.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import numpy as np
import torch

from gossamer import context, transport
from gossamer.communicators.base import Deferred, Pending, check_topology
from gossamer.communicators.choco import contraction_quality, default_gamma
from gossamer.communicators.compressed import configuration_id
from gossamer.communicators.neighbor import Scheduled
from gossamer.compression import Compressor, get_compressor
from gossamer.errors import TopologyError
from gossamer.fusion import Bucket
from gossamer.topology import Step, Topology, connected_components
from gossamer.transport import Handle, known_dead
from gossamer.windows import Window

__all__ = ["PushSumGossip", "WindowPutGossip"]

_prefixes = itertools.count()


class _WindowGossip(Scheduled):
    """Windows over the flat buckets, created (collectively) at :meth:`bind`."""

    push_sum = False

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        schedule: Iterator[Step] | None = None,
        prefix: str | None = None,
        elastic: bool = False,
    ) -> None:
        super().__init__(schedule=schedule)
        check_topology(topology)
        if not isinstance(elastic, bool):
            raise TypeError(f"elastic must be a bool; got {elastic!r}")
        self.topology = topology
        self.prefix = prefix
        self.elastic = elastic
        self.windows: list[Window] = []
        self.dst_weights: dict[int, float] | None = None
        self.dead: frozenset[int] = frozenset()  # as of this round's start (elastic)

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """Create one window per bucket (collective)."""
        prefix = self.prefix or f"{type(self).__name__}.{next(_prefixes)}"
        for bucket in buckets:
            bucket.pack()
        # Push-sum keeps x apart from the packing buffer; win-put shares it.
        self.windows = [
            Window.create(
                b.flat.clone() if self.push_sum else b.flat,
                zero_init=self._zero_slots(),
                push_sum=self.push_sum,
                name=f"{prefix}.{i}",
                topology=self.topology,
                elastic=self.elastic,
            )
            for i, b in enumerate(buckets)
        ]

    def _zero_slots(self) -> bool:
        """Whether the window slots start at zero (else as copies of this rank's tensor)."""
        return self.push_sum

    def destinations(self, window: Window, share: float = 1.0) -> dict[int, float]:
        """This round's ``{destination: weight}`` (explicit, scheduled, or every out-neighbour).

        Dead destinations are left out (elastic).
        """
        if self.dst_weights is not None:
            weights = self.dst_weights
        elif self.step is None:
            weights = dict.fromkeys(window.out_neighbors, 1.0)
        else:
            weights = self.step.dst_weights
        return {d: w * share for d, w in weights.items() if d not in self.dead}

    def start(
        self, flat: torch.Tensor, index: int = 0, *, in_place: bool = False
    ) -> Pending | None:
        """This round on bucket ``index`` (window rounds have no global-average variant).

        ``in_place`` is ignored: the combine reads the window, which owns its buffers.
        """
        if context.size() == 1:
            return None
        if self.elastic:
            self.dead = known_dead()
        return self._start(flat, index)

    def state_dict(self) -> dict:
        """Counters, and per window what its slots hold: the next combine reads them.

        With a schedule or ``dst_weights`` a round may leave some slots untouched, so a
        combine can read a neighbour's copy from rounds ago. ``versions`` (arrivals since
        the last combine) are saved for inspection; loading clears them, as a combine does.
        Save on every rank before any rank communicates again (a barrier after saving): a
        neighbour's next put that lands first would be saved as this round's.
        """
        return {
            **super().state_dict(),
            "buffers": [w.buffers() for w in self.windows],
            "p_buffers": [w.p_buffers() for w in self.windows],
            "versions": [w.versions() for w in self.windows],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore the counters and, where saved, the slots.

        Load on every rank before any rank communicates again: a neighbour's new put that
        lands first would be overwritten.

        Raises:
            ValueError: the state holds another number of windows (another model or
                fusion threshold).
        """
        super().load_state_dict(state)
        buffers = self._per_window(state, "buffers")
        p_buffers = self._per_window(state, "p_buffers")
        for window, slots, weights in zip(self.windows, buffers, p_buffers, strict=True):
            if slots is not None:
                window.load_slots(slots, weights)

    def _per_window(self, state: dict, key: str) -> list:
        """``state[key]``, one entry per window (None for each when absent)."""
        values = state.get(key)
        if values is None:
            return [None] * len(self.windows)
        if len(values) != len(self.windows):
            raise ValueError(
                f"state[{key!r}] holds {len(values)} windows; this {type(self).__name__} has "
                f"{len(self.windows)} (a different model or fusion_threshold_bytes?)"
            )
        return list(values)

    def close(self) -> None:
        """Free the windows (collective)."""
        windows, self.windows = self.windows, []
        for window in windows:
            window.free()

    def rebind(self, buckets: Sequence[Bucket]) -> None:
        """New windows, their slots made from the buckets' values now (collective)."""
        self.close()
        self.bind(buckets)


class WindowPutGossip(_WindowGossip):
    r"""Put each bucket to the out-neighbours; waiting combines what arrived (win-put).

    The window of bucket ``i`` *is* the bucket's flat buffer, so a round puts the values
    just packed. :meth:`start` returns at once; ``wait()`` waits for this rank's puts and
    returns the combine of the window with the neighbours' latest copies.

    With ``compression`` each put sends a compressed delta of :math:`x_i` against the copy
    :math:`h_{i \to d}` that destination :math:`d` holds (:meth:`~gossamer.windows.Window.put`),
    and the slot :math:`b_j` of source :math:`j` holds :math:`h_{j \to i}`. When every put
    of the round has weight 1 (a static topology, or a schedule such as
    :func:`~gossamer.topology.one_peer_exponential`), the combine is CHOCO-gossip's
    (Koloskova et al., 2019) with consensus step :math:`\gamma`, over per-destination copies:

    .. math:: x_i \leftarrow x_i + \gamma \Big(\big(w_{ii} x_i + \sum_j w_{ji} b_j\big) - x_i
        + (1 - w_{ii})(x_i - \hat x_i)\Big), \qquad
        \hat x_i = \frac{\sum_d w_{id} h_{i \to d}}{\sum_d w_{id}},

    with :math:`w_{id}` the weight destination :math:`d` applies to this rank (its
    ``recv_weights``) and :math:`d` over every out-neighbour of the window's topology, not
    only this round's (the slots persist). For a doubly stochastic :math:`W`,
    :math:`\sum_d w_{id} = 1 - w_{ii}` and the update is :math:`\gamma \big(\sum_j w_{ji}
    h_{j \to i} - \sum_d w_{id} h_{i \to d}\big)`: summed over the ranks, every edge's copy
    is added once and taken once, so the ranks' average is kept every round, whichever
    destinations the round put to, provided that every put of the round has landed before
    any rank combines. The plain combine :math:`w_{ii} x_i + \sum_j w_{ji} b_j` on copies
    that trail the values does not keep it. On a regular graph :math:`\hat x_i` is the
    mean of this rank's copies.

    With a schedule the slots start at zero, as the copies do before the first put: a slot
    that no round has reached yet would otherwise hold this rank's own start, which its
    source's copy does not. Explicit ``dst_weights`` of 1 to some out-neighbours combine
    the same way, but their slots start as this rank's tensor, so the average is kept from
    the round by which every edge has carried a put. Other ``dst_weights`` make the copies
    track :math:`w_d x_i`, which no combine averages: the plain combine is used then.

    Args:
        topology (Topology, optional): the windows' graph (default: the default topology).
        schedule (Iterator[Step], optional): per round, the destinations and their weights.
        prefix (str, optional): the windows' name prefix.
        compression (str | Compressor, optional): compress the puts (``"uint8"``, ...).
        gamma (float, optional): the consensus step in (0, 1] of the compressed combine;
            default :func:`~gossamer.communicators.default_gamma` of the compressor (1 for
            casts, 0.8 for ``uint8``, 1.5 x the kept fraction for sparsifiers).
    """

    name = "window_put"

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        schedule: Iterator[Step] | None = None,
        prefix: str | None = None,
        compression: str | Compressor | None = None,
        gamma: float | None = None,
        elastic: bool = False,
    ) -> None:
        super().__init__(topology, schedule=schedule, prefix=prefix, elastic=elastic)
        compressor = get_compressor(compression)
        self.compression: Compressor | None = None if compressor.name == "none" else compressor
        self._mixing: tuple[frozenset[int], _Mixing] | None = None  # per set of dead ranks
        if gamma is None:
            gamma = default_gamma(compressor)
        if isinstance(gamma, bool) or not isinstance(gamma, int | float) or not 0 < gamma <= 1:
            raise ValueError(f"gamma must be a number in (0, 1]; got {gamma!r}")
        self.gamma = float(gamma)

    def bind(self, buckets: Sequence[Bucket]) -> None:
        """As the base's; first, a compressor that is no contraction is refused.

        Raises:
            PeerError: ranks chose different compressors or consensus steps. Each put
                names its compressor, so they would mix, and the average drift, silently.
        """
        codec = 0
        if self.compression is not None:
            for index, bucket in enumerate(buckets):
                contraction_quality(self.compression, bucket.flat.numel(), f"bucket {index}")
            codec = configuration_id(f"compression={self.compression.name!r}, gamma={self.gamma}")
        probe = torch.empty(len(buckets))
        transport.run(
            "window_create",
            lambda: transport.check_same_call("window_create", probe, None, codec=codec),
            False,
        )
        super().bind(buckets)

    def compression_config(self) -> str:
        """The compressor of the puts (as given)."""
        if self.compression is None:
            return super().compression_config()
        return f"compression={self.compression.name!r}"

    def state_dict(self) -> dict:
        """As the base's, plus per window the copies of compressed puts (if compressed)."""
        state = super().state_dict()
        if self.compression is not None:
            state["compression"] = [w.compression_state() for w in self.windows]
        return state

    def load_state_dict(self, state: dict) -> None:
        """As the base's, plus the copies of compressed puts where saved."""
        super().load_state_dict(state)
        for window, saved in zip(self.windows, self._per_window(state, "compression"), strict=True):
            if saved is not None:
                window.load_compression_state(saved)

    def _zero_slots(self) -> bool:
        # A scheduled round leaves slots as they are: each must hold its copy from the start.
        return self.compression is not None and self.schedule is not None

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        window = self.windows[index]
        destinations = self.destinations(window)
        put = window.put(dst_weights=destinations, async_op=True, compression=self.compression)
        # Weighted puts make the copies track w_d x: there is no average to keep.
        unit = all(w == 1.0 for w in destinations.values())
        gamma = self.gamma if self.compression is not None and unit else None
        return _PutRound(put, window, gamma, self._weights(window))

    def _weights(self, window: Window) -> _Mixing:
        """The combine's weights among the live ranks, computed once per set of dead ranks."""
        if self._mixing is None or self._mixing[0] != self.dead:
            self._mixing = (self.dead, _Mixing.among_live(window.topology, self.dead))
        return self._mixing[1]


class _Mixing(NamedTuple):
    """This rank's weights in the combine, among the live ranks."""

    self_weight: float
    src_weights: dict[int, float] | None  # None: the window topology's (no rank is dead)
    copy_weights: dict[int, float]  # live out-neighbour d: w_id / sum of the w_id'

    @classmethod
    def among_live(cls, graph: Topology, dead: frozenset[int]) -> _Mixing:
        """The weights of ``graph``, or of ``graph.without(dead)`` when a rank is dead."""
        me = context.rank()
        live = graph.without(dead) if dead else graph
        self_weight, src_weights = live.recv_weights(me)
        _, sent = live.send_weights(me)
        total = sum(sent.values())
        copies = {d: w / total for d, w in sent.items()}
        return cls(self_weight, src_weights if dead else None, copies)

    def update(self, window: Window) -> torch.Tensor:
        r"""The plain combine :math:`w_{ii} x + \sum_j w_{ji} b_j`, in place."""
        self_weight = None if self.src_weights is None else self.self_weight
        return window.update(
            self_weight=self_weight, src_weights=self.src_weights, require_mutex=True
        )

    def own_copy(self, window: Window, like: torch.Tensor) -> torch.Tensor:
        r""":math:`\hat x_i = \sum_d a_d h_{i \to d}` with :math:`a_d` the copy weights.

        A copy not yet put counts as zero, as its slot at ``d`` does. With equal shares this
        is the sum of the copies divided by their number, as the mean of the copies always
        was (the same bits on regular graphs).
        """
        shares = self.copy_weights
        held = [(d, c) for d, c in window.sent_copies().items() if d in shares]
        if not held:
            return torch.zeros_like(like)
        if len(set(shares.values())) == 1:
            own = sum(c for _, c in held) / len(shares)
        else:
            own = sum(shares[d] * c for d, c in held)
        return own.to(like.device)


class _PutRound(Deferred):
    """A put in flight: :meth:`sent` waits for it alone, ``wait()`` also combines."""

    def __init__(self, put: Handle, window: Window, gamma: float | None, mixing: _Mixing) -> None:
        self.put = put
        self.gamma = gamma  # None: the plain combine
        self.mixing = mixing
        super().__init__(lambda: self._combine(window))

    def sent(self) -> None:
        """Wait until this rank's put has landed at every destination."""
        self.put.wait()

    def _combine(self, window: Window) -> torch.Tensor:
        self.put.wait()
        if self.gamma is None:
            return self.mixing.update(window)
        x = window.tensor.detach().clone()
        out = self.mixing.update(window)
        with torch.no_grad():
            if self.mixing.copy_weights:  # x + (1 - w_ii)(x - own copy)
                own = self.mixing.own_copy(window, x)
                out.add_(x - own, alpha=1.0 - self.mixing.self_weight)
            if self.gamma != 1.0:  # x + gamma (combined - x)
                out.sub_(x).mul_(self.gamma).add_(x)
        return out


class PushSumGossip(_WindowGossip):
    r"""Push shares of :math:`(x_i, p_i)` and collect what arrived; ``flat`` holds :math:`z_i`.

    Moving :math:`x_i` by :math:`p_i \Delta_i` (rather than SGP's :math:`\Delta_i`, whose
    effective step :math:`\eta / p_i` diverges when a fast rank's :math:`p_i` shrinks) keeps
    every rank's step size as given. When ranks run at different speeds their :math:`p_i`
    drift apart and the consensus leans toward the ranks with larger :math:`p_i`.

    A rank whose :math:`p_i` is below :attr:`min_weight` keeps its whole mass in that round
    (it pushes nothing, a column of the identity, which is still column stochastic), until
    arrivals refill it. Without that floor a rank several times faster than its
    in-neighbours gives away :math:`k/(k+1)` of its mass per round and gets little back:
    :math:`p_i` fell to 1e-29 within a few hundred steps (``benchmarks/async_speed.py``,
    one rank 6x faster than its in-neighbours), and :math:`x_i = z_i p_i` in float32 then
    underflows and the model is lost.
    """

    name = "push_sum"
    push_sum = True
    #: below this push-sum weight a rank keeps its mass for the round (it starts at 1)
    min_weight = 1e-6
    _connected_without: frozenset[int] = frozenset()  # the dead set last found harmless

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        """Push the shares (returns at once); ``wait()`` collects and returns :math:`z`."""
        window = self.windows[index]
        if self.dead and self.dead != self._connected_without:
            _check_strongly_connected(window.topology, self.dead)
            self._connected_without = self.dead
        x = window.tensor
        torch.mul(flat, window.p, out=x)
        pushed = None
        if window.p >= self.min_weight:
            share = 1.0 / (len(self.destinations(window)) + 1)
            pushed = window.accumulate(
                self_weight=share, dst_weights=self.destinations(window, share), async_op=True
            )

        def collect() -> torch.Tensor:
            # x and p are scaled by the own share once every push has landed.
            if pushed is not None:
                pushed.wait()
            window.update_then_collect(require_mutex=True)
            return x / window.p

        return Deferred(collect)

    def state_dict(self) -> dict:
        """Counters, slots, and per window its ``x`` and push-sum weight ``p``."""
        return {
            **super().state_dict(),
            "p": [w.p for w in self.windows],
            "x": [w.tensor.detach().clone() for w in self.windows],
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore counters, slots and, where saved, the windows' ``x`` and ``p``."""
        super().load_state_dict(state)
        for window, p in zip(self.windows, self._per_window(state, "p"), strict=True):
            if p is not None:
                window.p = float(p)
        for window, x in zip(self.windows, self._per_window(state, "x"), strict=True):
            if x is not None:
                window.tensor.copy_(x)


def _check_strongly_connected(graph: Topology, dead: frozenset[int]) -> None:
    """Raise TopologyError when the live ranks of ``graph`` are not strongly connected.

    Push-sum conserves mass, so it reaches the survivors' average only where every live
    rank's mass can reach every other; on separate components it settles on one average
    per component and never says so. (Win-put finds this in ``Topology.without``.)
    """
    alive = [r for r in range(graph.size) if r not in dead]
    adjacency = graph.adjacency[np.ix_(alive, alive)]
    parts = connected_components(adjacency)
    if len(parts) > 1:
        named = [[alive[i] for i in part] for part in parts]
        raise TopologyError(
            f"push-sum: the survivors of {graph!r} without ranks {sorted(dead)} are not "
            f"strongly connected; components: {named}"
        )
