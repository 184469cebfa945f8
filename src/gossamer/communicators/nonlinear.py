r"""Nonlinear gossip (NGO): consensus through an odd, sign-power coupling.

Each round rank :math:`i` receives its in-neighbours' values and moves towards them
through a nonlinear odd function :math:`\phi`, applied element by element:

.. math::
    x_i \leftarrow x_i + \varepsilon \sum_{j \in N_{in}(i)} w_{ji}\, \phi(x_j - x_i),
    \qquad \phi(d) = \operatorname{sign}(d)\, |d|^{p},\quad 0 < p \le 1.

:math:`p = 1` is linear gossip, :math:`x_i \leftarrow (1 - \varepsilon \sum_j w_{ji}) x_i
+ \varepsilon \sum_j w_{ji} x_j` (with :math:`\varepsilon = 1` and :math:`w_{ii} = 1 -
\sum_j w_{ji}`, exactly :class:`NeighborAllreduce`). With :math:`p < 1` the coupling is
steeper than linear near agreement, and the continuous-time flow
:math:`\dot x_i = \sum_j w_{ji} \phi(x_j - x_i)` reaches exact consensus in finite time on a
connected undirected graph (Wang and Xiao 2010; Cortes 2006). The discrete rounds here
reach a band around consensus of width at most :math:`(2 \varepsilon
\sum_j w_{ji})^{1/(1-p)}` per element (a smaller gap is overshot, so the values chatter
there; measured on ``ring(4)`` with uniform weights: an eighth of that bound, reached in
about 10 rounds, where linear gossip keeps shrinking geometrically): use a step
:math:`\varepsilon \sum_j w_{ji} \le 1/2` and decrease :attr:`NonlinearGossip.step_size`
(an attribute, like a learning rate) when the gaps should shrink further. :math:`\phi` is
not scale-free: the same :math:`\varepsilon` moves parameters of size 1e-3 relatively more
than parameters of size 1.

**The average.** :math:`\phi` is odd, so with symmetric weights (:math:`w_{ji} = w_{ij}`,
an undirected graph such as Metropolis-Hastings or uniform weights on a regular graph)
the terms of an edge cancel in :math:`\sum_i x_i` and every round preserves the average
exactly. With directed or one-sided schedules (the one-peer exponential schedule: i hears
i - 2^k but not i + 2^k) it does not, as with any non-doubly-stochastic mixing.
Send-side scales (``Step.dst_weights``) are not applied: every neighbour sends its value.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from gossamer import ops, transport
from gossamer.communicators.base import Deferred, Pending
from gossamer.communicators.neighbor import Scheduled
from gossamer.topology import Step, Topology

__all__ = ["NonlinearGossip", "sign_power"]


def sign_power(d: torch.Tensor, power: float) -> torch.Tensor:
    r""":math:`\operatorname{sign}(d)\,|d|^p`, element by element (odd; 0 at 0)."""
    return torch.sign(d) * d.abs().pow(power)


def _check_number(value: object, name: str, low: float, high: float | None) -> float:
    bad = isinstance(value, bool) or not isinstance(value, int | float)
    if not bad:
        value = float(value)
        bad = not (low < value < math.inf and (high is None or value <= high))
    if bad:
        upper = "inf)" if high is None else f"{high}]"
        raise ValueError(f"{name} must be a number in ({low}, {upper}; got {value!r}")
    return float(value)


class NonlinearGossip(Scheduled):
    r"""Each round: :math:`x_i \mathrel{+}= \varepsilon \sum_j w_{ji}\,\phi(x_j - x_i)`.

    Any optimizer that takes a communicator uses it as its mixing rule, e.g.
    ``AdaptThenCombine(sgd, model, communicator=NonlinearGossip(topology, power=0.5))``.

    Args:
        topology (Topology, optional): static graph and weights (default: the group's).
        power (float): :math:`p` in (0, 1]; 1 is linear gossip.
        step_size (float): :math:`\varepsilon > 0`; see the module for its choice.
        schedule (Iterator[Step], optional): a dynamic topology (its ``src_weights``).
        global_average_every (int, optional): every K-th round is a global average.

    Raises:
        TypeError: ``topology`` is not a Topology or ``schedule`` not an iterator.
        ValueError: ``power`` outside (0, 1], ``step_size <= 0``, or both ``topology`` and
            ``schedule``.
    """

    name = "nonlinear_gossip"

    def __init__(
        self,
        topology: Topology | None = None,
        *,
        power: float = 0.5,
        step_size: float = 0.5,
        schedule: Iterator[Step] | None = None,
        global_average_every: int | None = None,
    ) -> None:
        super().__init__(schedule=schedule, global_average_every=global_average_every)
        if topology is not None and not isinstance(topology, Topology):
            raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
        if topology is not None and schedule is not None:
            raise ValueError("give topology or schedule, not both")
        self.topology = topology
        self.power = _check_number(power, "power", 0.0, 1.0)
        self.step_size = _check_number(step_size, "step_size", 0.0, None)

    def _plan(self) -> tuple[dict[int, float], list[int], list[int]]:
        """(receive weights, sources, destinations) of this round."""
        if self.step is not None:
            step = self.step
            return dict(step.src_weights), list(step.recv_ranks), list(step.send_ranks)
        graph = ops.get_topology() if self.topology is None else self.topology
        me = transport.group_rank(None)
        _, weights = graph.recv_weights(me)
        return dict(weights), list(graph.in_neighbors(me)), list(graph.out_neighbors(me))

    def _start(self, flat: torch.Tensor, index: int) -> Pending | None:
        weights, sources, dsts = self._plan()
        x = flat.detach().clone()
        handle = ops.neighbor_allgather(
            x.reshape(1, -1), src_ranks=sources, dst_ranks=dsts, async_op=True
        )
        power, eps = self.power, self.step_size

        def finish() -> torch.Tensor:
            rows = handle.wait()
            pull = torch.zeros_like(x)
            for row, src in zip(rows, sources, strict=True):
                pull.add_(sign_power(row.view_as(x) - x, power), alpha=weights[src])
            return x.add_(pull, alpha=eps)

        return Deferred(finish)
