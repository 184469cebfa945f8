"""Bagua's data-parallel wrapper and the engine behind ``with_bagua``."""

from __future__ import annotations

from gossamer.bagua.data_parallel.bagua_distributed import BaguaDistributedDataParallel
from gossamer.bagua.data_parallel.distributed import DistributedDataParallel

__all__ = ["BaguaDistributedDataParallel", "DistributedDataParallel"]
