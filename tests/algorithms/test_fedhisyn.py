"""FedHiSyn: grouping by speed, the ring-in-group / global-average schedule, calibration.

References are written out in one process: groups from sorting times by hand, the ring
inside each group from the ring's uniform weights, and each round as K_g local SGD steps per
group with the ring average after each step and the global average after the last.
"""

import time

import numpy as np
import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.optim import FedHiSyn, group_by_speed, grouped_ring
from gossamer.testing import run_distributed
from problems import least_squares_data, least_squares_loss, linear_model

# --- one process --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("times", "k", "want"),
    [
        ([1.0, 2.1, 0.9, 2.0], 2, ((0, 2), (1, 3))),
        ([1.0, 1.1, 1.05, 3.0], 2, ((0, 1, 2), (3,))),
        ([5.0, 1.0, 2.0, 4.0, 1.1, 2.2], 3, ((1, 4), (2, 5), (0, 3))),
        ([1.0, 2.0, 4.0], 1, ((0, 1, 2),)),
        ([1.0, 2.0, 4.0], 3, ((0,), (1,), (2,))),
        ([1.0, 1.0, 1.0, 1.0], 2, ((0,), (1, 2, 3))),  # equal gaps: cut at the faster end
    ],
)
def test_group_by_speed(times, k, want):
    assert group_by_speed(times, k) == want


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: group_by_speed([1.0, 0.0], 1), ValueError, "finite and > 0"),
        (lambda: group_by_speed([1.0, 2.0], 3), ValueError, r"num_groups must be in \[1, 2\]"),
        (lambda: group_by_speed([1.0, 2.0], 1.0), TypeError, "num_groups must be an int"),
        (lambda: grouped_ring([(0, 1), (1, 2)], 3), ValueError, "must partition the ranks"),
        (lambda: group_by_speed(["a", "b"], 1), TypeError, "step_times must be a sequence of"),
        (lambda: grouped_ring([(0, 1, 2), ()], 3), ValueError, "must partition the ranks"),
        (lambda: grouped_ring([], -1), ValueError, "size must be >= 1; got -1"),
        (lambda: grouped_ring(3, 3), TypeError, "groups must be a sequence of sequences"),
        (lambda: grouped_ring([(0,)], 1.0), TypeError, "size must be an int; got 1.0"),
    ],
)
def test_grouping_argument_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_grouped_ring_is_a_ring_inside_each_group():
    W = grouped_ring([(0, 2, 4), (1, 3), (5,)], 6).weights
    want = np.zeros((6, 6))
    want[np.ix_([0, 2, 4], [0, 2, 4])] = 1 / 3
    want[np.ix_([1, 3], [1, 3])] = 1 / 2
    want[5, 5] = 1.0
    np.testing.assert_allclose(W, want)


# --- distributed --------------------------------------------------------------------------

LR = 0.05


def _sgd_step(x, A, b):
    w = x.clone().requires_grad_(True)
    loss = ((A @ w.T).squeeze(1) - b).pow(2).mean() / 2
    (g,) = torch.autograd.grad(loss, w)
    return x - LR * g


def _train(times, num_groups, interval, scale, rounds):
    rank = gossamer.rank()
    A, b = least_squares_data(rank)
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opt = FedHiSyn(
        sgd,
        model,
        num_groups=num_groups,
        interval=interval,
        step_time=times[rank],
        scale_steps=scale,
    )
    for _ in range(rounds * opt.steps_per_round):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
    opt.synchronize()
    return model.weight.detach().clone(), opt.groups, opt.steps_per_round


def _reference(times, groups, interval, scale, rounds):
    n = len(times)
    data = [least_squares_data(r) for r in range(n)]
    xs = [linear_model().weight.detach().clone() for _ in range(n)]
    mean = [np.mean([times[r] for r in g]) for g in groups]
    steps = [round(interval * max(mean) / m) if scale else interval for m in mean]
    for _ in range(rounds):
        for group, k in zip(groups, steps, strict=True):
            W = topo.ring(len(group)).weights
            for _ in range(k):
                local = [_sgd_step(xs[r], *data[r]) for r in group]
                for a, r in enumerate(group):
                    xs[r] = sum(W[c, a] * local[c] for c in range(len(group)))
            # the last step's combine is the global average, not the ring's: undo the ring
            for r, x in zip(group, local, strict=True):
                xs[r] = x
        xs = [sum(xs) / n] * n
    return xs, steps


