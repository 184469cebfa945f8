r"""D-Cliques clique averaging: unbiased gradients inside a clique, gossip between cliques.

Bellet, Kermarrec and Lavoie, *D-Cliques: Compensating for Data Heterogeneity with Topology
in Decentralized Federated Learning* (SRDS 2022, arXiv:2104.07365), Algorithm 2 with
momentum. The cliques of :func:`gossamer.topology.d_cliques` are chosen so that the union
of a clique's data has (nearly) the global label mix; averaging gradients inside the clique
then removes the bias that a rank's skewed labels give its own gradient. Rank :math:`i` in
clique :math:`C(i)`, with the base optimizer's update :math:`u(\cdot)` (for SGD with
momentum :math:`\beta`: :math:`v \leftarrow \beta v + g`, :math:`u = -\eta v`):

.. math::
    g_i = \frac{1}{|C(i)|} \sum_{j \in C(i)} \nabla F(x_j; \xi_j),\qquad
    x_i^{+} = \sum_j W_{ji}\, \big(x_j + u_j(g_j)\big),

so the momentum is taken on the clique-averaged gradient (the paper's point: momentum on
the skewed local gradient amplifies the bias), and the parameters are then averaged over
the D-Cliques graph (intra- and inter-clique edges, Metropolis-Hastings weights).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from gossamer import context, ops
from gossamer.optim.combine import AdaptThenCombine
from gossamer.topology import DCliques, Topology

__all__ = ["CliqueAveraging", "check_cliques"]

_TAKE_TOPOLOGY = (None, "neighbor_allreduce", "nonlinear_gossip")


def _given(kwargs: dict, *names: str) -> bool:
    return any(kwargs.get(name) is not None for name in names)


def check_cliques(cliques: object, size: int) -> tuple[tuple[int, ...], ...]:
    """``cliques`` as sorted rank tuples, or an error if they do not partition ``0..size-1``.

    Raises:
        TypeError: ``cliques`` is not a sequence of sequences of ints (numpy arrays and
            integers count).
        ValueError: a rank is outside ``[0, size)``, repeated, missing, or a clique is empty.
    """
    if isinstance(cliques, np.ndarray):
        cliques = cliques.tolist()
    if isinstance(cliques, str | bytes) or not isinstance(cliques, Sequence):
        raise TypeError(f"cliques must be a sequence of rank lists; got {cliques!r}")
    result = []
    for clique in cliques:
        if isinstance(clique, np.ndarray):
            clique = clique.tolist()  # np.array_split's parts
        if isinstance(clique, str | bytes) or not isinstance(clique, Sequence):
            raise TypeError(f"cliques must be a sequence of rank lists; got member {clique!r}")
        if not clique:
            raise ValueError(f"cliques must not contain an empty clique; got {cliques!r}")
        ranks = []
        for r in clique:
            if isinstance(r, bool) or not isinstance(r, int | np.integer):
                raise TypeError(f"cliques must hold int ranks; got {r!r} in {clique!r}")
            if not 0 <= r < size:
                raise ValueError(f"cliques: rank {r} is outside [0, {size})")
            ranks.append(int(r))
        result.append(tuple(sorted(ranks)))
    seen = [r for c in result for r in c]
    repeated = sorted({r for r in seen if seen.count(r) > 1})
    if repeated:
        raise ValueError(f"cliques: ranks {repeated} are in more than one clique")
    missing = sorted(set(range(size)) - set(seen))
    if missing:
        raise ValueError(f"cliques: ranks {missing} are in no clique (world size {size})")
    return tuple(result)


class CliqueAveraging(AdaptThenCombine):
    r"""Clique averaging of gradients, the local (momentum) step, then neighbour averaging.

    Every :meth:`step` first replaces each gradient by its average over this rank's clique
    (a neighbour exchange with the clique's members, weights :math:`1/|C|`), then runs
    :class:`AdaptThenCombine`'s step: the wrapped optimizer's update (its momentum sees the
    clique-averaged gradient) and the parameter averaging over ``topology``. A parameter
    whose gradient is None on this rank counts as a zero gradient in the clique average.

    Args:
        optimizer (torch.optim.Optimizer): the local optimizer (the paper: SGD with momentum).
        model (nn.Module | Sequence[nn.Module]): the model(s) owning its parameters.
        cliques (DCliques | Sequence[Sequence[int]]): the output of
            :func:`gossamer.topology.d_cliques`, or the cliques as rank lists that together
            partition the ranks.
        topology (Topology, optional): the graph of the parameter averaging; default: the
            D-Cliques topology when ``cliques`` is a ``DCliques`` (unless a ``communicator``
            or a ``schedule`` is given), else the group's default.
        **kwargs: the options of :class:`AdaptThenCombine` (``communicator``,
            ``num_steps_per_communication``, ``exact_diffusion``, ...). The clique average
            of the gradients happens at every step.

    Raises:
        TypeError, ValueError: ``cliques`` do not partition the ranks (naming the rank), or
            ``topology`` has another size than the world.

    Example:
        >>> dc = gossamer.topology.d_cliques(label_histograms, clique_size=10)
        >>> opt = CliqueAveraging(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        ...                       model, dc)
        >>> loss_fn(model(x), y).backward()
        >>> opt.step()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        cliques: DCliques | Sequence[Sequence[int]],
        *,
        topology: Topology | None = None,
        **kwargs,
    ) -> None:
        size = context.size()
        if isinstance(cliques, DCliques):
            # The D-Cliques graph is the default only where the pattern takes a topology.
            takes_topology = kwargs.get("communication") in _TAKE_TOPOLOGY
            if (
                topology is None
                and takes_topology
                and not _given(kwargs, "communicator", "schedule")
            ):
                topology = cliques.topology
            cliques = cliques.cliques
        self.cliques = check_cliques(cliques, size)
        if topology is not None:
            if not isinstance(topology, Topology):
                raise TypeError(f"topology must be a gossamer Topology; got {topology!r}")
            if topology.size != size:
                raise ValueError(
                    f"topology has {topology.size} ranks but the world has {size}: "
                    f"{topology.name or 'topology'}"
                )
        if kwargs.get("overlap", False) is not False:
            # The clique average needs every gradient before any local step runs.
            raise ValueError(
                f"overlap must be False for clique averaging; got {kwargs['overlap']!r}"
            )
        kwargs["overlap"] = False
        super().__init__(optimizer, model, topology=topology, **kwargs)
        me = context.rank()
        self.clique = next(c for c in self.cliques if me in c)

    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built)."""
        return {**super().settings(), "cliques": self.cliques}

    def average_gradients(self) -> None:
        """Replace every gradient by its average over this rank's clique (collective)."""
        peers = [r for r in self.clique if r != context.rank()]
        share = 1.0 / len(self.clique)
        handles = []
        for bucket in self.buckets:
            for p in bucket.tensors:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            if not peers:
                continue
            flat = bucket.pack(lambda p: p.grad)
            handles.append(
                (
                    bucket,
                    ops.neighbor_allreduce(
                        flat,
                        self_weight=share,
                        src_weights=dict.fromkeys(peers, share),
                        dst_weights=dict.fromkeys(peers, 1.0),
                        async_op=True,
                    ),
                )
            )
        for bucket, handle in handles:
            bucket.unpack(handle.wait(), lambda p: p.grad)

    def step(self, closure=None):
        """Evaluate ``closure`` (if given), average gradients in the clique, then ATC's step."""
        self.synchronize()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.average_gradients()
        super().step()
        return loss
