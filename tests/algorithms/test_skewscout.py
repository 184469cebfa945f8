"""SkewScout: the period rule against scripted losses; the wrapper against a 1-process run.

The distributed case runs adapt-then-combine SGD on the least-squares problem over a ring,
wrapped in SkewScout, and compares models, measured losses and periods with a simulation in
one process that writes out every piece: the local SGD step, the ring average when the step
count is a multiple of the period, the probe peer at shift ``1 + k mod (n-1)``, and the
controller's rule.
"""

import numpy as np
import pytest
import torch

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.optim import PeriodController, SkewScout
from gossamer.testing import run_distributed
from problems import least_squares_data, least_squares_loss, linear_model

# --- one process: the controller --------------------------------------------------------


def test_period_follows_a_scripted_accuracy_sequence():
    c = PeriodController(threshold=0.1, min_period=2, max_period=16, factor=2, hysteresis=0.5)
    losses = [0.0, 0.01, 0.04, 0.0, 0.3, 0.07, 0.2, 0.2, 0.2, 0.049, 0.0]
    # grow below 0.05, shrink above 0.1, keep in between; clamp to [2, 16]
    want = [4, 8, 16, 16, 8, 8, 4, 2, 2, 4, 8]
    assert [c.update(x) for x in losses] == want
    assert c.history == list(zip(losses, want, strict=True))


def test_factor_and_full_hysteresis():
    c = PeriodController(threshold=0.05, min_period=1, max_period=27, factor=3, hysteresis=1.0)
    assert [c.update(x) for x in (0.05, 0.0, 0.051, 0.0, 0.0, 0.0)] == [3, 9, 3, 9, 27, 27]
    c = PeriodController(threshold=0.05, max_period=8, initial_period=8, hysteresis=0.0)
    # hysteresis 0: never grows (no loss is below 0)
    assert [c.update(x) for x in (0.0, 0.06, 0.0, 0.06)] == [8, 4, 4, 2]


def test_controller_state_round_trip():
    c = PeriodController(threshold=0.1, max_period=8)
    for x in (0.0, 0.0, 0.5):
        c.update(x)
    fresh = PeriodController(threshold=0.1, max_period=8)
    fresh.load_state_dict(c.state_dict())
    assert (fresh.period, fresh.history) == (c.period, c.history)
    assert fresh.update(0.0) == c.update(0.0)
    with pytest.raises(ValueError, match=r"state\['period'\] = 9 is outside \[1, 8\]"):
        fresh.load_state_dict({"period": 9})


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"threshold": 1.5}, ValueError, r"threshold must be in \[0, 1.0\]; got 1.5"),
        ({"threshold": "0.1"}, TypeError, "threshold must be a number; got '0.1'"),
        ({"min_period": 0}, ValueError, "min_period must be an int >= 1; got 0"),
        ({"min_period": 4, "max_period": 2}, ValueError, r"max_period must be >= min_period"),
        ({"initial_period": 64}, ValueError, r"initial_period must be in \[1, 32\]; got 64"),
        ({"factor": 1}, ValueError, "factor must be an int >= 2; got 1"),
        ({"factor": 2.0}, TypeError, "factor must be an int >= 2; got 2.0"),
        ({"hysteresis": -0.1}, ValueError, r"hysteresis must be in \[0, 1.0\]; got -0.1"),
    ],
)
def test_controller_argument_errors(kwargs, error, match):
    with pytest.raises(error, match=match):
        PeriodController(**kwargs)


def test_the_drift_shrinks_and_holds_the_period():
    c = PeriodController(threshold=0.1, drift_threshold=10.0, max_period=16, hysteresis=0.5)
    pairs = [(0.0, 1.0), (0.0, 1.0), (0.0, 2.0), (0.0, 3.0), (0.0, 7.0), (0.0, 11.0)]
    pairs += [(0.2, 0.0), (0.0, None)]
    # Both low: grow while the drift extrapolated to the doubled period, D (2 tau - 1) /
    # (tau - 1) (D itself at period 1), stays below 5: 1 at 1, 3 at 2, 4.67 at 4. At 8,
    # 3 extrapolates to 6.4 and 7 is in the band [5, 10]: hold (a plain band would have
    # grown on 3). Drift above 10 or loss above 0.1: shrink. No drift: the loss decides.
    want = [2, 4, 8, 8, 8, 4, 2, 4]
    assert [c.update(loss, drift) for loss, drift in pairs] == want
    np.testing.assert_array_equal(c.drifts, [1.0, 1.0, 2.0, 3.0, 7.0, 11.0, 0.0, np.nan])
    fresh = PeriodController(threshold=0.1, drift_threshold=10.0, max_period=16)
    fresh.load_state_dict(c.state_dict())
    np.testing.assert_array_equal(fresh.drifts, c.drifts)
    # without a drift threshold the drift is recorded and ignored
    plain = PeriodController(threshold=0.1, max_period=16)
    assert [plain.update(0.0, 1e6) for _ in range(3)] == [2, 4, 8]


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (0.0, ValueError, "drift_threshold must be > 0 and finite; got 0.0"),
        (float("inf"), ValueError, "drift_threshold must be > 0 and finite; got inf"),
        ("5", TypeError, "drift_threshold must be a number; got '5'"),
    ],
)
def test_drift_threshold_errors(value, error, match):
    with pytest.raises(error, match=match):
        PeriodController(drift_threshold=value)


