"""Algorithms for label-skewed data against the same algorithms simulated in one process.

D-Cliques clique averaging, NGC / CompNGC, DACFL and nonlinear gossip run on real ranks,
each rank with its own least-squares data (tests/problems.py) and its own initial model;
the reference runs the algorithm for every rank in the test process from the full weight
matrices, with torch's SGD for the local update.
"""

import copy
import itertools

import numpy as np
import pytest
import torch

import gossamer
from gossamer import communicators, optim
from gossamer import topology as topo
from gossamer.compression import ErrorFeedback, get_compressor
from gossamer.testing import run_distributed
from problems import least_squares_data, least_squares_loss

LR, MOMENTUM, STEPS = 0.05, 0.9, 6


def _start(rank):
    """A different initial weight per rank."""
    g = torch.Generator().manual_seed(7 + rank)
    return torch.randn(1, 5, generator=g, dtype=torch.float64)


def _model(rank):
    model = torch.nn.Linear(5, 1, bias=False).double()
    with torch.no_grad():
        model.weight.copy_(_start(rank))
    return model


_DATA = {}


def _grad(w, rank):
    """Gradient of rank's least-squares loss mean((A w - b)^2) / 2 at weight w (1 x 5)."""
    if rank not in _DATA:
        _DATA[rank] = least_squares_data(rank)
    A, b = _DATA[rank]
    return ((A @ w.reshape(-1) - b) @ A / len(b)).reshape(1, -1)


class _Momentum:
    """torch.optim.SGD's momentum for every rank: v = beta v + g; x -= lr v."""

    def __init__(self, n):
        self.v = [None] * n

    def update(self, i, g):
        self.v[i] = g.clone() if self.v[i] is None else MOMENTUM * self.v[i] + g
        return -LR * self.v[i]


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _mix(W, xs):
    n = len(xs)
    return [sum(W[j, i] * xs[j] for j in range(n)) for i in range(n)]


# ---------------------------------------------------------------- D-Cliques
def _dcliques(as_list):
    if as_list:  # with singleton cliques, which exchange no gradients
        return [[0, 2], [1], [3]]
    return topo.d_cliques([[1, 0], [0, 1], [1, 0], [0, 1]], 2)


def _run_cliques(steps, as_list):
    n, r = gossamer.size(), gossamer.rank()
    A, b = least_squares_data(r)
    model = _model(r)
    cliques = _dcliques(as_list)
    kwargs = {"topology": topo.ring(n)} if as_list else {}
    opt = optim.CliqueAveraging(_sgd(model), model, cliques, **kwargs)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
        opt.synchronize()
        out.append(model.weight.detach().clone())
    return out


def _simulate_cliques(n, steps, as_list):
    cliques = _dcliques(as_list)
    if as_list:
        W, members = topo.ring(n).weights, cliques
    else:
        W, members = cliques.topology.weights, cliques.cliques
    clique = {i: c for c in members for i in c}
    xs, mom, out = [_start(i) for i in range(n)], _Momentum(n), []
    for _ in range(steps):
        grads = [_grad(x, i) for i, x in enumerate(xs)]
        avg = [sum(grads[j] for j in clique[i]) / len(clique[i]) for i in range(n)]
        xs = _mix(W, [xs[i] + mom.update(i, avg[i]) for i in range(n)])
        out.append(xs)
    return out


@pytest.mark.parametrize("as_list", [False, True])
def test_clique_averaging_matches_the_one_process_simulation(as_list):
    world_size = 4
    got = run_distributed(_run_cliques, world_size, args=(STEPS, as_list))
    want = _simulate_cliques(world_size, STEPS, as_list)
    for k in range(STEPS):
        for i in range(world_size):
            torch.testing.assert_close(got[i][k], want[k][i], msg=f"step {k} rank {i}")


# ---------------------------------------------------------------- NGC / CompNGC
def _run_ngc(steps, compression, alpha):
    n, r = gossamer.size(), gossamer.rank()
    A, b = least_squares_data(r)
    model = _model(r)
    kind = optim.NGC if compression is None else optim.CompNGC
    extra = {} if compression is None else {"compression": compression}
    opt = kind(_sgd(model), model, topology=topo.ring(n), alpha=alpha, **extra)
    out = []
    for _ in range(steps):
        opt.step(lambda: least_squares_loss(model, A, b))
        out.append(model.weight.detach().clone())
    return out, opt.bytes_sent


