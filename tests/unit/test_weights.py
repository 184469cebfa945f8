"""Weight rules, stochasticity checks, spectral gaps, regularity and equivalence."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gossamer.errors import TopologyError
from gossamer.topology import (
    Topology,
    exponential,
    exponential_two,
    fully_connected,
    is_column_stochastic,
    is_doubly_stochastic,
    is_equivalent,
    is_regular,
    is_row_stochastic,
    mesh_grid_2d,
    metropolis_hastings_weights,
    mixing_rate,
    ring,
    spectral_gap,
    star,
    symmetric_exponential,
    uniform_weights,
)

SIZES = [*range(1, 10), 16]

ALL_GENERATORS = {
    "exponential": exponential,
    "exponential_base3": lambda n: exponential(n, 3),
    "exponential_two": exponential_two,
    "symmetric_exponential": symmetric_exponential,
    "symmetric_exponential_base2": lambda n: symmetric_exponential(n, 2),
    "mesh_grid_2d": mesh_grid_2d,
    "star": star,
    "star_last": lambda n: star(n, n - 1),
    "ring": ring,
    "ring_left": lambda n: ring(n, "left"),
    "ring_right": lambda n: ring(n, "right"),
    "fully_connected": fully_connected,
}

# --- stochasticity --------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("name", ALL_GENERATORS)
def test_every_generator_is_doubly_stochastic(name, size):
    topo = ALL_GENERATORS[name](size)
    assert is_column_stochastic(topo)
    assert is_row_stochastic(topo)
    assert is_doubly_stochastic(topo)
    assert is_doubly_stochastic(topo.weights)
    np.testing.assert_allclose(topo.weights.sum(axis=0), 1.0, atol=1e-12)


def test_non_stochastic_matrices():
    column_only = np.array([[0.5, 1.0], [0.5, 0.0]])
    assert is_column_stochastic(column_only)
    assert not is_row_stochastic(column_only)
    assert not is_doubly_stochastic(column_only)
    assert is_row_stochastic(column_only.T) and not is_column_stochastic(column_only.T)
    assert not is_doubly_stochastic(2 * np.eye(3))
    assert not is_column_stochastic(Topology(np.eye(3) * 0.9))


def test_stochastic_tolerance():
    nearly = np.array([[0.5, 0.5], [0.5, 0.5 + 1e-8]])
    assert not is_column_stochastic(nearly)
    assert is_column_stochastic(nearly, atol=1e-6)


@pytest.mark.parametrize(
    "function", [is_row_stochastic, is_column_stochastic, is_doubly_stochastic]
)
def test_stochastic_checks_reject_bad_input(function):
    with pytest.raises(ValueError, match="atol"):
        function(np.eye(2), atol=-1.0)
    with pytest.raises(TypeError, match="atol"):
        function(np.eye(2), atol="tiny")
    with pytest.raises(TopologyError, match="matrix"):
        function(np.ones(3))
    with pytest.raises(TopologyError, match=r"matrix.*non-negative"):
        function([[2.0, -1.0], [-1.0, 2.0]])
    with pytest.raises(TypeError, match="matrix"):
        function("abc")


# --- uniform and Metropolis-Hastings weights ------------------------------------------------


def test_uniform_weights_hand_made_directed_graph():
    # Edges 0 -> 1, 0 -> 2, 1 -> 2; the diagonal of the input is ignored.
    adjacency = np.array([[1, 1, 1], [0, 0, 1], [0, 0, 0]])
    expected = np.array([[1.0, 1 / 2, 1 / 3], [0.0, 1 / 2, 1 / 3], [0.0, 0.0, 1 / 3]])
    topo = uniform_weights(adjacency)
    np.testing.assert_allclose(topo.weights, expected, atol=1e-15)
    assert is_column_stochastic(topo) and not is_row_stochastic(topo)
    np.testing.assert_allclose(uniform_weights(adjacency.astype(bool)).weights, expected)


@pytest.mark.parametrize("size", [1, 2, 5, 8, 16])
def test_uniform_weights_of_regular_graphs_reproduce_them(size):
    for topo in (exponential(size), ring(size), ring(size, "right"), fully_connected(size)):
        np.testing.assert_allclose(uniform_weights(topo).weights, topo.weights, atol=1e-15)


def test_metropolis_hastings_path_graph():
    adjacency = np.array([[0, 1, 0], [1, 0, 1], [0, 1, 0]])
    # Degrees without self: 1, 2, 1, so each link weighs 1 / (1 + 2).
    expected = np.array([[2 / 3, 1 / 3, 0], [1 / 3, 1 / 3, 1 / 3], [0, 1 / 3, 2 / 3]])
    topo = metropolis_hastings_weights(adjacency)
    np.testing.assert_allclose(topo.weights, expected, atol=1e-15)
    assert is_doubly_stochastic(topo)


@pytest.mark.parametrize("size", [2, 3, 5, 9])
def test_metropolis_hastings_of_star_is_star(size):
    np.testing.assert_allclose(
        metropolis_hastings_weights(star(size)).weights, star(size).weights, atol=1e-15
    )


def test_metropolis_hastings_of_mesh_grid_is_mesh_grid():
    grid = mesh_grid_2d(12)
    assert is_equivalent(metropolis_hastings_weights(grid.adjacency), grid)


@pytest.mark.parametrize("function", [uniform_weights, metropolis_hastings_weights])
def test_weight_rules_reject_bad_adjacency(function):
    with pytest.raises(TopologyError, match=r"adjacency.*0 or 1"):
        function(np.array([[0, 2], [2, 0]]))
    with pytest.raises(TopologyError, match=r"adjacency.*square"):
        function(np.ones((2, 3)))
    with pytest.raises(TypeError, match="adjacency"):
        function(None)


def test_metropolis_hastings_rejects_directed_graphs():
    with pytest.raises(TopologyError, match=r"adjacency.*symmetric.*0 -> 1"):
        metropolis_hastings_weights(np.array([[0, 1], [0, 0]]))
    with pytest.raises(ValueError, match="adjacency"):
        metropolis_hastings_weights(exponential(8))


# --- spectral gap ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", range(5, 11))
def test_ring_spectral_gap_closed_form(size):
    eigenvalues = [(1 + 2 * math.cos(2 * math.pi * k / size)) / 3 for k in range(1, size)]
    second = max(abs(v) for v in eigenvalues)
    assert mixing_rate(ring(size)) == pytest.approx(second, abs=1e-12)
    assert spectral_gap(ring(size)) == pytest.approx(1 - second, abs=1e-12)


@pytest.mark.parametrize("size", [2, 3, 8, 16])
def test_fully_connected_gap_is_one(size):
    assert spectral_gap(fully_connected(size)) == pytest.approx(1.0, abs=1e-12)


def test_single_rank_gap_is_one():
    assert spectral_gap(fully_connected(1)) == 1.0
    assert mixing_rate(Topology([[1.0]])) == 0.0


def test_disconnected_graph_gap_is_zero():
    blocks = np.zeros((4, 4))
    blocks[:2, :2] = blocks[2:, 2:] = 0.5
    assert spectral_gap(Topology(blocks)) == pytest.approx(0.0, abs=1e-12)
    assert spectral_gap(np.eye(3)) == pytest.approx(0.0, abs=1e-12)


def test_directed_ring_gap_uses_complex_moduli():
    # ring(n, "right") has eigenvalues (1 + exp(2 pi i k / n)) / 2, modulus |cos(pi k / n)|.
    size = 6
    assert mixing_rate(ring(size, "right")) == pytest.approx(math.cos(math.pi / size), abs=1e-12)


def test_exponential_mixes_faster_than_ring():
    assert spectral_gap(exponential(16)) > spectral_gap(ring(16))


def test_spectral_gap_rejects_bad_input():
    with pytest.raises(TopologyError, match="topology"):
        spectral_gap(np.ones(4))
    with pytest.raises(TypeError, match="topology"):
        mixing_rate("ring")


# --- regularity and equivalence -------------------------------------------------------------


@pytest.mark.parametrize("size", [3, 5, 8, 16])
def test_is_regular(size):
    assert is_regular(exponential(size))
    assert is_regular(ring(size, "left"))
    assert is_regular(fully_connected(size))
    assert not is_regular(star(size))
    assert is_regular(fully_connected(1))


def test_is_regular_counts_in_plus_out_degree():
    # 0 -> 1 -> 2 -> 0 is regular; adding 0 -> 2 is not.
    cycle = np.eye(3) + np.roll(np.eye(3), 1, axis=1)
    assert is_regular(Topology(cycle))
    cycle[0, 2] = 1.0
    assert not is_regular(Topology(cycle))
    assert not is_regular(mesh_grid_2d(6))


def test_is_regular_rejects_non_topology():
    with pytest.raises(TypeError, match="topology"):
        is_regular(np.eye(2))


def test_is_equivalent():
    assert is_equivalent(exponential(8), exponential_two(8))
    assert is_equivalent(Topology(np.full((3, 3), 1 / 3), name="x"), ring(3))
    assert not is_equivalent(ring(4), ring(5))
    assert not is_equivalent(ring(5), ring(5, "left"))
    assert not is_equivalent(ring(5), None)
    assert not is_equivalent(None, ring(5))
    assert not is_equivalent(None, None)
    with pytest.raises(TypeError, match="second"):
        is_equivalent(ring(3), np.eye(3))
    with pytest.raises(TypeError, match="first"):
        is_equivalent("ring", ring(3))