def test_update_rejects_a_non_number():
    with pytest.raises(TypeError, match="drift must be a number or None; got nan"):
        PeriodController().update(0.0, float("nan"))

    with pytest.raises(TypeError, match="loss must be a number; got nan"):
        PeriodController().update(float("nan"))
    with pytest.raises(TypeError, match=r"loss must be a number; got tensor\(\[0\.1000\]\)"):
        PeriodController().update(torch.tensor([0.1]))


def test_update_takes_numpy_and_tensor_numbers_and_states_are_checked():
    rule = PeriodController(threshold=0.1, max_period=8)
    rule.update(np.float32(0.0))  # a loss from numpy or torch, as a user measures it
    rule.update(torch.tensor(0.0))
    assert rule.period == 4 and rule.history == [(0.0, 2), (0.0, 4)]
    with pytest.raises(ValueError, match="state must be a dict from PeriodController"):
        PeriodController().load_state_dict({})


# --- distributed --------------------------------------------------------------------------

STEPS, LR, PROBE_EVERY = 24, 0.05, 3
CONTROL = {"threshold": 0.02, "min_period": 1, "max_period": 8, "hysteresis": 0.5}


def _score(rank, weight):
    """A rank-dependent 'accuracy' of a weight vector: deterministic, in float64."""
    g = np.random.default_rng(100 + rank)
    direction = torch.tensor(g.normal(size=weight.numel()))
    return float(torch.tanh(direction @ weight.flatten().double()))


def _train(reduce, control=CONTROL, graph="ring", probe_every=PROBE_EVERY, sketch_size=256):
    rank = gossamer.rank()
    A, b = least_squares_data(rank)
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    topology = getattr(topo, graph)(gossamer.size())
    atc = optim.AdaptThenCombine(sgd, model, topology=topology)
    opt = SkewScout(
        atc,
        lambda m: _score(rank, m.weight.detach()),
        controller=PeriodController(**control),
        probe_every=probe_every,
        reduce=reduce,
        sketch_size=sketch_size,
    )
    for _ in range(STEPS):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
    opt.synchronize()
    state = opt.state_dict()["skewscout"]
    controller = state["controller"]
    return (
        model.weight.detach().clone(),
        controller["history"],
        opt.probe_bytes,
        controller["drifts"],
    )


def _count_sketch(v, size, probe):
    """The count sketch of the flat vector ``v`` at probe ``probe``, one entry at a time.

    Buckets and signs as SkewScout documents them: a generator seeded with the probe's index
    draws the buckets (uniform in [0, size)), then the signs (+1 or -1).
    """
    v = v.flatten()
    generator = torch.Generator().manual_seed(probe)
    buckets = torch.randint(size, (v.numel(),), generator=generator).tolist()
    signs = torch.randint(2, (v.numel(),), generator=generator).tolist()
    sketch = [0.0] * size
    for j, (bucket, sign) in enumerate(zip(buckets, signs, strict=True)):
        sketch[bucket] += (1.0 if sign else -1.0) * float(v[j])
    return torch.tensor(sketch, dtype=torch.float64)


