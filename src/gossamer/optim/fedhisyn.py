r"""FedHiSyn: group ranks by speed, gossip on a ring inside each group, average globally.

Li, Lyu, Chen, Xu and Zhang, "FedHiSyn: A Hierarchical Synchronous Federated Learning
Framework for Resource and Data Heterogeneity", ICPP 2022. Devices of similar speed are
clustered; inside a cluster the models travel around a ring every step, and all clusters'
models are averaged once per round, so fast devices do not idle behind slow ones except at
that average.

Here, with the step times :math:`t_i` (seconds per local step, measured or given) allgathered:

1. **grouping** (:func:`group_by_speed`): sort the ranks by :math:`\log t_i` and cut the
   sorted list at the ``num_groups - 1`` largest gaps, so ranks of like speed share a group;
2. **every step**: the local step, then the group's ring average
   :math:`x_i \leftarrow \frac{1}{|N_i|+1}(x_i + \sum_{j \in N_i} x_j)`, :math:`N_i` the
   ring neighbours of :math:`i` inside its group (a group of two averages the pair, a group of
   one keeps its model); no message crosses groups;
3. **every round**: the last step of a round ends with the global average
   :math:`x_i \leftarrow \frac1n \sum_j x_j` instead of the ring average. A round is
   ``interval`` steps for the slowest group; with ``scale_steps=True`` group :math:`g` takes
   :math:`K_g = \max(1, \operatorname{round}(\text{interval} \cdot T_{\text{slow}} / T_g))`
   steps (:math:`T` a group's mean step time), so every group reaches the global average at
   about the same time and faster groups do more work instead of waiting.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Sequence

import numpy as np
import torch

from gossamer import context, ops
from gossamer.communicators import NeighborAllreduce
from gossamer.optim.combine import AdaptThenCombine
from gossamer.topology import Topology, ring

__all__ = ["FedHiSyn", "group_by_speed", "grouped_ring"]


def group_by_speed(step_times: Sequence[float], num_groups: int) -> tuple[tuple[int, ...], ...]:
    r"""Cluster ranks by step time: cut the ranks sorted by :math:`\log t` at the largest gaps.

    Args:
        step_times (Sequence[float]): seconds per step of rank 0, 1, ... (all > 0).
        num_groups (int): ``1 <= num_groups <= len(step_times)``.

    Returns:
        The groups, fastest first, each a sorted tuple of ranks; together they partition the
        ranks. Equal gaps are cut at the faster end first.

    Raises:
        TypeError: ``num_groups`` is not an int.
        ValueError: a time is not finite and positive, or ``num_groups`` is out of range.

    Example:
        >>> group_by_speed([1.0, 2.1, 0.9, 2.0], 2)
        ((0, 2), (1, 3))
    """
    try:
        times = np.asarray(step_times, dtype=np.float64)
    except (TypeError, ValueError):
        raise TypeError(f"step_times must be a sequence of numbers; got {step_times!r}") from None
    if times.ndim != 1 or times.size == 0:
        raise ValueError(f"step_times must be a non-empty sequence; got {step_times!r}")
    if not np.all(np.isfinite(times)) or np.any(times <= 0):
        raise ValueError(f"step_times must be finite and > 0; got {list(times)}")
    if isinstance(num_groups, bool) or not isinstance(num_groups, int):
        raise TypeError(f"num_groups must be an int; got {num_groups!r}")
    if not 1 <= num_groups <= times.size:
        raise ValueError(f"num_groups must be in [1, {times.size}]; got {num_groups}")
    order = np.argsort(times, kind="stable")
    gaps = np.diff(np.log(times[order]))
    # The largest gaps, ties at the faster end (stable sort of the negated gaps).
    cuts = sorted(np.argsort(-gaps, kind="stable")[: num_groups - 1] + 1)
    return tuple(tuple(sorted(int(r) for r in part)) for part in np.split(order, cuts))


def grouped_ring(groups: Sequence[Sequence[int]], size: int) -> Topology:
    """A bidirectional ring inside each group, no edge between groups (block diagonal).

    Raises:
        TypeError: ``groups`` is not a sequence of sequences of ranks, or ``size`` not an int.
        ValueError: the groups do not partition ``0 .. size-1`` (or one is empty).
    """
    if isinstance(size, bool) or not isinstance(size, int):
        raise TypeError(f"size must be an int; got {size!r}")
    if size < 1:
        raise ValueError(f"size must be >= 1; got {size}")
    if not isinstance(groups, Sequence) or not all(isinstance(g, Sequence) for g in groups):
        raise TypeError(f"groups must be a sequence of sequences of ranks; got {groups!r}")
    flat = sorted(r for g in groups for r in g)
    if flat != list(range(size)) or not all(groups):
        raise ValueError(f"groups must partition the ranks 0..{size - 1}; got {groups!r}")
    weights = np.zeros((size, size))
    for group in groups:
        members = sorted(group)
        block = ring(len(members)).weights
        weights[np.ix_(members, members)] = block
    name = "grouped_ring(" + ", ".join(str(list(g)) for g in groups) + ")"
    return Topology(weights, name=name)


class FedHiSyn(AdaptThenCombine):
    r"""Adapt-then-combine over a ring inside each speed group, a global average every round.

    The step times either come from ``step_time`` (this rank's seconds per step, e.g. from
    a profile) or are measured: the first ``calibration_steps`` steps are local (no
    communication), timed from one :meth:`step` call to the next, and end with a global
    average of the parameters. Either way the times are allgathered and the ranks grouped
    with :func:`group_by_speed` (collective, the same on every rank). See the module for
    the schedule.

    Attributes:
        groups (tuple[tuple[int, ...], ...] | None): the groups, fastest first (``None``
            while calibrating).
        steps_per_round (int | None): :math:`K_g` of this rank's group.
        step_times (list[float] | None): every rank's measured or given step time.

    Args:
        optimizer (torch.optim.Optimizer): the local optimizer.
        model (nn.Module): the model.
        num_groups (int): number of speed groups (capped at the world size).
        interval (int): steps per round of the slowest group (>= 1).
        step_time (float, optional): this rank's seconds per step; skips calibration.
        calibration_steps (int): steps timed when ``step_time`` is not given (>= 2).
        scale_steps (bool): faster groups take proportionally more steps per round.

    Example:
        >>> opt = FedHiSyn(torch.optim.SGD(model.parameters(), lr=0.1), model, interval=8)
        >>> for _ in range(total):   # a round: opt.steps_per_round steps of this rank
        ...     loss_fn(model(x), y).backward(); opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model,
        *,
        num_groups: int = 2,
        interval: int = 8,
        step_time: float | None = None,
        calibration_steps: int = 5,
        scale_steps: bool = True,
        fusion_threshold_bytes: int | None = 8 * 2**20,
    ) -> None:
        for name, value, low in (
            ("num_groups", num_groups, 1),
            ("interval", interval, 1),
            ("calibration_steps", calibration_steps, 2),
        ):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int >= {low}; got {value!r}")
            if value < low:
                raise ValueError(f"{name} must be an int >= {low}; got {value!r}")
        if step_time is not None:
            said = f"step_time must be a finite number > 0 or None; got {step_time!r}"
            if isinstance(step_time, bool) or not isinstance(step_time, int | float):
                raise TypeError(said)
            if not math.isfinite(step_time) or step_time <= 0:
                raise ValueError(said)
        if not isinstance(scale_steps, bool):
            raise TypeError(f"scale_steps must be a bool; got {scale_steps!r}")
        super().__init__(
            optimizer,
            model,
            communicator=NeighborAllreduce(),
            fusion_threshold_bytes=fusion_threshold_bytes,
        )
        self.num_groups = min(num_groups, context.size())
        self.interval = interval
        self.scale_steps = scale_steps
        self.calibration_steps = 0 if step_time is not None else calibration_steps
        self.groups: tuple[tuple[int, ...], ...] | None = None
        self.steps_per_round: int | None = None
        self.step_times: list[float] | None = None
        self._stamps: list[float] = []
        if step_time is not None:
            self._group(float(step_time))

    def settings(self) -> dict[str, object]:
        """The settings every rank must build this optimizer with (checked when built).

        Not ``step_time``: ranks differ in speed, which is what FedHiSyn groups by.
        """
        return {
            **super().settings(),
            "num_groups": self.num_groups,
            "interval": self.interval,
            "calibration_steps": self.calibration_steps,
            "scale_steps": self.scale_steps,
        }

    @property
    def calibrating(self) -> bool:
        """Whether the steps are still local and timed (no groups yet)."""
        return self.groups is None

    def _is_round(self) -> bool:
        return not self.calibrating

    def step(self, closure=None):
        """The local step; ring or global average as scheduled (see the class)."""
        if not self.calibrating:
            return super().step(closure)
        self._stamps.append(time.perf_counter())
        loss = super().step(closure)  # local only: _is_round() is False
        if self.steps == self.calibration_steps:
            intervals = np.diff(self._stamps)
            self._group(float(statistics.median(intervals)))
            for bucket in self.buckets:
                bucket.unpack(ops.allreduce(bucket.pack()), lambda p: p.data)
        return loss

    def _group(self, seconds: float) -> None:
        """Allgather the step times, form the groups, set this rank's ring and round length."""
        times = ops.allgather(torch.tensor([seconds], dtype=torch.float64)).tolist()
        self._configure(group_by_speed(times, self.num_groups), times)

    def _configure(self, groups: tuple[tuple[int, ...], ...], times: list[float]) -> None:
        """Set the groups, this rank's round length, and the communicator's ring and period."""
        self.groups, self.step_times = groups, times
        me = context.rank()
        mean = [statistics.fmean(times[r] for r in g) for g in groups]
        mine = next(i for i, g in enumerate(groups) if me in g)
        if self.scale_steps:
            self.steps_per_round = max(1, round(self.interval * max(mean) / mean[mine]))
        else:
            self.steps_per_round = self.interval
        self.communicator.topology = grouped_ring(groups, context.size())
        self.communicator.global_average_every = self.steps_per_round
        # Every rank is here together; their first ring rounds may not be.
        self.communicator.check_posted([bucket.flat for bucket in self.buckets])

    def _comm_state(self) -> dict:
        hisyn = {
            "groups": None if self.groups is None else [list(g) for g in self.groups],
            "step_times": self.step_times,
            "stamps": list(self._stamps),
        }
        return {**super()._comm_state(), "fedhisyn": hisyn}

    def _load_comm_state(self, state: dict) -> None:
        hisyn = state.get("fedhisyn", {})
        super()._load_comm_state(state)
        self._stamps = list(hisyn.get("stamps", []))
        groups = hisyn.get("groups")
        if groups is None:
            self.groups = self.step_times = self.steps_per_round = None
            return
        grouped_ring(groups, context.size())  # checks that they fit this world
        self._configure(
            tuple(tuple(int(r) for r in g) for g in groups),
            [float(t) for t in hisyn["step_times"]],
        )
