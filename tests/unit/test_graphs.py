"""Generators against matrices built independently from their definitions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from gossamer.topology import (
    exponential,
    exponential_two,
    fully_connected,
    mesh_grid_2d,
    ring,
    star,
    symmetric_exponential,
)

SIZES = [*range(1, 10), 16]


def offsets_matrix(size: int, offsets: set[int]) -> np.ndarray:
    """W[i, (i + o) % size] = 1 / |offsets| for every offset: i sends to i + o."""
    offsets = {o % size for o in offsets}
    weights = np.zeros((size, size))
    for i in range(size):
        for o in offsets:
            weights[i, (i + o) % size] = 1.0 / len(offsets)
    return weights


def powers_below(limit: int, base: int) -> set[int]:
    return {base**t for t in range(limit.bit_length() + 1) if base**t < limit}


def reference_grid(nrow: int, ncol: int) -> np.ndarray:
    size = nrow * ncol

    def links(i: int) -> list[int]:
        r, c = divmod(i, ncol)
        cells = [(r - 1, c), (r + 1, c), (r, c - 1), (r, c + 1)]
        return [a * ncol + b for a, b in cells if 0 <= a < nrow and 0 <= b < ncol]

    degree_with_self = [len(links(i)) + 1 for i in range(size)]
    weights = np.zeros((size, size))
    for i in range(size):
        for j in links(i):
            weights[i, j] = 1.0 / max(degree_with_self[i], degree_with_self[j])
        weights[i, i] = 1.0 - weights[i].sum()
    return weights


# --- exponential ---------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("base", [2, 3, 4])
def test_exponential_matches_definition(size, base):
    topo = exponential(size, base)
    expected = offsets_matrix(size, {0} | powers_below(size, base))
    np.testing.assert_allclose(topo.weights, expected, rtol=0, atol=1e-15)
    assert topo.name == f"exponential({size}, base={base})"


@pytest.mark.parametrize("size", SIZES)
def test_exponential_two_in_neighbors_are_minus_powers_of_two(size):
    topo = exponential_two(size)
    hops = math.ceil(math.log2(size)) if size > 1 else 0
    for r in range(size):
        expected = sorted({(r - 2**i) % size for i in range(hops)})
        assert list(topo.in_neighbors(r)) == expected
        self_weight, weights = topo.recv_weights(r)
        assert self_weight == pytest.approx(1.0 / (hops + 1))
        assert all(w == pytest.approx(1.0 / (hops + 1)) for w in weights.values())
    assert topo == exponential(size, 2)
    assert topo.name == f"exponential_two({size})"


def test_exponential_8_literal():
    topo = exponential(8)
    for r in range(8):
        assert set(topo.in_neighbors(r)) == {(r - 1) % 8, (r - 2) % 8, (r - 4) % 8}
        assert set(topo.out_neighbors(r)) == {(r + 1) % 8, (r + 2) % 8, (r + 4) % 8}
    assert set(np.unique(topo.weights)) == {0.0, 0.25}


def test_exponential_5_base_3_literal():
    # Offsets 0, 1, 3: each rank keeps a third and sends a third to r+1 and r+3.
    expected = np.zeros((5, 5))
    for i in range(5):
        for o in (0, 1, 3):
            expected[i, (i + o) % 5] = 1 / 3
    np.testing.assert_allclose(exponential(5, base=3).weights, expected)


def test_exponential_large_power_uses_exact_arithmetic():
    # 3**5 = 243 must count; 242 and 244 must not, whatever float log says.
    topo = exponential(250, base=3)
    assert {243, 242, 244} & set(topo.out_neighbors(0)) == {243}
    assert topo.out_neighbors(0) == (1, 3, 9, 27, 81, 243)


# --- symmetric exponential ----------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("base", [2, 4])
def test_symmetric_exponential_matches_definition(size, base):
    powers = {p for p in powers_below(size, base) if p <= size // 2}
    expected = offsets_matrix(size, {0} | powers | {-p for p in powers})
    topo = symmetric_exponential(size, base)
    np.testing.assert_allclose(topo.weights, expected, rtol=0, atol=1e-15)
    for r in range(size):
        assert topo.in_neighbors(r) == topo.out_neighbors(r)


def test_symmetric_exponential_16_literal():
    # base 4, size 16: offsets 1, 4 and their mirrors 15, 12.
    assert symmetric_exponential(16).out_neighbors(0) == (1, 4, 12, 15)


# --- mesh grid ------------------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_mesh_grid_2d_default_shape(size):
    nrow = max(d for d in range(1, size + 1) if size % d == 0 and d * d <= size)
    topo = mesh_grid_2d(size)
    np.testing.assert_allclose(topo.weights, reference_grid(nrow, size // nrow), atol=1e-15)
    assert topo.name == f"mesh_grid_2d({size}, shape=({nrow}, {size // nrow}))"


def test_mesh_grid_2d_6_is_2x3_literal():
    a, b, c = 5 / 12, 1 / 4, 1 / 3
    expected = np.array(
        [
            [a, b, 0, c, 0, 0],
            [b, b, b, 0, b, 0],
            [0, b, a, 0, 0, c],
            [c, 0, 0, a, b, 0],
            [0, b, 0, b, b, b],
            [0, 0, c, 0, b, a],
        ]
    )
    np.testing.assert_allclose(mesh_grid_2d(6).weights, expected, atol=1e-15)


def test_mesh_grid_2d_prime_is_a_line():
    topo = mesh_grid_2d(7)
    for r in range(7):
        assert topo.out_neighbors(r) == tuple(j for j in (r - 1, r + 1) if 0 <= j < 7)
    np.testing.assert_allclose(topo.weights, reference_grid(1, 7), atol=1e-15)


@pytest.mark.parametrize(("size", "shape"), [(6, (3, 2)), (8, (4, 2)), (12, [2, 6]), (5, (5, 1))])
def test_mesh_grid_2d_explicit_shape(size, shape):
    topo = mesh_grid_2d(size, shape=shape)
    np.testing.assert_allclose(topo.weights, reference_grid(*shape), atol=1e-15)


# --- star, ring, full -----------------------------------------------------------------------


@pytest.mark.parametrize("size", SIZES)
def test_star_matches_definition(size):
    for center in {0, size - 1, size // 2}:
        expected = np.zeros((size, size))
        for i in range(size):
            if i == center:
                expected[i, :] = 1.0 / size
                expected[:, i] = 1.0 / size
        for i in range(size):
            if i != center:
                expected[i, i] = 1.0 - 1.0 / size
        topo = star(size, center=center)
        np.testing.assert_allclose(topo.weights, expected, atol=1e-15)
        leaves = tuple(i for i in range(size) if i != center)
        assert topo.out_neighbors(center) == leaves


@pytest.mark.parametrize("size", SIZES)
def test_ring_styles_match_definition(size):
    for style, sends_to, weight in [
        ("bidirectional", (-1, 1), 1 / 3),
        ("left", (-1,), 1 / 2),
        ("right", (1,), 1 / 2),
    ]:
        expected = np.zeros((size, size))
        if size == 1:
            expected[0, 0] = 1.0
        elif size == 2:
            expected[:] = 0.5
        else:
            for i in range(size):
                expected[i, i] = weight
                for o in sends_to:
                    expected[i, (i + o) % size] = weight
        topo = ring(size, style)
        np.testing.assert_allclose(topo.weights, expected, atol=1e-15, err_msg=style)


def test_ring_left_and_right_directions():
    left, right = ring(5, "left"), ring(5, "right")
    assert left.out_neighbors(2) == (1,) and left.in_neighbors(2) == (3,)
    assert right.out_neighbors(2) == (3,) and right.in_neighbors(2) == (1,)
    assert ring(5).in_neighbors(0) == (1, 4)


@pytest.mark.parametrize("size", SIZES)
def test_fully_connected(size):
    topo = fully_connected(size)
    np.testing.assert_array_equal(topo.weights, np.full((size, size), 1.0 / size))
    assert topo.out_neighbors(0) == tuple(range(1, size))


# --- bad input ------------------------------------------------------------------------------

GENERATORS = [
    exponential,
    exponential_two,
    symmetric_exponential,
    mesh_grid_2d,
    star,
    ring,
    fully_connected,
]


@pytest.mark.parametrize("generator", GENERATORS, ids=lambda g: g.__name__)
@pytest.mark.parametrize(
    ("size", "error"),
    [
        (True, TypeError),
        (2.0, TypeError),
        ("4", TypeError),
        (None, TypeError),
        (0, ValueError),
        (-3, ValueError),
    ],
)
def test_generators_reject_bad_size(generator, size, error):
    with pytest.raises(error, match="size"):
        generator(size)


@pytest.mark.parametrize("generator", [exponential, symmetric_exponential])
@pytest.mark.parametrize(
    ("base", "error"), [(1, ValueError), (0, ValueError), (2.0, TypeError), (False, TypeError)]
)
def test_generators_reject_bad_base(generator, base, error):
    with pytest.raises(error, match="base"):
        generator(8, base)


def test_numpy_integers_are_accepted():
    assert exponential(np.int64(8), base=np.int32(2)) == exponential(8)


@pytest.mark.parametrize("style", ["up", "Left", 0, 1, None])
def test_ring_rejects_bad_style(style):
    with pytest.raises(ValueError, match=r"style.*bidirectional.*left.*right"):
        ring(5, style)


@pytest.mark.parametrize(("center", "error"), [(5, ValueError), (-1, ValueError), (1.0, TypeError)])
def test_star_rejects_bad_center(center, error):
    with pytest.raises(error, match="center"):
        star(5, center)


@pytest.mark.parametrize(
    ("shape", "error"),
    [
        ((2, 2), ValueError),
        ((2, 3.0), TypeError),
        ("23", TypeError),
        ((6,), TypeError),
        ((0, 6), ValueError),
        (6, TypeError),
    ],
)
def test_mesh_grid_2d_rejects_bad_shape(shape, error):
    with pytest.raises(error, match="shape"):
        mesh_grid_2d(6, shape=shape)