def _reference(n, reduce, control=CONTROL, weights=None, probe_every=PROBE_EVERY, sketch_size=None):
    """The whole run in one process; returns the models, the controller's history and drifts.

    Drift at a probe: the (mean or max over ranks) squared distance between a rank's local
    displacement and its probe peer's, over the (mean or max) of each rank's lr^2 |g|^2,
    averaged over the steps since the last probe. The local displacement: from the model
    after a round to the model before the next round's step (zero when the two rounds are
    consecutive steps), the last one complete at the probe.
    """
    W = topo.ring(n).weights if weights is None else weights
    data = [least_squares_data(r) for r in range(n)]
    xs = [linear_model().weight.detach().clone() for _ in range(n)]
    control = PeriodController(**control)
    period, probes = control.period, 0
    step_sizes = [[] for _ in range(n)]
    pool = np.mean if reduce == "mean" else np.max
    after_round = [x.clone() for x in xs]  # the models the last round left (at first: x_0)
    deltas = [torch.zeros_like(x) for x in xs]
    for k in range(1, STEPS + 1):
        is_round = k % period == 0
        for i, (A, b) in enumerate(data):
            w = xs[i].clone().requires_grad_(True)
            loss = ((A @ w.T).squeeze(1) - b).pow(2).mean() / 2
            (g,) = torch.autograd.grad(loss, w)
            step_sizes[i].append(LR**2 * float(g.pow(2).sum()))
            xs[i] = xs[i] - LR * g
        if is_round:
            xs = [sum(W[j, i] * xs[j] for j in range(n)) for i in range(n)]
        if k % probe_every == 0:
            shift = 1 + probes % (n - 1)
            peers = [xs[(i - shift) % n] for i in range(n)]
            losses = [_score(i, xs[i]) - _score(i, peers[i]) for i in range(n)]
            sent = deltas
            if sketch_size is not None:
                sent = [_count_sketch(d, sketch_size, probes) for d in deltas]
            drifts = [float((sent[i] - sent[(i - shift) % n]).pow(2).sum()) for i in range(n)]
            drift = pool(drifts) / pool([np.mean(s) for s in step_sizes])
            step_sizes = [[] for _ in range(n)]
            probes += 1
            period = control.update(float(pool(losses)), float(drift))
        if (k + 1) % period == 0:  # step k + 1 ends with a round: it starts from xs
            pairs = zip(xs, after_round, strict=True)
            deltas = [torch.zeros_like(x) if is_round else x - a for x, a in pairs]
        if is_round:
            after_round = [x.clone() for x in xs]
    return xs, control.history, control.drifts


@pytest.mark.parametrize(("world_size", "reduce"), [(4, "mean"), (3, "max")])
def test_skewscout_matches_a_one_process_simulation(world_size, reduce):
    results = run_distributed(_train, world_size, args=(reduce,))
    xs, history, drifts = _reference(world_size, reduce)
    periods = [p for _, p in history]
    assert len(set(periods)) > 1, f"the scripted run never changed the period: {history}"
    for rank, (weight, got_history, probe_bytes, got_drifts) in enumerate(results):
        torch.testing.assert_close(weight, xs[rank], rtol=1e-10, atol=1e-12)
        assert [p for _, p in got_history] == periods, f"rank {rank}"
        np.testing.assert_allclose([x for x, _ in got_history], [x for x, _ in history], atol=1e-9)
        np.testing.assert_allclose(got_drifts, drifts, rtol=1e-9)
        # the model and its local displacement (float64)
        assert probe_bytes == len(history) * 2 * weight.numel() * 8


# Drifts here run from 0 to 20: at 2 the period shrinks twice where the loss alone keeps 8.
DRIFT = 2.0
DRIFT_CONTROL = {**CONTROL, "drift_threshold": DRIFT}


def test_the_drift_sets_the_period_as_in_the_one_process_simulation():
    """A drift threshold: the period follows the local drift (the loss alone differs)."""
    results = run_distributed(_train, 4, args=("mean", DRIFT_CONTROL))
    xs, history, drifts = _reference(4, "mean", DRIFT_CONTROL)
    _, loss_only, _ = _reference(4, "mean")
    periods = [p for _, p in history]
    assert periods != [p for _, p in loss_only], "the drift changed no decision"
    assert any(d > DRIFT for d in drifts) and any(d < DRIFT / 2 for d in drifts), drifts
    for rank, (weight, got_history, _, got_drifts) in enumerate(results):
        torch.testing.assert_close(weight, xs[rank], rtol=1e-10, atol=1e-12)
        assert [p for _, p in got_history] == periods, f"rank {rank}"
        np.testing.assert_allclose(got_drifts, drifts, rtol=1e-9)


