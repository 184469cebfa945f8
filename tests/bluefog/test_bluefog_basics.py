"""bf.init, sizes, the default topology as a networkx graph, machine topology, flags."""

import logging
import math

import networkx as nx
import numpy as np
import pytest
import torch
import torch.distributed as dist

import gossamer
import gossamer.bluefog as bf
from gossamer import context
from gossamer import topology as topo
from gossamer.testing import run_distributed


def _edges(graph):
    return sorted((i, j, round(d["weight"], 12)) for i, j, d in graph.edges(data=True))


def _init_and_sizes():
    bf.init()
    bf.init()  # idempotent
    first = bf.load_topology()
    ring = bf.RingGraph(bf.size(), connect_style=2)
    assert bf.set_topology(ring) is True
    # An equivalent graph (sizes 1 and 2) leaves the current one in place.
    assert (bf.load_topology() is ring) == (bf.size() > 2)
    ring_neighbors = (bf.in_neighbor_ranks(), bf.out_neighbor_ranks())
    bf.init()  # re-applies the default exponential graph
    return {
        "sizes": (bf.size(), bf.rank(), bf.local_size(), bf.local_rank()),
        "machines": (bf.machine_size(), bf.machine_rank(), bf.is_homogeneous()),
        "first": _edges(first),
        "again": _edges(bf.load_topology()),
        "weighted": bf.is_topo_weighted(),
        "neighbors": (bf.in_neighbor_ranks(), bf.out_neighbor_ranks()),
        "ring_neighbors": ring_neighbors,
    }


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_init_sizes_and_default_topology(world_size):
    n = world_size
    hops = [2**i for i in range(math.ceil(math.log2(n)))] if n > 1 else []
    weight = round(1 / (len(hops) + 1), 12)
    expected_edges = sorted({(i, (i + h) % n, weight) for i in range(n) for h in [0, *hops]})
    for rank, got in enumerate(run_distributed(_init_and_sizes, world_size)):
        assert got["sizes"] == (n, rank, n, rank)
        assert got["machines"] == (1, 0, True)
        assert got["first"] == got["again"] == expected_edges
        assert got["weighted"] is False
        assert got["neighbors"] == (
            sorted({(rank - h) % n for h in hops}),
            sorted({(rank + h) % n for h in hops}),
        )
        ring = ([(rank - 1) % n], [(rank + 1) % n]) if n > 1 else ([], [])
        assert got["ring_neighbors"] == ring


class _Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.messages = []

    def emit(self, record):
        self.messages.append((record.levelname, record.getMessage()))


def _set_topology_rules():
    bf.init()
    n = bf.size()
    out = {}
    for bad in (nx.Graph(bf.RingGraph(n)), np.eye(n), bf.RingGraph(n + 1)):
        try:
            bf.set_topology(bad)
        except TypeError as err:
            out.setdefault("type_errors", []).append(str(err))
    # Equivalent: True, is_weighted unchanged.
    star = bf.StarGraph(n)
    assert bf.set_topology(star) and not bf.is_topo_weighted()
    assert bf.set_topology(bf.StarGraph(n), is_weighted=True)
    out["weighted_after_equivalent"] = bf.is_topo_weighted()
    assert bf.load_topology() is star
    # The core default is what BlueFog mixes with: uniform weights when not weighted.
    out["core_unweighted"] = gossamer.get_topology().weights.copy()
    skewed = bf.StarGraph(n)
    skewed[1][1]["weight"] = 0.25
    assert bf.set_topology(skewed, is_weighted=True)
    out["core_weighted"] = gossamer.get_topology().weights.copy()
    out["weighted"] = bf.is_topo_weighted()
    # Refused while a window exists, with an error logged.
    records = _Records()
    logging.getLogger("gossamer.bluefog").addHandler(records)
    try:
        assert bf.win_create(torch.zeros(2), "frozen")
        out["while_window"] = bf.set_topology(bf.RingGraph(n))
        out["init_while_window"] = bf.load_topology() is not None
        out["same_while_window"] = bf.set_topology(bf.load_topology().copy())
        assert bf.win_free("frozen")
        out["after_free"] = bf.set_topology(bf.RingGraph(n))
    finally:
        logging.getLogger("gossamer.bluefog").removeHandler(records)
        bf.win_free()
    out["logged"] = records.messages
    # topology_fn, and a function returning None (the default graph).
    bf.init(lambda size: bf.FullyConnectedGraph(size), is_weighted=True)
    out["fn"] = (_edges(bf.load_topology()), bf.is_topo_weighted())
    bf.init(lambda size: None)
    out["fn_none"] = _edges(bf.load_topology()) == _edges(bf.ExponentialGraph(n))
    # A default set through gossamer's own API shows through.
    gossamer.set_topology(topo.ring(n, style="left"))
    out["core_set"] = (_edges(bf.load_topology()), bf.is_topo_weighted(), bf.in_neighbor_ranks())
    bf.init()
    return out


