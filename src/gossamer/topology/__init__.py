"""Communication graphs: the ``Topology`` value type, generators, weights and schedules."""

from __future__ import annotations

from gossamer.topology.cliques import DCliques, d_cliques
from gossamer.topology.draw import draw
from gossamer.topology.dynamic import (
    Step,
    inner_outer_exponential_two,
    inner_outer_ring,
    machine_exponential_two,
    one_peer_exponential,
)
from gossamer.topology.graphs import (
    exponential,
    exponential_two,
    fully_connected,
    mesh_grid_2d,
    ring,
    star,
    symmetric_exponential,
)
from gossamer.topology.skew import PeerClumping, peer_clumping
from gossamer.topology.skip import SKIP_MODES, drop_dead, skip_dead
from gossamer.topology.survivors import WEIGHT_RULES, connected_components
from gossamer.topology.topology import Topology
from gossamer.topology.weights import (
    is_column_stochastic,
    is_doubly_stochastic,
    is_equivalent,
    is_regular,
    is_row_stochastic,
    metropolis_hastings_weights,
    mixing_rate,
    spectral_gap,
    uniform_weights,
)

__all__ = [
    "DCliques",
    "PeerClumping",
    "SKIP_MODES",
    "Step",
    "Topology",
    "WEIGHT_RULES",
    "connected_components",
    "d_cliques",
    "draw",
    "drop_dead",
    "exponential",
    "exponential_two",
    "fully_connected",
    "inner_outer_exponential_two",
    "inner_outer_ring",
    "is_column_stochastic",
    "is_doubly_stochastic",
    "is_equivalent",
    "is_regular",
    "is_row_stochastic",
    "machine_exponential_two",
    "mesh_grid_2d",
    "metropolis_hastings_weights",
    "mixing_rate",
    "one_peer_exponential",
    "peer_clumping",
    "ring",
    "skip_dead",
    "spectral_gap",
    "star",
    "symmetric_exponential",
    "uniform_weights",
]
