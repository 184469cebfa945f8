"""Data for decentralized training under skew: partitioners, skew measures, norm layers.

Also the one loader of scikit-learn's bundled digits that examples and benchmarks share.

Pure functions of labels and seeds: nothing here talks to other ranks or needs
:func:`gossamer.init`, so every rank computes the same :class:`Partition` from the same
seed and picks its own part with ``gossamer.rank()``.
"""

from __future__ import annotations

from gossamer.data.digits import load_digits
from gossamer.data.norm import batchnorm_to_groupnorm, default_num_groups
from gossamer.data.partition import Partition, PartSampler
from gossamer.data.partitioners import dirichlet, iid, shards
from gossamer.data.skew import Skew, label_histograms, skew

__all__ = [
    "PartSampler",
    "Partition",
    "Skew",
    "batchnorm_to_groupnorm",
    "default_num_groups",
    "dirichlet",
    "iid",
    "label_histograms",
    "load_digits",
    "shards",
    "skew",
]