def _simulate_ngc(n, steps, compression, alpha):
    W = topo.ring(n).weights
    peers = {i: [j for j in range(n) if j != i and W[j, i] > 0] for i in range(n)}
    efs = [ErrorFeedback(get_compressor(compression)) for _ in range(n)] if compression else []
    xs, mom, out = [_start(i) for i in range(n)], _Momentum(n), []
    for _ in range(steps):
        # sent[(j, i)]: what j sent to i, the gradient of j's data at i's model.
        sent = {}
        for j in range(n):
            for i in peers[j]:
                g = _grad(xs[i], j)
                if compression:
                    g = efs[j].decompress(efs[j].compress(g.reshape(-1), key=(0, i)))
                sent[j, i] = g.reshape(1, 5)
        mixed = _mix(W, xs)
        new = []
        for i in range(n):
            a = W[i, i] if alpha is None else alpha
            total = sum(W[j, i] for j in peers[i])
            g = a * _grad(xs[i], i) + sum((1 - a) * W[j, i] / total * sent[j, i] for j in peers[i])
            new.append(mixed[i] + mom.update(i, g))
        xs = new
        out.append(xs)
    return out


@pytest.mark.parametrize(
    ("world_size", "compression", "alpha"),
    [(2, None, None), (4, None, 0.3), (4, "sign", None), (2, "topk:0.4", 0.5)],
)
def test_ngc_matches_the_one_process_simulation(world_size, compression, alpha):
    got = run_distributed(_run_ngc, world_size, args=(STEPS, compression, alpha))
    want = _simulate_ngc(world_size, STEPS, compression, alpha)
    for k in range(STEPS):
        for i in range(world_size):
            torch.testing.assert_close(got[i][0][k], want[k][i], msg=f"step {k} rank {i}")
    degree = 1 if world_size == 2 else 2  # ring(2) is one edge
    per_message = get_compressor(compression).payload_nbytes(5, torch.float64)
    for _, sent in got:
        assert sent["models"] == STEPS * degree * 5 * 8
        assert sent["cross_gradients"] == STEPS * degree * per_message


def _ngc_reaches_agreement(compression):
    n, r = gossamer.size(), gossamer.rank()
    A, b = least_squares_data(r)
    model = _model(r)
    kind = optim.NGC if compression is None else optim.CompNGC
    sgd = torch.optim.SGD(model.parameters(), lr=0.02, momentum=0.5)
    opt = kind(sgd, model, topology=topo.ring(n))
    for _ in range(100):
        opt.step(lambda: least_squares_loss(model, A, b))
    return model.weight.detach().clone()


def test_compressed_ngc_converges_like_ngc():
    plain = run_distributed(_ngc_reaches_agreement, 2, args=(None,))
    signed = run_distributed(_ngc_reaches_agreement, 2, args=("sign",))
    center = torch.stack(plain).mean(0)
    for w in signed:
        assert (w - center).norm() < 0.05 * center.norm()


# ---------------------------------------------------------------- DACFL
def _matchings(n, r):
    """A symmetric time-varying graph: round k pairs r with r XOR 2^(k mod log2 n), weights 1/2.

    The paper's recursion (correction 1) diverges on it; correction 1/2 converges.
    """
    bits = max(1, (n - 1).bit_length())
    for k in itertools.count():
        partner = r ^ (1 << (k % bits))
        yield topo.Step.uniform([partner], [partner])


def _one_peer(n, rank):
    return topo.one_peer_exponential(topo.exponential_two(n), rank)


# the time-varying graphs: symmetric matchings, the directed one-peer exponential schedule
_SCHEDULES = {True: _matchings, "matchings": _matchings, "one-peer": _one_peer}


def _schedule_for(n, r, dynamic):
    if dynamic:
        return {"schedule": _SCHEDULES[dynamic](n, r)}
    return {"topology": topo.ring(n)}


def _run_dacfl(steps, dynamic, period=1, correction=0.5):
    n, r = gossamer.size(), gossamer.rank()
    A, b = least_squares_data(r)
    model = _model(r)
    opt = optim.DACFL(
        _sgd(model),
        model,
        num_steps_per_communication=period,
        correction=correction,
        **_schedule_for(n, r, dynamic),
    )
    out = []
    for _ in range(steps):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
        out.append((model.weight.detach().clone(), opt.average_state()["weight"]))
    return out


