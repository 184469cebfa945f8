"""The Topology value type: neighbours, weights, networkx, equality, validation, drawing."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import networkx as nx
import numpy as np
import pytest

import gossamer.topology as topology_pkg
from gossamer.errors import TopologyError
from gossamer.topology import (
    Topology,
    draw,
    exponential,
    fully_connected,
    mesh_grid_2d,
    ring,
    star,
    symmetric_exponential,
)

# 0 -> 1 -> 2 -> 0 plus 0 -> 2; rank 1 has no self-loop.
CYCLE = np.array(
    [
        [0.5, 0.6, 0.2],
        [0.0, 0.0, 0.3],
        [0.5, 0.0, 0.5],
    ]
)


def test_neighbors_follow_the_column_convention():
    topo = Topology(CYCLE)
    assert topo.size == 3
    assert topo.out_neighbors(0) == (1, 2)
    assert topo.in_neighbors(0) == (2,)
    assert topo.in_neighbors(2) == (0, 1)
    assert topo.out_neighbors(1) == (2,)
    assert topo.in_neighbors(1) == (0,)
    assert (topo.in_degree(2), topo.out_degree(2), topo.out_degree(0)) == (2, 1, 2)


def test_recv_and_send_weights():
    topo = Topology(CYCLE)
    assert topo.recv_weights(2) == (0.5, {0: 0.2, 1: 0.3})
    assert topo.send_weights(0) == (0.5, {1: 0.6, 2: 0.2})
    assert topo.recv_weights(1) == (0.0, {0: 0.6})
    assert topo.send_weights(1) == (0.0, {2: 0.3})
    self_weight, weights = topo.recv_weights(0)
    assert type(self_weight) is float and all(type(k) is int for k in weights)


def test_adjacency_has_no_diagonal():
    expected = np.array([[0, 1, 1], [0, 0, 1], [1, 0, 0]], dtype=bool)
    np.testing.assert_array_equal(Topology(CYCLE).adjacency, expected)


def test_exponential_recv_weights():
    topo = exponential(8)
    for r in range(8):
        assert topo.recv_weights(r) == (0.25, {(r - o) % 8: 0.25 for o in (1, 2, 4)})
        assert topo.send_weights(r) == (0.25, {(r + o) % 8: 0.25 for o in (1, 2, 4)})


def test_to_networkx_edges_and_weights():
    graph = Topology(CYCLE).to_networkx()
    assert isinstance(graph, nx.DiGraph)
    assert sorted(graph.nodes) == [0, 1, 2]
    expected = {(0, 0): 0.5, (0, 1): 0.6, (0, 2): 0.2, (1, 2): 0.3, (2, 0): 0.5, (2, 2): 0.5}
    assert {(u, v): d["weight"] for u, v, d in graph.edges(data=True)} == expected


@pytest.mark.parametrize(
    "topo",
    [exponential(9), ring(6, "left"), star(5), mesh_grid_2d(6), fully_connected(1)],
    ids=repr,
)
def test_networkx_round_trip(topo):
    back = Topology.from_networkx(topo.to_networkx(), name="back")
    assert back == topo
    assert back.name == "back"
    np.testing.assert_array_equal(nx.to_numpy_array(topo.to_networkx()), topo.weights)


def test_from_networkx_undirected_and_unweighted():
    graph = nx.path_graph(3)
    graph[0][1]["weight"] = 0.7
    expected_weighted = np.array([[0, 0.7, 0], [0.7, 0, 1.0], [0, 1.0, 0]])
    np.testing.assert_array_equal(Topology.from_networkx(graph).weights, expected_weighted)
    expected_plain = np.array([[0, 1.0, 0], [1.0, 0, 1.0], [0, 1.0, 0]])
    plain = Topology.from_networkx(graph, weighted=False)
    np.testing.assert_array_equal(plain.weights, expected_plain)


def test_from_networkx_node_order_does_not_matter():
    graph = nx.DiGraph()
    graph.add_nodes_from([2, 0, 1])
    graph.add_edge(2, 0, weight=0.5)
    assert Topology.from_networkx(graph).in_neighbors(0) == (2,)


@pytest.mark.parametrize(
    ("graph", "error", "match"),
    [
        (nx.DiGraph([(1, 2), (2, 3)]), TopologyError, "nodes"),
        (nx.DiGraph([(0, "a")]), TopologyError, "nodes"),
        (nx.DiGraph(), TopologyError, "graph"),
        (nx.MultiDiGraph([(0, 1)]), TypeError, "graph"),
        (np.eye(2), TypeError, "graph"),
        (nx.DiGraph([(0, 1, {"weight": -1.0})]), TopologyError, "non-negative"),
    ],
)
def test_from_networkx_rejects_bad_graphs(graph, error, match):
    with pytest.raises(error, match=match):
        Topology.from_networkx(graph)


def test_equality_ignores_name_and_hash_is_consistent():
    a = Topology(np.full((3, 3), 1 / 3), name="a")
    b = fully_connected(3)
    assert a == b and hash(a) == hash(b)
    assert len({a, b, ring(3)}) == 1  # ring(3) is all 1/3 too.
    assert a != fully_connected(4)
    assert a != ring(4)
    assert a != "not a topology"
    negative_zero = Topology(np.array([[1.0, -0.0], [0.0, 1.0]]))
    assert negative_zero == Topology(np.eye(2)) and hash(negative_zero) == hash(Topology(np.eye(2)))


def test_repr_is_short():
    assert repr(exponential(8)) == "Topology(name='exponential(8, base=2)', size=8)"


def test_weights_are_an_immutable_copy():
    source = np.eye(2)
    topo = Topology(source)
    source[0, 0] = 5.0
    assert topo.weights[0, 0] == 1.0
    assert topo.weights.dtype == np.float64
    with pytest.raises(ValueError, match="read-only"):
        topo.weights[0, 0] = 2.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.weights = np.eye(3)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        topo.name = "other"  # type: ignore[misc]


def test_integer_and_list_weights_are_converted():
    topo = Topology([[1, 0], [0, 1]])
    assert topo.weights.dtype == np.float64 and topo == Topology(np.eye(2))


@pytest.mark.parametrize(
    ("weights", "error", "match"),
    [
        (np.ones((2, 3)), TopologyError, r"weights.*square.*\(2, 3\)"),
        (np.ones(3), TopologyError, r"weights.*square.*\(3,\)"),
        (np.ones((2, 2, 2)), TopologyError, "weights.*square"),
        (np.zeros((0, 0)), TopologyError, "weights.*at least one"),
        (5.0, TopologyError, "weights.*square"),
        ([[1.0, np.nan], [0.0, 1.0]], TopologyError, r"weights.*finite.*nan.*\(0, 1\)"),
        ([[1.0, 0.0], [np.inf, 1.0]], TopologyError, r"weights.*finite.*inf.*\(1, 0\)"),
        ([[1.0, -0.5], [0.0, 1.0]], TopologyError, r"weights.*non-negative.*-0.5.*\(0, 1\)"),
        ([["a", "b"], ["c", "d"]], TypeError, "weights"),
        ([[1.0, 2.0], [3.0]], TypeError, "weights"),
        (None, TypeError, "weights"),
        ([[1.0, 0.5j], [0.0, 1.0]], TypeError, "weights must hold real numbers"),
    ],
)
def test_constructor_validation(weights, error, match):
    with pytest.raises(error, match=match):
        Topology(weights)


def test_topology_error_is_a_value_error():
    with pytest.raises(ValueError, match="weights"):
        Topology(np.ones(3))


def test_name_must_be_a_string():
    with pytest.raises(TypeError, match="name"):
        Topology(np.eye(2), name=3)  # type: ignore[arg-type]


METHODS = ["in_neighbors", "out_neighbors", "recv_weights", "send_weights"]
METHODS += ["in_degree", "out_degree"]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize(
    ("rank", "error", "match"),
    [
        (True, TypeError, "rank.*True"),
        (1.0, TypeError, "rank.*1.0"),
        ("0", TypeError, "rank"),
        (-1, ValueError, r"rank.*\[0, 4\).*-1"),
        (4, ValueError, r"rank.*size 4.*got 4"),
    ],
)
def test_rank_validation(method, rank, error, match):
    with pytest.raises(error, match=match):
        getattr(exponential(4), method)(rank)


def test_numpy_integer_rank_is_accepted():
    assert exponential(4).in_neighbors(np.int64(0)) == (2, 3)


def test_package_imports_only_numpy_networkx_matplotlib():
    allowed_third_party = {"numpy", "networkx", "matplotlib"}
    package_dir = Path(topology_pkg.__file__).parent
    for source in package_dir.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top == "gossamer":
                    assert name.startswith(("gossamer.topology", "gossamer.errors")), source
                else:
                    assert top in allowed_third_party or _is_stdlib(top), (source, name)


def _is_stdlib(name: str) -> bool:
    import sys

    return name in sys.stdlib_module_names


def test_public_names_are_exported_sorted():
    assert topology_pkg.__all__ == sorted(topology_pkg.__all__)
    for name in topology_pkg.__all__:
        assert getattr(topology_pkg, name).__doc__


# --- draw ------------------------------------------------------------------------------------

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("layout", ["circular", "spring", "shell"])
def test_draw_writes_png(tmp_path, layout):
    out = draw(symmetric_exponential(8), tmp_path / f"{layout}.png", layout=layout)
    assert isinstance(out, Path)
    assert out.read_bytes()[:8] == PNG_SIGNATURE


def test_draw_accepts_str_path_title_and_single_rank(tmp_path):
    out = draw(fully_connected(1), str(tmp_path / "one.png"), title="one rank")
    assert out == tmp_path / "one.png"
    assert out.read_bytes().startswith(PNG_SIGNATURE)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"topology": np.eye(2)}, TypeError, "topology"),
        ({"path": 3}, TypeError, "path"),
        ({"layout": "grid"}, ValueError, "layout.*circular"),
        ({"title": 5}, TypeError, "title"),
    ],
)
def test_draw_rejects_bad_arguments(tmp_path, kwargs, error, match):
    arguments = {"topology": ring(4), "path": tmp_path / "x.png"} | kwargs
    topology, path = arguments.pop("topology"), arguments.pop("path")
    with pytest.raises(error, match=match):
        draw(topology, path, **arguments)
    assert not (tmp_path / "x.png").exists()
