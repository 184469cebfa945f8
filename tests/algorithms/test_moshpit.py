"""MoshpitAverage: exact global mean in d rounds; with a dead rank, the survivors' mean.

References are computed here, independently of the communicator: grid coordinates from
divmod, group means from those coordinates, and the rounds after a death simulated in numpy.
"""

import math
import os
import signal
import warnings

import pytest
import torch

import gossamer
from gossamer import optim
from gossamer.communicators import (
    COMMUNICATORS,
    MoshpitAverage,
    grid_groups,
    near_cubic_grid,
)
from gossamer.testing import run_distributed
from oracle import data
from problems import least_squares_optimum, train_least_squares

# --- one process: grids and groups ----------------------------------------------------


def _coords(rank, grid):
    """Row-major coordinates, the last fastest (written out with divmod)."""
    out = []
    for side in reversed(grid):
        rank, c = divmod(rank, side)
        out.append(c)
    return tuple(reversed(out))


def _group(rank, grid, dim, live=None):
    """The ranks sharing every coordinate of ``rank`` but ``dim`` (and live)."""
    mine = _coords(rank, grid)
    return [
        s
        for s in range(math.prod(grid))
        if all(
            a == b for k, (a, b) in enumerate(zip(_coords(s, grid), mine, strict=True)) if k != dim
        )
        and (live is None or s in live)
    ]


@pytest.mark.parametrize("grid", [(2, 2), (2, 3), (3, 2), (2, 2, 2), (4, 1, 3), (5,)])
def test_grid_groups_match_the_coordinates(grid):
    for dim in range(len(grid)):
        groups = grid_groups(grid, dim)
        assert len(groups) == math.prod(grid) // grid[dim]
        for group in groups:
            for r in group:
                assert list(group) == _group(r, grid, dim)


@pytest.mark.parametrize(
    ("size", "expected"),
    [
        (1, (1,)),
        (2, (2,)),
        (4, (2, 2)),
        (6, (2, 3)),
        (7, (7,)),
        (8, (2, 2, 2)),
        (12, (2, 2, 3)),
        (16, (2, 2, 4)),
        (36, (3, 3, 4)),
        (64, (4, 4, 4)),
        (1000, (10, 10, 10)),
    ],
)
def test_near_cubic_grid(size, expected):
    assert near_cubic_grid(size) == expected