@pytest.mark.parametrize(
    ("times", "num_groups", "interval", "scale", "groups"),
    [
        ([1.0, 2.0, 1.1, 2.1], 2, 2, True, ((0, 2), (1, 3))),
        ([1.0, 1.0, 1.0, 3.0], 2, 2, True, ((0, 1, 2), (3,))),
        ([1.0, 1.0, 1.0, 3.0], 2, 3, False, ((0, 1, 2), (3,))),
        ([2.0, 1.0], 2, 2, True, ((1,), (0,))),
        # every slow round is global while the fast group's first is a ring round: the ring's
        # first posted round must not wait on a check over every rank (it hung)
        ([1.0, 1.0, 2.0, 2.0], 2, 1, True, ((0, 1), (2, 3))),
    ],
)
def test_schedule_matches_a_one_process_simulation(times, num_groups, interval, scale, groups):
    rounds = 2
    results = run_distributed(_train, len(times), args=(times, num_groups, interval, scale, rounds))
    xs, steps = _reference(times, groups, interval, scale, rounds)
    for rank, (weight, got_groups, k) in enumerate(results):
        assert got_groups == groups
        assert k == next(s for g, s in zip(groups, steps, strict=True) if rank in g)
        torch.testing.assert_close(weight, xs[rank], rtol=1e-10, atol=1e-12)
    if scale and times[3 % len(times)] == 3.0:
        assert sorted({k for _, _, k in results}) == [2, 6]  # 3x faster: 3x the steps


SLEEP = 0.3


def _calibrate():
    rank = gossamer.rank()
    A, b = least_squares_data(rank)
    model = linear_model()
    opt = FedHiSyn(
        torch.optim.SGD(model.parameters(), lr=LR),
        model,
        interval=2,
        calibration_steps=3,
        scale_steps=False,
    )
    for _ in range(3):
        assert opt.calibrating
        if rank % 2:
            time.sleep(SLEEP)  # ranks 1 and 3 are slow
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
    return model.weight.detach().clone(), opt.groups, opt.step_times, opt.state_dict()


def test_calibration_times_steps_groups_and_averages():
    results = run_distributed(_calibrate, 4)
    data = [least_squares_data(r) for r in range(4)]
    xs = [linear_model().weight.detach().clone() for _ in range(4)]
    for _ in range(3):  # calibration steps are local
        xs = [_sgd_step(x, *d) for x, d in zip(xs, data, strict=True)]
    mean = sum(xs) / 4
    for weight, groups, times, state in results:
        assert groups == ((0, 2), (1, 3))
        assert min(times[1], times[3]) > SLEEP > max(times[0], times[2])
        torch.testing.assert_close(weight, mean, rtol=1e-10, atol=1e-12)
        assert state["communication"]["fedhisyn"]["groups"] == [[0, 2], [1, 3]]


def _errors():
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    out = []
    for kwargs in (
        {"interval": 0},
        {"step_time": -1.0},
        {"calibration_steps": 1},
        {"num_groups": 2.0},
        {"step_time": "fast"},
    ):
        try:
            FedHiSyn(sgd, model, **kwargs)
        except (TypeError, ValueError) as err:
            out.append(f"{type(err).__name__}: {err}")
    return out


def test_argument_errors():
    (errors,) = run_distributed(_errors, 1)
    assert errors == [
        "ValueError: interval must be an int >= 1; got 0",
        "ValueError: step_time must be a finite number > 0 or None; got -1.0",
        "ValueError: calibration_steps must be an int >= 2; got 1",
        "TypeError: num_groups must be an int >= 1; got 2.0",
        "TypeError: step_time must be a finite number > 0 or None; got 'fast'",
    ]


def _resume(rounds_before, rounds, mid=0):
    """``rounds_before`` rounds and ``mid`` steps, save, a fresh optimizer loads, the rest."""
    rank = gossamer.rank()
    A, b = least_squares_data(rank)

    def build(model):
        sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
        return FedHiSyn(sgd, model, interval=2, step_time=[1.0, 2.0][rank % 2])

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            least_squares_loss(model, A, b).backward()
            opt.step()

    model = linear_model()
    opt = build(model)
    k = opt.steps_per_round
    train(model, opt, rounds_before * k + mid)
    if rounds_before < rounds:
        state, weights = opt.state_dict(), model.state_dict()
        model = linear_model()
        opt = build(model)
        model.load_state_dict(weights)
        opt.load_state_dict(state)
        train(model, opt, (rounds - rounds_before) * k - mid)
    opt.synchronize()
    return model.weight.detach().clone(), opt.groups, opt.steps_per_round, opt.communicator.rounds


@pytest.mark.parametrize("mid", [0, 1])
def test_fedhisyn_resumes_exactly(mid):
    """At a round boundary, and one step into a round (the fast group's next combine is a
    ring round while the slow group's is global: the new optimizer's first ring round must
    not wait on a check over every rank)."""
    whole = run_distributed(_resume, 4, args=(3, 3))
    resumed = run_distributed(_resume, 4, args=(1, 3, mid))
    assert [k for _, _, k, _ in whole] == [4, 2, 4, 2]
    for got, want in zip(resumed, whole, strict=True):
        assert got[1:] == want[1:]
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
