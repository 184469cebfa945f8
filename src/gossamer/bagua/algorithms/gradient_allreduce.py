r"""Gradient allreduce: data parallelism, every rank steps with the averaged gradient.

.. math:: x_{t+1} = x_t - \eta\, \frac1n \sum_{i} \nabla f_i(x_t)

(for SGD; any optimizer sees the averaged gradient). Gradients are packed into buckets in
backward order; a bucket's allreduce starts from the gradient hooks as soon as all its
gradients are ready, overlapping the rest of the backward pass, as torch DDP does.
"""

from __future__ import annotations

from typing import Any

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl
from gossamer.bagua.bucket import BaguaBucket

__all__ = ["GradientAllReduceAlgorithm", "GradientAllReduceAlgorithmImpl"]


def check_bool(value: object, name: str) -> bool:
    """``value`` if it is a bool, else TypeError naming ``name``."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return value


class GradientAllReduceAlgorithmImpl(AlgorithmImpl):
    """:class:`GradientAllReduceAlgorithm` bound to a process group."""

    def __init__(
        self, process_group: BaguaProcessGroup, hierarchical: bool = False, average: bool = True
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.average = check_bool(average, "average")

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """One centralized allreduce per bucket."""
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical, average=self.average, group=self.process_group
        )


class GradientAllReduceAlgorithm(Algorithm):
    """Average (or sum) the gradients over all ranks.

    Args:
        hierarchical (bool): average inside each machine first, then between machines.
        average (bool): average the gradients; False sums them.
    """

    def __init__(self, hierarchical: bool = False, average: bool = True) -> None:
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.average = check_bool(average, "average")

    def reify(self, process_group: BaguaProcessGroup) -> GradientAllReduceAlgorithmImpl:
        """The implementation for ``process_group``."""
        return GradientAllReduceAlgorithmImpl(process_group, self.hierarchical, self.average)