def test_the_drift_sees_the_local_steps_when_a_round_leaves_no_spread():
    """Exact averaging and probes right after rounds: the drift is the local steps' own.

    A fully connected graph averages exactly, so at every probe (period 4, a probe every 4
    steps: right after a round) the ranks' models are equal. A distance between the models,
    the drift as it was first built, read 0 there at any period: on a graph that mixes fast
    the spread a round leaves hides the drift of the local steps, which costs accuracy all
    the same (exp-2 against the ring in docs/heterogeneity.md). The local displacement since
    the previous round sees those steps.
    """
    fixed = {**CONTROL, "drift_threshold": 1.0, "min_period": 4, "max_period": 4}
    n = 4
    results = run_distributed(_train, n, args=("mean", fixed, "fully_connected", 4))
    W = topo.fully_connected(n).weights
    xs, history, drifts = _reference(n, "mean", fixed, weights=W, probe_every=4)
    assert len(drifts) == STEPS // 4
    assert min(drifts) > 0.1, drifts  # 3 local steps between rounds, at every probe
    for rank, (weight, got_history, _, got_drifts) in enumerate(results):
        torch.testing.assert_close(weight, xs[rank], rtol=1e-10, atol=1e-12)
        # the models agree at every probe: all the drift is the local steps'
        torch.testing.assert_close(weight, xs[0], rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(got_drifts, drifts, rtol=1e-9)
        np.testing.assert_allclose(got_history, history, atol=1e-12)


def test_a_count_sketch_of_the_displacement_estimates_the_drift():
    """A model larger than the sketch: Delta travels as its count sketch, as documented."""
    control = {**DRIFT_CONTROL, "drift_threshold": 0.5}
    results = run_distributed(_train, 4, args=("mean", control, "ring", PROBE_EVERY, 3))
    xs, history, drifts = _reference(4, "mean", control, sketch_size=3)
    _, _, exact = _reference(4, "mean", control)
    assert not np.allclose(drifts, exact), "the sketch changed nothing"
    for rank, (weight, got_history, probe_bytes, got_drifts) in enumerate(results):
        torch.testing.assert_close(weight, xs[rank], rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_drifts, drifts, rtol=1e-9)
        assert [p for _, p in got_history] == [p for _, p in history], f"rank {rank}"
        assert probe_bytes == len(history) * (weight.numel() + 3) * 8  # the model, 3 numbers


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def _wrong_arguments():
    model = linear_model()
    atc = optim.AdaptThenCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
    errors = []
    for call in (
        lambda: SkewScout(torch.optim.SGD(model.parameters(), lr=0.1), lambda m: 0.0),
        lambda: SkewScout(atc, 3),
        lambda: SkewScout(atc, lambda m: 0.0, probe_every=0),
        lambda: SkewScout(atc, lambda m: 0.0, reduce="median"),
        lambda: SkewScout(optim.GradientAllreduce(_sgd(model), model), lambda m: 0.0),
        lambda: SkewScout(
            optim.AdaptThenCombine(_sgd(model), model, exact_diffusion=True), lambda m: 0.0
        ),
    ):
        try:
            call()
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    bad = SkewScout(atc, lambda m: "high")
    try:
        bad.probe()
    except TypeError as err:
        errors.append(f"{type(err).__name__}: {err}")
    return errors


def test_skewscout_argument_errors():
    (errors,) = run_distributed(_wrong_arguments, 1)
    assert errors[0].startswith("TypeError: optimizer must be a gossamer DecentralizedOptimizer")
    assert errors[1] == "TypeError: evaluate must be callable; got 3"
    assert errors[2] == "ValueError: probe_every must be an int >= 1; got 0"
    assert errors[3] == "ValueError: reduce must be one of ('mean', 'max'); got 'median'"
    for message in errors[4:6]:
        assert message.startswith("ValueError: SkewScout tunes the averaging period")
    assert errors[6] == "TypeError: evaluate must return a number; got 'high'"
    assert len(errors) == 7


def _resume(split):
    """``split`` steps, save, a fresh model and optimizer load, the rest; or all at once."""
    rank = gossamer.rank()
    A, b = least_squares_data(rank)

    def build(model):
        atc = optim.AdaptThenCombine(_sgd(model), model, topology=topo.ring(gossamer.size()))
        control = PeriodController(**CONTROL)
        return SkewScout(
            atc,
            lambda m: _score(rank, m.weight.detach()),
            controller=control,
            probe_every=PROBE_EVERY,
        )

    def train(model, opt, steps):
        for _ in range(steps):
            opt.zero_grad()
            least_squares_loss(model, A, b).backward()
            opt.step()

    model = linear_model()
    opt = build(model)
    train(model, opt, split)
    if split < STEPS:
        state, weights = opt.state_dict(), model.state_dict()
        model = linear_model()
        with torch.no_grad():
            model.weight.add_(1.0)  # another start: the load must overwrite it
        opt = build(model)
        model.load_state_dict(weights)
        opt.load_state_dict(state)
        train(model, opt, STEPS - split)
    opt.synchronize()
    return model.weight.detach().clone(), opt.period, opt.probes


def test_skewscout_resumes_exactly():
    whole = run_distributed(_resume, 3, args=(STEPS,))
    resumed = run_distributed(_resume, 3, args=(STEPS // 2 + 1,))
    for (w1, p1, n1), (w2, p2, n2) in zip(whole, resumed, strict=True):
        torch.testing.assert_close(w2, w1, rtol=0, atol=0)
        assert (p1, n1) == (p2, n2)