def test_set_topology_rules():
    n = 4
    for rank, got in enumerate(run_distributed(_set_topology_rules, n)):
        assert len(got["type_errors"]) == 3
        assert "networkx.DiGraph" in got["type_errors"][0]
        assert "4 nodes" in got["type_errors"][2]
        assert got["weighted_after_equivalent"] is False
        # uniform weights on the star: the centre takes 1/4 of everyone, a leaf 1/2 of two
        uniform = np.zeros((n, n))
        uniform[:, 0] = 1 / n
        for leaf in range(1, n):
            uniform[0, leaf] = uniform[leaf, leaf] = 1 / 2
        np.testing.assert_allclose(got["core_unweighted"], uniform)
        skewed = nx.to_numpy_array(bf.StarGraph(n))
        skewed[1, 1] = 0.25
        np.testing.assert_allclose(got["core_weighted"], skewed)
        assert got["weighted"] is True
        assert got["while_window"] is False
        assert got["same_while_window"] is True  # equivalent: nothing to change
        assert got["after_free"] is True
        errors = [m for level, m in got["logged"] if level == "ERROR"]
        assert len(errors) == 1 and "frozen" in errors[0] and "win_free" in errors[0]
        assert got["fn"] == (_edges(bf.FullyConnectedGraph(n)), True)
        assert got["fn_none"]
        edges, weighted, in_ranks = got["core_set"]
        assert edges == _edges(bf.RingGraph(n, connect_style=1)) and weighted is True
        assert in_ranks == [(rank + 1) % n]


def _machine_topology():
    bf.init()
    out = {"layout": (bf.machine_size(), bf.machine_rank(), bf.local_size(), bf.local_rank())}
    out["unset"] = (
        bf.load_machine_topology(),
        bf.in_neighbor_machine_ranks(),
        bf.out_neighbor_machine_ranks(),
    )
    try:
        bf.set_machine_topology(None)
    except ValueError as err:
        out["none"] = str(err)
    try:
        bf.set_machine_topology(bf.RingGraph(bf.size()))
    except TypeError as err:
        out["count"] = str(err)
    graph = bf.RingGraph(bf.machine_size(), connect_style=2)
    assert bf.set_machine_topology(graph)
    out["set"] = (
        bf.load_machine_topology() is graph,
        bf.is_machine_topo_weighted(),
        bf.in_neighbor_machine_ranks(),
        bf.out_neighbor_machine_ranks(),
    )
    gossamer.set_machine_topology(None)
    return out


def test_machine_topology():
    got = run_distributed(_machine_topology, 4, env={"GOSSAMER_NODES_PER_MACHINE": "2"})
    for rank, out in enumerate(got):
        machine = rank // 2
        assert out["layout"] == (2, machine, 2, rank % 2)
        assert out["unset"] == (None, [], [])
        assert "must be given" in out["none"]
        assert "2 nodes (one per machine)" in out["count"]
        assert out["set"] == (True, False, [1 - machine], [1 - machine])


def _flags_and_uninitialized():
    out = {
        "flags": (
            bf.mpi_threads_supported(),
            bf.unified_mpi_window_model_supported(),
            bf.nccl_built(),
            bf.suspend(),
            bf.resume(),
        )
    }
    bf.set_skip_negotiate_stage(True)
    out["skip"] = bf.get_skip_negotiate_stage()
    bf.set_skip_negotiate_stage(False)
    timeout = context.timeout()
    bf.shutdown()
    try:
        errors = []
        for fn in (
            bf.size,
            bf.rank,
            bf.local_size,
            bf.local_rank,
            bf.machine_size,
            bf.machine_rank,
        ):
            try:
                fn()
            except ValueError as err:
                errors.append(str(err))
        out["errors"] = errors
        out["uninitialized"] = (bf.load_topology(), bf.in_neighbor_ranks(), bf.is_topo_weighted())
    finally:
        gossamer.init(timeout=timeout)
    bf.init()
    out["back"] = bf.size()
    return out


def test_flags_and_calls_before_init():
    (got,) = run_distributed(_flags_and_uninitialized, 1)
    nccl = torch.cuda.is_available() and dist.is_nccl_available()
    assert got["flags"] == (True, True, nccl, None, None)
    assert got["skip"] is True
    assert got["errors"] == ["BlueFog has not been initialized; use bf.init()."] * 6
    assert got["uninitialized"] == (None, [], False)
    assert got["back"] == 1
