"""The Allreduce communicator's posted rounds (transport.posted): values, layout check, errors."""

import pytest
import torch

import gossamer
from gossamer import communicators
from gossamer.errors import PeerError
from gossamer.testing import run_distributed
from gossamer.transport import posted
from oracle import data

# Two buckets that are posted (float32, float64) and one that takes ops.allreduce (float16).
LAYOUT = [((4, 3), torch.float32), ((7,), torch.float64), ((5,), torch.float16)]
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
        assert untouched == [[not in_place, not in_place, True]] * ROUNDS
        # The layout of each posted bucket is checked in its first round only.
        assert checks == [12, 7]


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
