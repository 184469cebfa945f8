"""Posted rounds (transport.posted) of the allreduce and neighbour communicators."""

import numpy as np
import pytest
import torch

import gossamer
from gossamer import communicators
from gossamer import topology as topo
from gossamer.errors import PeerError
from gossamer.testing import run_distributed
from gossamer.transport import posted
from oracle import data, mix

# Buckets that are posted (float32, float64; the last one travels in chunks between
# machines) and one that takes the communication thread (float16).
LAYOUT = [
    ((4, 3), torch.float32),
    ((7,), torch.float64),
    ((5,), torch.float16),
    ((300_000,), torch.float32),
]
POSTED = [12, 7, 300_000]
# One machine per rank: the two directions of a pair travel on two groups.
MACHINES = {"one machine": {}, "a machine each": {"GOSSAMER_NODES_PER_MACHINE": "1"}}
ROUNDS = 3


def _inputs(rank, round_):
    return [data(rank, shape, dtype, seed=round_).flatten() for shape, dtype in LAYOUT]


def _rounds(in_place):
    """ROUNDS rounds over LAYOUT; the averages, whether inputs changed, and the checks made."""
    checks = []
    check_same_call = posted.check_same_call
    posted.check_same_call = lambda *a, **k: checks.append(a[1].numel()) or check_same_call(*a, **k)
    try:
        comm = communicators.Allreduce(in_place=in_place)
        results, untouched = [], []
        for r in range(ROUNDS):
            comm.next_round()
            flats = _inputs(gossamer.rank(), r)
            before = [f.clone() for f in flats]
            pending = [comm.start(f, i) for i, f in enumerate(flats)]
            got = [p.wait().clone() for p in pending]
            results.append(got)
            untouched.append([torch.equal(f, b) for f, b in zip(flats, before, strict=True)])
        return results, untouched, checks
    finally:
        posted.check_same_call = check_same_call


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("in_place", [False, True])
def test_rounds_average_like_the_mean_computed_in_one_process(world_size, in_place):
    out = run_distributed(_rounds, world_size, args=(in_place,))
    for results, untouched, checks in out:
        for r, got in enumerate(results):
            inputs = [_inputs(k, r) for k in range(world_size)]
            for i, (_, dtype) in enumerate(LAYOUT):
                mean = sum(x[i].double() for x in inputs) / world_size
                torch.testing.assert_close(got[i].double(), mean, rtol=1e-3, atol=1e-3)
                assert got[i].dtype == dtype
        # Posted buckets: in place only when asked; float16 goes through ops (out of place).
        assert untouched == [[not in_place, not in_place, True, not in_place]] * ROUNDS
        # The layout of each posted bucket is checked in its first round only.
        assert checks == POSTED


def _mismatched():
    comm = communicators.Allreduce()
    comm.next_round()
    n = 6 if gossamer.rank() == 1 else 5
    with pytest.raises(PeerError) as err:
        comm.start(torch.ones(n), 0).wait()
    return str(err.value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_with_another_bucket_layout_is_named_on_every_rank(world_size):
    for text in run_distributed(_mismatched, world_size):
        assert "mismatched call" in text and "rank 1" in text


def test_in_place_must_be_a_bool():
    with pytest.raises(TypeError, match="in_place must be a bool; got 1"):
        communicators.Allreduce(in_place=1)


# ---------------------------------------------------------------- neighbour rounds
def _ring_steps(rank, n):
    """Send to rank+1 scaled by 2, receive from rank-1 with weight 1/4, keep 1/2."""
    step = topo.Step(
        ((rank + 1) % n,), ((rank - 1) % n,), 0.5, {(rank - 1) % n: 0.25}, {(rank + 1) % n: 2.0}
    )
    while True:
        yield step


def _schedule(kind, rank, n):
    if kind == "one-peer":
        return topo.one_peer_exponential(topo.exponential_two(n), rank)
    return _ring_steps(rank, n) if kind == "scaled-ring" else None


def _neighbour_rounds(kind):
    checks = []
    check_same_call = posted.check_same_call
    posted.check_same_call = lambda *a, **k: checks.append(a[1].numel()) or check_same_call(*a, **k)
    try:
        rank, n = gossamer.rank(), gossamer.size()
        schedule = _schedule(kind, rank, n)
        graph = topo.exponential_two(n) if schedule is None else None
        comm = communicators.NeighborAllreduce(graph, schedule=schedule)
        results = []
        for r in range(ROUNDS):
            comm.next_round()
            pending = [comm.start(f, i) for i, f in enumerate(_inputs(rank, r))]
            results.append([p.wait().clone() for p in pending])
        return results, checks
    finally:
        posted.check_same_call = check_same_call


def _matrix(kind, n, schedules):
    """This round's full weight matrix: W[j, i] is what rank i takes of rank j's value."""
    if kind == "static":
        return np.asarray(topo.exponential_two(n).weights, dtype=np.float64)
    steps = [next(s) for s in schedules]
    w = np.diag([s.self_weight for s in steps])
    for i, step in enumerate(steps):
        for j, weight in step.src_weights.items():
            w[j, i] += weight * steps[j].dst_weights[i]
    return w


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("kind", ["one-peer", "scaled-ring", "static"])
@pytest.mark.parametrize("machines", MACHINES)
def test_neighbour_rounds_mix_like_the_weight_matrix_in_one_process(world_size, kind, machines):
    out = run_distributed(_neighbour_rounds, world_size, args=(kind,), env=MACHINES[machines])
    schedules = [_schedule(kind, k, world_size) for k in range(world_size)]
    for r in range(ROUNDS):
        w = _matrix(kind, world_size, schedules)
        inputs = [_inputs(k, r) for k in range(world_size)]
        for i, (_, dtype) in enumerate(LAYOUT):
            want = mix(w, [x[i] for x in inputs])
            for k, (results, _) in enumerate(out):
                got = results[r][i]
                assert got.dtype == dtype
                torch.testing.assert_close(got.double(), want[k], rtol=1e-3, atol=1e-3)
    for _, checks in out:
        assert checks == POSTED  # the posted buckets' layouts, in their first round only
