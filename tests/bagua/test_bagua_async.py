"""Asynchronous model averaging: ranks take different numbers of steps, models still agree.

Nothing here depends on timing: each rank, after its last step, waits until the background
thread has completed three more rounds (so at least two rounds saw every rank's final
model), which makes the result deterministic up to rounding.
"""

import time

import pytest
import torch
from bagua_problems import data, flat, loss, model

import gossamer.bagua as bagua
from gossamer.bagua.algorithms import async_model_average
from gossamer.testing import run_distributed

N = 4


def _sgd(m):
    return torch.optim.SGD(m.parameters(), lr=0.05)


def _wait_rounds(impl, more):
    target = impl.rounds + more
    deadline = time.monotonic() + 60
    while impl.rounds < target:
        assert time.monotonic() < deadline, "the background rounds stalled"
        time.sleep(0.002)


def _train(m, opt, x, y, steps):
    for _ in range(steps):
        opt.zero_grad()
        loss(m, x, y).backward()
        opt.step()


def _async(mode, warmup):
    bagua.init_process_group()
    r = bagua.get_rank()
    m = model(r)
    opt = _sgd(m)
    algorithm = async_model_average.AsyncModelAverageAlgorithm(
        peer_selection_mode=mode, sync_interval_ms=5, warmup_steps=warmup
    )
    m = m.with_bagua([opt], algorithm)
    impl = m.bagua_algorithm
    x, y = data(r)
    # (not a forward of the wrapped model: those count as steps, also for warm-up)
    out = {"first_loss": float(loss(model(0), x, y))}
    if warmup:
        _train(m, opt, x, y, warmup)
        out["after_warmup"] = flat(m)  # synchronous gradient allreduce: all ranks equal
    steps = 20 + 10 * r  # every rank a different number of steps
    _train(m, opt, x, y, steps)
    _wait_rounds(impl, 3)
    impl.abort(m)
    out["final"] = flat(m)
    out["last_loss"] = float(loss(m, x, y))
    # abort and resume may be called again and again
    impl.abort(m)
    impl.resume(m)
    impl.resume(m)
    _train(m, opt, x, y, 3)
    _wait_rounds(impl, 3)
    impl.abort(m)
    out["again"] = flat(m)
    # the same steps without any averaging, from the same start
    local = model(0)
    _train(local, _sgd(local), x, y, warmup + steps)
    out["local"] = flat(local)
    return out


def _distance(vectors):
    mean = torch.stack(vectors).mean(0)
    return float(torch.stack([(v - mean).norm() for v in vectors]).pow(2).mean().sqrt())


@pytest.mark.parametrize(("mode", "warmup"), [("all", 0), ("shift_one", 2), ("moshpit", 0)])
def test_async_averaging_keeps_ranks_together_while_they_run_apart(mode, warmup):
    got = run_distributed(_async, N, args=(mode, warmup), timeout=120)
    apart = _distance([g["local"] for g in got])
    assert apart > 1e-2  # the ranks' data differ: alone they drift apart
    assert _distance([g["final"] for g in got]) < 1e-3 * apart
    assert _distance([g["again"] for g in got]) < 1e-3 * apart
    # the loss of the ranks' data (each on its rank's model) falls
    assert sum(g["last_loss"] for g in got) < 0.8 * sum(g["first_loss"] for g in got)
    if warmup:
        for g in got[1:]:
            torch.testing.assert_close(g["after_warmup"], got[0]["after_warmup"])


def _evaluation_at_the_end_of_warmup():
    bagua.init_process_group()
    r = bagua.get_rank()
    m = model(r)
    opt = _sgd(m)
    algorithm = async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=5, warmup_steps=2)
    m = m.with_bagua([opt], algorithm)
    x, y = data(r)
    _train(m, opt, x, y, 2)
    m.eval()  # validation after the warm-up: the forward where averaging would begin
    with torch.no_grad():
        m(x)
    m.train()
    _train(m, opt, x, y, 5)
    _wait_rounds(m.bagua_algorithm, 3)  # stalls (fails) when averaging never began
    m.bagua_algorithm.abort(m)
    return m.bagua_algorithm.status.name


def test_an_evaluation_forward_at_the_end_of_warmup_defers_the_start_of_averaging():
    assert run_distributed(_evaluation_at_the_end_of_warmup, 2) == ["STOPPED"] * 2
