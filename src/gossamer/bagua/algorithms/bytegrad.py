r"""ByteGrad: gradient averaging with 8-bit scatter-reduce-gather (MinMaxUInt8).

Per bucket, over :math:`n` ranks (machines when hierarchical), with :math:`C` the
MinMaxUInt8 compressor (one min/max per chunk) and :math:`D` its decompressor:

1. split the gradient into :math:`n` chunks :math:`g^{(j)}`, send :math:`C(g_i^{(j)})` to rank
   :math:`j` (alltoall);
2. rank :math:`j` reduces its chunk, :math:`\bar g^{(j)} = \frac1n \sum_i D(C(g_i^{(j)}))`;
3. it sends :math:`C(\bar g^{(j)})` to everyone (allgather), and every rank decompresses.

Gradients are quantized twice, deterministically, without error feedback, as in Bagua.
Buckets are padded to a multiple of the number of ranks.
"""

from __future__ import annotations

from typing import Any

from gossamer.bagua._groups import BaguaProcessGroup
from gossamer.bagua.algorithms.base import Algorithm, AlgorithmImpl
from gossamer.bagua.algorithms.gradient_allreduce import check_bool
from gossamer.bagua.bucket import BaguaBucket

__all__ = ["ByteGradAlgorithm", "ByteGradAlgorithmImpl"]


class ByteGradAlgorithmImpl(AlgorithmImpl):
    """:class:`ByteGradAlgorithm` bound to a process group."""

    def __init__(
        self, process_group: BaguaProcessGroup, hierarchical: bool = True, average: bool = True
    ) -> None:
        super().__init__(process_group)
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.average = check_bool(average, "average")

    def tensors_to_buckets(self, tensors: list[list[Any]], do_flatten: bool) -> list[BaguaBucket]:
        """Buckets padded to a multiple of the number of ranks."""
        n = len(self.process_group.ranks)
        return [
            BaguaBucket(group, flatten=do_flatten, name=str(i), alignment=n)
            for i, group in enumerate(tensors)
        ]

    def init_operations(self, bagua_ddp: Any, bucket: BaguaBucket) -> None:
        """One compressed scatter-gather per bucket."""
        bucket.clear_ops()
        bucket.append_centralized_synchronous_op(
            hierarchical=self.hierarchical,
            average=self.average,
            scattergather=True,
            compression="MinMaxUInt8",
            group=self.process_group,
        )


class ByteGradAlgorithm(Algorithm):
    """8-bit compressed gradient averaging.

    Args:
        hierarchical (bool): average inside each machine first (exactly), compress between
            machines.
        average (bool): average the gradients; False sums them.
    """

    def __init__(self, hierarchical: bool = True, average: bool = True) -> None:
        self.hierarchical = check_bool(hierarchical, "hierarchical")
        self.average = check_bool(average, "average")

    def reify(self, process_group: BaguaProcessGroup) -> ByteGradAlgorithmImpl:
        """The implementation for ``process_group``."""
        return ByteGradAlgorithmImpl(process_group, self.hierarchical, self.average)