def _all_factorisations(size, ndim):
    """Every ordered tuple of ``ndim`` sides >= 2 with product ``size`` (brute force)."""
    if ndim == 1:
        return [(size,)] if size >= 2 else []
    return [
        (f, *rest)
        for f in range(2, size + 1)
        if size % f == 0
        for rest in _all_factorisations(size // f, ndim - 1)
    ]


def test_near_cubic_grid_is_the_most_balanced_factorisation():
    for size, ndim in [(24, 2), (24, 3), (60, 3), (96, 4), (30, 2), (210, 3)]:
        grid = near_cubic_grid(size, ndim)
        assert math.prod(grid) == size and len(grid) == ndim and min(grid) >= 2
        assert list(grid) == sorted(grid)
        assert max(grid) == min(max(g) for g in _all_factorisations(size, ndim))


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: near_cubic_grid(0), ValueError, "size must be >= 1; got 0"),
        (lambda: near_cubic_grid(8, 4), ValueError, r"ndim must be at most 3 for size 8 .* got 4"),
        (lambda: near_cubic_grid(8.0), TypeError, "size must be an int; got 8.0"),
        (lambda: grid_groups((2, 2), 2), ValueError, r"dim must be in \[0, 2\) .* got 2"),
        (lambda: MoshpitAverage((2, 0)), ValueError, "grid entries must be >= 1; got 0"),
        (lambda: MoshpitAverage("22"), TypeError, "grid must be a non-empty sequence"),
        (lambda: MoshpitAverage(live=[-1]), ValueError, r"live must be ranks in >= 0; got \[-1\]"),
    ],
)
def test_argument_errors_name_the_argument_and_value(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_state_dict_holds_the_round_counter():
    comm = MoshpitAverage((2, 3))
    assert COMMUNICATORS["moshpit"] is MoshpitAverage
    for _ in range(3):
        comm.next_round()
    assert comm.state_dict() == {"rounds": 3}
    assert comm.dimension == 0  # rounds 1, 2, 3 used dimensions 0, 1, 0
    fresh = MoshpitAverage((2, 3))
    fresh.load_state_dict(comm.state_dict())
    fresh.next_round()
    assert (fresh.rounds, fresh.dimension) == (4, 1)


# --- distributed ----------------------------------------------------------------------


def _rounds(grid, count, dead_after=None, dead=(), inputs_seed=0):
    """Run ``count`` rounds; before round ``dead_after`` every rank marks ``dead`` dead.

    Returns this rank's value after every round (its input first).
    """
    x = data(gossamer.rank(), seed=inputs_seed, dtype=torch.float64)
    comm = MoshpitAverage(grid)
    comm.bind([])
    history = [x]
    for t in range(count):
        if t == dead_after:
            comm.mark_dead(dead)
        comm.next_round()
        pending = comm.start(x)
        x = x if pending is None else pending.wait()
        history.append(x)
    comm.close()
    return history


def _inputs(size, seed=0):
    return [data(r, seed=seed, dtype=torch.float64) for r in range(size)]


def _simulate(xs, grid, rounds, live_from):
    """Numpy oracle: rounds of live-only group averaging; ``live_from(t)`` is round t's live set."""
    xs = [x.clone() for x in xs]
    for t in range(rounds):
        live, dim = live_from(t), t % len(grid)
        xs = [
            torch.stack([xs[s] for s in _group(r, grid, dim, live)]).mean(0) if r in live else xs[r]
            for r in range(len(xs))
        ]
    return xs


@pytest.mark.parametrize("grid", [(2, 2), (2, 3), (2, 2, 2)], ids=["4-2x2", "6-2x3", "8-2x2x2"])
def test_exact_global_mean_after_d_rounds(grid):
    size, d = math.prod(grid), len(grid)
    histories = run_distributed(_rounds, size, args=(grid, 2 * d), timeout=120)
    xs = _inputs(size)
    mean = torch.stack(xs).mean(0)
    for r, history in enumerate(histories):
        # After rounds 0..k-1: the mean over the slab sharing coordinates k.. with r.
        for k in range(1, d):
            slab = [s for s in range(size) if _coords(s, grid)[k:] == _coords(r, grid)[k:]]
            want = torch.stack([xs[s] for s in slab]).mean(0)
            torch.testing.assert_close(history[k], want, rtol=0, atol=1e-12)
        for t in range(d, 2 * d + 1):
            torch.testing.assert_close(history[t], mean, rtol=0, atol=1e-12)


def _default_grid(count):
    comm = MoshpitAverage()
    comm.bind([])
    x = data(gossamer.rank(), dtype=torch.float64)
    for _ in range(count):
        comm.next_round()
        x = comm.start(x).wait()
    return comm.grid, x


def test_default_grid_is_near_cubic_and_averages():
    got = run_distributed(_default_grid, 4, args=(2,), timeout=120)
    mean = torch.stack(_inputs(4)).mean(0)
    for grid, x in got:
        assert grid == (2, 2)
        torch.testing.assert_close(x, mean, rtol=0, atol=1e-12)


# A death mid-way, and why the survivors' mean is the reference.
#
# Each round averages within disjoint groups of live ranks, and an average keeps its group's
# sum, so every round keeps the sum over the live ranks. From the round a rank is marked dead
# on, the survivors' average therefore stays the mean of the survivors' values at that
# moment (the dead rank's earlier contribution stays mixed in): that is the reference. It is
# exact after every further round, two included.
#
# Each survivor's own value does not reach it in two rounds: on the 2x2 grid without rank 3,
# rank 2 is alone along dimension 1 and rank 1 alone along dimension 0, so after two rounds
# one of them has not heard from everyone. No grid construction fixes that for 3 survivors
# of 2x2; the values converge geometrically instead. So the test checks (1) the survivors'
# average against the reference after two more rounds, to 1e-6; (2) every value after every
# round against the numpy oracle of live-only group averaging; (3) every value within 1e-6
# of the reference after enough rounds (the oracle's count).
DEATHS = [
    # (grid, rank marked dead, before round, extra rounds until every value is within 1e-6)
    ((2, 2), 3, 1, 40),
    ((2, 3), 4, 1, 30),
    ((2, 2, 2), 5, 2, 30),
]


@pytest.mark.parametrize(
    ("grid", "dead", "before", "extra"), DEATHS, ids=["4-2x2", "6-2x3", "8-2x2x2"]
)
def test_survivors_converge_to_their_mean_after_a_death(grid, dead, before, extra):
    size = math.prod(grid)
    total = before + extra
    histories = run_distributed(_rounds, size, args=(grid, total, before, [dead]), timeout=180)
    xs = _inputs(size)
    everyone, survivors = set(range(size)), set(range(size)) - {dead}
    live_from = lambda t: everyone if t < before else survivors  # noqa: E731
    at_death = _simulate(xs, grid, before, live_from)
    reference = torch.stack([at_death[s] for s in survivors]).mean(0)
    for t in range(total + 1):
        want = _simulate(xs, grid, t, live_from)
        for r in range(size):
            torch.testing.assert_close(histories[r][t], want[r], rtol=0, atol=1e-12)
        if t >= before:
            average = torch.stack([histories[s][t] for s in survivors]).mean(0)
            torch.testing.assert_close(average, reference, rtol=0, atol=1e-6)
    # The dead rank takes no part: its value is frozen from its death on.
    for t in range(before, total + 1):
        assert torch.equal(histories[dead][t], histories[dead][before])

    # Two rounds after the death the spread is smaller; after ``extra`` it is below 1e-6.
    def spread(t):
        return max((histories[s][t] - reference).abs().max().item() for s in survivors)

    assert spread(before + 2) < spread(before)
    assert spread(total) <= 1e-6


def _killed_rounds(grid, count, victim, before):
    """Elastic rounds; ``victim`` SIGKILLs itself before round ``before``."""
    x = data(gossamer.rank(), dtype=torch.float64)
    comm = MoshpitAverage(grid, elastic=True)
    comm.bind([])
    history = [x]
    for t in range(count):
        if t == before and gossamer.rank() == victim:
            os.kill(os.getpid(), signal.SIGKILL)
        comm.next_round()
        x = comm.start(x).wait()
        history.append(x)
    return history, sorted(comm.live)


@pytest.mark.parametrize(("grid", "dead", "before", "extra"), DEATHS[::2], ids=["4-2x2", "8-2x2x2"])
def test_elastic_survivors_of_a_killed_rank_follow_the_marked_death(grid, dead, before, extra):
    """A real SIGKILL instead of ``mark_dead``: the same values, round by round."""
    size = math.prod(grid)
    total = before + extra
    got = run_distributed(
        _killed_rounds, size, args=(grid, total, dead, before), dies=[dead], timeout=180
    )
    xs = _inputs(size)
    survivors = sorted(set(range(size)) - {dead})
    live_from = lambda t: set(range(size)) if t < before else set(survivors)  # noqa: E731
    at_death = _simulate(xs, grid, before, live_from)
    reference = torch.stack([at_death[s] for s in survivors]).mean(0)
    for r in survivors:
        history, live = got[r]
        assert live == survivors
        for t in range(total + 1):
            torch.testing.assert_close(history[t], _simulate(xs, grid, t, live_from)[r])
    for t in (before + 1, before + 2):
        average = torch.stack([got[s][0][t] for s in survivors]).mean(0)
        torch.testing.assert_close(average, reference, rtol=0, atol=1e-6)
    assert max((got[s][0][total] - reference).abs().max().item() for s in survivors) <= 1e-6


def _live_set_errors():
    comm = MoshpitAverage((2, 2))
    out = {}
    for label, call in {
        "grid": lambda: MoshpitAverage((2, 3)).bind([]),
        "bad live": lambda: MoshpitAverage((2, 2), live=[0, 9]).bind([]),
        "start before bind": lambda: (comm.next_round(), comm.start(torch.zeros(2))),
    }.items():
        try:
            call()
            out[label] = None
        except (ValueError, RuntimeError) as err:
            out[label] = str(err)
    comm.bind([])
    for label, call in {
        "mark": lambda: comm.mark_dead(4),
        "all": lambda: comm.mark_dead(range(4)),
    }.items():
        try:
            call()
            out[label] = None
        except ValueError as err:
            out[label] = str(err)
    comm.mark_dead(3)
    try:
        comm.set_live([0, 1, 2, 3])
        out["back"] = None
    except ValueError as err:
        out["back"] = str(err)
    comm.mark_dead([1, 2])
    out["live"] = sorted(comm.live)
    # 0 and 3 of a 2x2 grid share no grid line: they can never mix.
    split = MoshpitAverage((2, 2))
    split.bind([])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        split.mark_dead([1, 2])
    out["split"] = [str(w.message) for w in caught]
    return out


def test_live_set_errors_and_a_split_warning():
    got = run_distributed(_live_set_errors, 4, timeout=120)[0]
    assert "prod((2, 3)) = 6, world size 4" in got["grid"]
    assert "live must be ranks in [0, 4); got [9]" in got["bad live"]
    assert "call bind() before start()" in got["start before bind"]
    assert "ranks must be ranks in [0, 4); got [4]" in got["mark"]
    assert "at least one rank live" in got["all"]
    assert "names ranks that were dead: [3]" in got["back"]
    assert len(got["split"]) == 1 and "[[0], [3]]" in got["split"][0]
    assert got["live"] == [0]


def _train(steps):
    def make(sgd, model):
        return optim.AdaptWithCombine(sgd, model, communicator=MoshpitAverage())

    model, opt = train_least_squares(make, steps, 0.3, 10)
    opt.synchronize()
    return model.weight.detach().squeeze(0).clone(), opt.state_dict()["communication"]


def test_adapt_with_combine_over_moshpit_reaches_the_optimum():
    got = run_distributed(_train, 4, args=(300,), timeout=240)
    optimum = least_squares_optimum(4)
    for weight, state in got:
        assert (weight - optimum).norm() / optimum.norm() < 1e-3
        assert state["rounds"] == 300