def _mixing_matrices(n, dynamic, steps, schedule=None):
    """W(k) for every step, assembled from every rank's own schedule (DACFL's matchings)."""
    if not dynamic:
        return [topo.ring(n).weights] * steps
    schedules = [(schedule or _SCHEDULES[dynamic])(n, r) for r in range(n)]
    out = []
    for _ in range(steps):
        W = np.zeros((n, n))
        for i, s in enumerate(schedules):
            step = next(s)
            W[i, i] = step.self_weight
            for j, w in step.src_weights.items():
                W[j, i] = w
        out.append(W)
    return out


def _simulate_dacfl(n, steps, dynamic, lr=LR, momentum=MOMENTUM, period=1, correction=0.5):
    """DACFL for all ranks; per step (the parameters, the estimates x).

    theta_i(r+1) = `period` SGD steps from x_i(r); x_i(r+1) = sum_j W_ji x_j(r) +
    theta_i(r+1) - x_i(r) + e_i(r), e_i(r+1) = e_i(r) + correction * (sum_j W_ji x_j(r) -
    x_i(r)), e(0) = 0 (correction 1: x_i(r+1) = sum_j W_ji x_j(r) + theta_i(r+1) -
    theta_i(r)); the parameters are reset to x_i(r+1) after each round.
    """
    xs = [_start(i) for i in range(n)]
    errors = [torch.zeros_like(x) for x in xs]  # e_i(r)
    params = [x.clone() for x in xs]
    v = [None] * n
    rounds = iter(_mixing_matrices(n, dynamic, steps // period + 1))
    out = []
    for k in range(steps):
        for i in range(n):
            g = _grad(params[i], i)
            v[i] = g if v[i] is None else momentum * v[i] + g
            params[i] = params[i] - lr * v[i]
        if (k + 1) % period == 0:
            mixed = _mix(next(rounds), xs)
            new = [m + params[i] - xs[i] + errors[i] for i, m in enumerate(mixed)]
            errors = [e + correction * (m - x) for e, m, x in zip(errors, mixed, xs, strict=True)]
            xs, params = new, [x.clone() for x in new]
        out.append((list(params), list(xs)))
    return out


@pytest.mark.parametrize(
    ("world_size", "dynamic", "period", "correction"),
    [(2, False, 1, 1.0), (4, "matchings", 1, 0.5), (4, "one-peer", 1, 0.5), (3, False, 2, 0.5)],
)
def test_dacfl_matches_the_one_process_simulation(world_size, dynamic, period, correction):
    steps = 2 * STEPS if period > 1 else STEPS
    got = run_distributed(_run_dacfl, world_size, args=(steps, dynamic, period, correction))
    want = _simulate_dacfl(world_size, steps, dynamic, period=period, correction=correction)
    for k in range(steps):
        params, xs = want[k]
        for i in range(world_size):
            torch.testing.assert_close(got[i][k][0], params[i], msg=f"model step {k} rank {i}")
            torch.testing.assert_close(got[i][k][1], xs[i], msg=f"x step {k} rank {i}")
    # Between rounds the model holds its estimate: the next local training starts from it.
    for i in range(world_size):
        torch.testing.assert_close(got[i][-1][0], got[i][-1][1])


@pytest.mark.parametrize("correction", [1.0, 0.5])
def test_dacfl_tracks_the_average_of_the_trained_models(correction):
    """FODAC's invariant: mean_i x_i(r) = mean_i theta_i(r) after every round, for any gain."""
    n, period = 4, 3
    xs0 = [_start(i) for i in range(n)]
    trained, params, xs, v = list(xs0), list(xs0), list(xs0), [None] * n
    for W in _mixing_matrices(n, "one-peer", 5):
        for _ in range(period):
            for i in range(n):
                g = _grad(params[i], i)
                v[i] = g if v[i] is None else MOMENTUM * v[i] + g
                params[i] = params[i] - LR * v[i]
        mixed = _mix(W, xs)
        # the paper's form with the reference theta~ = x - e in place of theta (equal at 1)
        new = [m + params[i] - trained[i] for i, m in enumerate(mixed)]
        trained = [
            y - (x - t) - correction * (m - x)
            for y, x, t, m in zip(new, xs, trained, mixed, strict=True)
        ]
        xs, params = new, list(new)
        torch.testing.assert_close(sum(xs) / n, sum(p for p in params) / n)
    # and the simulation used by the distributed test is this same recursion
    sim = _simulate_dacfl(n, 5 * period, "one-peer", period=period, correction=correction)
    torch.testing.assert_close(sim[-1][1][0], xs[0])


def _simulate_dsgd(n, steps, lr, dynamic):
    """Plain DSGD (adapt-with-combine) on the same graph: x_i <- sum_j W_ji x_j - lr g_i."""
    xs = [_start(i) for i in range(n)]
    for W in _mixing_matrices(n, dynamic, steps):
        xs = [m - lr * _grad(xs[i], i) for i, m in enumerate(_mix(W, xs))]
    return xs


@pytest.mark.parametrize(
    ("dynamic", "correction"),
    [(False, 1.0), (False, 0.5), ("matchings", 0.5), ("one-peer", 0.5)],
)
def test_dacfl_reaches_the_optimum_of_the_average_loss_where_dsgd_stays_off_it(dynamic, correction):
    """Skewed data (each rank its own least squares) on a static ring or a time-varying graph.

    DSGD's ranks settle O(lr * gradient dissimilarity / spectral gap) away from the minimiser
    of the average loss (closed form here); DACFL's fixed point is consensual with a zero
    average gradient, i.e. that minimiser. On the time-varying graphs it needs a correction
    gain below 1 (next test).
    """
    n, steps, lr = 8, 600, 0.05
    problems = [least_squares_data(i) for i in range(n)]
    hessian = sum(A.T @ A / len(b) for A, b in problems)
    optimum = torch.linalg.solve(hessian, sum(A.T @ b / len(b) for A, b in problems))
    _, xs = _simulate_dacfl(n, steps, dynamic, lr=lr, momentum=0.0, correction=correction)[-1]
    dsgd = _simulate_dsgd(n, steps, lr, dynamic)

    def error(models):
        return max(float((m.reshape(-1) - optimum).norm()) for m in models)

    assert error(xs) < 0.01 * error(dsgd), (error(xs), error(dsgd))


@pytest.mark.parametrize("dynamic", ["matchings", "one-peer"])
def test_the_papers_recursion_diverges_on_time_varying_graphs(dynamic):
    """Correction 1 (the paper): undamped disagreement modes, pumped by the switching."""
    _, xs = _simulate_dacfl(8, 600, dynamic, lr=0.05, momentum=0.0, correction=1.0)[-1]
    assert max(float(x.norm()) for x in xs) > 1e3


# ---------------------------------------------------------------- nonlinear gossip
def _value(rank):
    g = torch.Generator().manual_seed(50 + rank)
    return torch.randn(40, generator=g, dtype=torch.float64)


def _run_ngo(rounds, power, eps, dynamic):
    n, r = gossamer.size(), gossamer.rank()
    if dynamic:
        schedule = _one_peer(n, r)
        comm = communicators.NonlinearGossip(power=power, step_size=eps, schedule=schedule)
    else:
        comm = communicators.NonlinearGossip(topo.ring(n), power=power, step_size=eps)
    x, out = _value(r), []
    for _ in range(rounds):
        comm.next_round()
        x = comm.start(x, 0).wait()
        out.append(x.clone())
    return out


def _simulate_ngo(n, rounds, power, eps, dynamic):
    xs, out = [_value(i) for i in range(n)], []
    for W in _mixing_matrices(n, dynamic, rounds, schedule=_one_peer):
        xs = [
            xs[i]
            + eps
            * sum(
                W[j, i] * torch.sign(xs[j] - xs[i]) * (xs[j] - xs[i]).abs() ** power
                for j in range(n)
                if j != i and W[j, i] > 0
            )
            for i in range(n)
        ]
        out.append(xs)
    return out


@pytest.mark.parametrize(("world_size", "dynamic"), [(4, False), (4, True), (2, False)])
def test_nonlinear_gossip_matches_the_one_process_simulation(world_size, dynamic):
    got = run_distributed(_run_ngo, world_size, args=(5, 0.5, 0.5, dynamic))
    want = _simulate_ngo(world_size, 5, 0.5, 0.5, dynamic)
    for k in range(5):
        for i in range(world_size):
            torch.testing.assert_close(got[i][k], want[k][i], msg=f"round {k} rank {i}")
    if not dynamic:  # symmetric weights and an odd phi: the average is preserved
        start = sum(_value(i) for i in range(world_size)) / world_size
        torch.testing.assert_close(sum(g[-1] for g in got) / world_size, start)


def test_nonlinear_gossip_with_power_one_is_neighbour_averaging():
    got = run_distributed(_run_ngo, 4, args=(3, 1.0, 1.0, False))
    W = topo.ring(4).weights
    xs = [_value(i) for i in range(4)]
    for _ in range(3):
        xs = _mix(W, xs)
    for i in range(4):
        torch.testing.assert_close(got[i][-1], xs[i])


def test_nonlinear_gossip_settles_in_the_documented_band_around_the_average():
    """With p < 1 discrete rounds chatter in a band of width <= (2 eps sum_j w_ji)^(1/(1-p))
    (measured: an eighth of it on ring(4)); the band shrinks like eps^(1/(1-p))."""
    n, rounds, p = 4, 60, 0.5
    start = sum(_value(i) for i in range(n)) / n
    spreads = {}
    for eps in (0.5, 0.1):
        xs = _simulate_ngo(n, rounds, p, eps, False)[-1]
        torch.testing.assert_close(sum(xs) / n, start)
        spreads[eps] = max(float((x - start).abs().max()) for x in xs)
        assert spreads[eps] <= (2 * eps * 2 / 3) ** (1 / (1 - p))
    assert spreads[0.1] < spreads[0.5] / 10


# ---------------------------------------------------------------- state and arguments
def _build(kind, model):
    n, r = gossamer.size(), gossamer.rank()
    sgd = _sgd(model)
    if kind == "cliques":
        return optim.CliqueAveraging(sgd, model, [[0, 1]], topology=topo.ring(n))
    if kind == "compngc":
        return optim.CompNGC(sgd, model, topology=topo.ring(n))
    if kind == "dacfl":
        return optim.DACFL(sgd, model, **_schedule_for(n, r, True))
    comm = communicators.NonlinearGossip(topo.ring(n), power=0.5, step_size=0.3)
    return optim.AdaptThenCombine(sgd, model, communicator=comm)


def _train(opt, model, steps):
    A, b = least_squares_data(gossamer.rank())
    for _ in range(steps):
        if isinstance(opt, optim.NGC):
            opt.step(lambda: least_squares_loss(model, A, b))
            continue
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
    opt.synchronize()
    return model.weight.detach().clone()


def _round_trip(kind):
    r = gossamer.rank()
    model = _model(r)
    opt = _build(kind, model)
    _train(opt, model, 3)
    # torch's optimizer state_dict holds the live momentum buffers: copy them.
    saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
    straight = _train(opt, model, 3)
    resumed_model = _model(r)
    resumed = _build(kind, resumed_model)
    resumed_model.load_state_dict(saved[0])
    resumed.load_state_dict(saved[1])
    again = _train(resumed, resumed_model, 3)
    fresh_model = _model(r)
    fresh_model.load_state_dict(saved[0])
    fresh = _train(_build(kind, fresh_model), fresh_model, 3)  # the state was needed
    return straight, again, fresh


@pytest.mark.parametrize("kind", ["cliques", "compngc", "dacfl", "ngo"])
def test_state_dict_round_trip_resumes_the_same_run(kind):
    for straight, again, fresh in run_distributed(_round_trip, 2, args=(kind,)):
        torch.testing.assert_close(again, straight, rtol=0, atol=1e-12)
        assert not torch.allclose(fresh, straight, rtol=0, atol=1e-9)


def _argument_errors():
    r = gossamer.rank()
    model = _model(r)
    sgd = _sgd(model)
    bad = {
        "cliques": lambda c, **kw: optim.CliqueAveraging(sgd, model, c, **kw),
        "ngc": lambda **kw: optim.NGC(sgd, model, **kw),
        "ngo": lambda **kw: communicators.NonlinearGossip(**kw),
    }
    cases = [
        (ValueError, r"ranks \[1\] are in no clique", bad["cliques"], ([[0]],), {}),
        (ValueError, r"ranks \[1\] are in more than one", bad["cliques"], ([[0, 1], [1]],), {}),
        (ValueError, "rank 2 is outside", bad["cliques"], ([[0, 1, 2]],), {}),
        (ValueError, "empty clique", bad["cliques"], ([[0, 1], []],), {}),
        (TypeError, "sequence of rank lists", bad["cliques"], ("01",), {}),
        (TypeError, "int ranks; got 1.0", bad["cliques"], ([[0, 1.0]],), {}),
        (
            ValueError,
            "topology has 3 ranks",
            bad["cliques"],
            ([[0, 1]],),
            {"topology": topo.ring(3)},
        ),
        (TypeError, "topology must be", bad["cliques"], ([[0, 1]],), {"topology": "ring"}),
        (ValueError, "alpha must be a number in", bad["ngc"], (), {"alpha": 1.5}),
        (TypeError, "alpha must be a number in", bad["ngc"], (), {"alpha": True}),
        (
            ValueError,
            "is directed",
            bad["ngc"],
            (),
            {"topology": topo.Topology([[0.5, 0.5], [0, 1]])},
        ),
        (ValueError, "topology has 3 ranks", bad["ngc"], (), {"topology": topo.ring(3)}),
        (ValueError, "error_feedback=True needs", bad["ngc"], (), {"error_feedback": True}),
        (
            TypeError,
            "error_feedback must be",
            bad["ngc"],
            (),
            {"compression": "sign", "error_feedback": 1},
        ),
        (ValueError, "power must be a number in", bad["ngo"], (), {"power": 0}),
        (ValueError, "power must be a number in", bad["ngo"], (), {"power": 1.5}),
        (ValueError, "step_size must be", bad["ngo"], (), {"step_size": 0.0}),
        (ValueError, "step_size must be", bad["ngo"], (), {"step_size": True}),
        (TypeError, "topology must be", bad["ngo"], (), {"topology": "ring"}),
    ]
    for error, match, make, args, kwargs in cases:
        with pytest.raises(error, match=match):
            make(*args, **kwargs)
    with pytest.raises(ValueError, match="CompNGC needs a compression"):
        optim.CompNGC(sgd, model, compression="none")
    with pytest.raises(ValueError, match=r"NGC\.step needs closure="):
        optim.NGC(sgd, model).step()
    with pytest.raises(ValueError, match=r"DACFL does not support elastic=True"):
        optim.DACFL(sgd, model, elastic=True)  # it survived a death, off the optimum
    dacfl = optim.DACFL(sgd, model)
    state = dacfl.state_dict()
    state["communication"]["tracker"] = [torch.zeros(3, dtype=torch.float64)]
    with pytest.raises(ValueError, match=r"state\['tracker'\] has buckets of shapes \[\(3,\)\]"):
        dacfl.load_state_dict(state)
    return True


def test_bad_arguments_raise_naming_the_argument():
    assert run_distributed(_argument_errors, 2) == [True, True]


def _ngo_by_name():
    model = _model(gossamer.rank())
    opt = optim.AdaptThenCombine(
        _sgd(model), model, communication="nonlinear_gossip", topology=topo.ring(2)
    )
    comm = opt.communicator
    with pytest.raises(ValueError, match="no compressed form"):
        optim.AdaptThenCombine(
            _sgd(model), model, communication="nonlinear_gossip", compression="sign"
        )
    return type(comm).__name__, comm.topology == topo.ring(2), comm.power, comm.step_size


def test_nonlinear_gossip_is_an_optimizer_communication_option():
    assert run_distributed(_ngo_by_name, 2) == [("NonlinearGossip", True, 0.5, 0.5)] * 2


def _clique_defaults():
    n, r = gossamer.size(), gossamer.rank()
    model = _model(r)
    dc = _dcliques(False)
    by_default = optim.CliqueAveraging(_sgd(model), model, dc).communicator
    schedule = topo.one_peer_exponential(topo.exponential_two(n), r)
    scheduled = optim.CliqueAveraging(_sgd(model), model, dc, schedule=schedule).communicator
    return by_default.topology == dc.topology, scheduled.schedule is schedule


def test_clique_averaging_defaults_to_the_d_cliques_graph_unless_given_a_schedule():
    assert run_distributed(_clique_defaults, 4) == [(True, True)] * 4


def test_cliques_may_be_numpy_arrays_and_integers():
    import numpy as np

    from gossamer.optim.cliques import check_cliques

    split = np.array_split(np.arange(5), 2)  # what a user splitting ranks writes
    assert check_cliques(split, 5) == ((0, 1, 2), (3, 4))
    assert check_cliques(np.arange(4).reshape(2, 2), 4) == ((0, 1), (2, 3))
    assert check_cliques([[np.int64(1), 0]], 2) == ((0, 1),)
    assert all(type(r) is int for c in check_cliques(split, 5) for r in c)
    with pytest.raises(TypeError, match="int ranks"):
        check_cliques([np.array([0.0, 1.0])], 2)
