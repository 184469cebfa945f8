"""ByteGrad, QAdam and low-precision decentralized SGD against full-precision references."""

import pytest
import torch
from torch import nn

import gossamer.bagua as bagua
from gossamer import topology as topo
from gossamer.bagua.algorithms import bytegrad, decentralized, q_adam
from gossamer.compression import MinMaxUInt8
from gossamer.testing import run_distributed

N = 4
D_IN, HIDDEN = 24, 16


def _data(rank):
    g = torch.Generator().manual_seed(200 + rank)
    x = torch.randn(32, D_IN, generator=g)
    return x, x[:, :3].sum(1, keepdim=True) * (1 + rank) + torch.randn(32, 1, generator=g)


def _model(rank):
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def _loss(m, x, y):
    return ((m(x) - y) ** 2).mean()


def _flat(tensors):
    return torch.cat([t.detach().reshape(-1) for t in tensors]).clone()


def _grads(m, x, y):
    m.zero_grad()
    _loss(m, x, y).backward()
    return [p.grad.clone() for p in m.parameters()]


def _set(m, v):
    offset = 0
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(v[offset : offset + p.numel()].view_as(p))
            offset += p.numel()


def _mean_grads(v):
    m = _model(0)
    _set(m, v)
    per_rank = [_grads(m, *_data(r)) for r in range(N)]
    return [sum(gs) / N for gs in zip(*per_rank, strict=True)]


# ---------------------------------------------------------------------- ByteGrad
def _bytegrad(hierarchical, steps):
    bagua.init_process_group()
    r = bagua.get_rank()
    m = _model(r)
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    m = m.with_bagua([opt], bytegrad.ByteGradAlgorithm(hierarchical=hierarchical))
    x, y = _data(r)
    out = {"params": [_flat(m.parameters())], "grads": []}
    for _ in range(steps):
        opt.zero_grad()
        _loss(m, x, y).backward()
        out["grads"].append(_flat(p.grad for p in m.parameters()))
        opt.step()
        out["params"].append(_flat(m.parameters()))
    return out


def _bytegrad_reference(v):
    """Bagua's ByteGrad in one process: the bucket (reversed parameters), 4 chunks."""
    m = _model(0)
    _set(m, v)
    per_rank = [_flat(reversed(_grads(m, *_data(r)))) for r in range(N)]
    numel = per_rank[0].numel()
    count = -(-numel // N)
    c = MinMaxUInt8()

    def qd(t):
        return c.decompress(c.compress(t))

    chunks = [torch.cat([g, g.new_zeros(N * count - numel)]).view(N, count) for g in per_rank]
    reduced = []
    for j in range(N):
        acc = qd(chunks[0][j]).clone()
        for i in range(1, N):
            acc.add_(qd(chunks[i][j]))
        reduced.append(qd(acc.div_(N)))
    bucket = torch.cat(reduced)[:numel]
    # back to parameter order
    sizes = [p.numel() for p in reversed(list(m.parameters()))]
    parts = list(bucket.split(sizes))
    return torch.cat(list(reversed(parts)))


def test_bytegrad_is_baguas_scatter_gather_and_close_to_full_precision():
    steps = 5
    got = run_distributed(_bytegrad, N, args=(False, steps))
    for g in got[1:]:  # everyone decodes the same bytes
        for a, b in zip(g["params"], got[0]["params"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for t in range(steps):
        x_t = got[0]["params"][t]
        # the exact algorithm, simulated from the full data
        torch.testing.assert_close(got[0]["grads"][t], _bytegrad_reference(x_t), rtol=0, atol=1e-6)
        update = got[0]["params"][t + 1] - x_t
        full = -0.05 * _flat(_mean_grads(x_t))
        assert (update - full).norm() < 0.05 * full.norm(), t


def test_hierarchical_bytegrad_between_two_machines():
    env = {"GOSSAMER_NODES_PER_MACHINE": "2"}
    got = run_distributed(_bytegrad, N, args=(True, 3), env=env)
    for t in range(3):
        x_t = got[0]["params"][t]
        full = -0.05 * _flat(_mean_grads(x_t))
        for g in got:
            update = g["params"][t + 1] - x_t
            assert (update - full).norm() < 0.05 * full.norm(), t


# ---------------------------------------------------------------------- QAdam
WARMUP, QSTEPS, LR = 4, 24, 0.01


def _qmodel(rank):
    torch.manual_seed(rank)
    return nn.Linear(D_IN, 1)


def _qdata(rank):
    g = torch.Generator().manual_seed(300 + rank)
    x = torch.randn(64, D_IN, generator=g)
    w = torch.randn(D_IN, 1, generator=torch.Generator().manual_seed(7))
    return x, x @ w + 0.5 * rank + 0.1 * torch.randn(64, 1, generator=g)


def _qadam(full_precision=False):
    bagua.init_process_group()
    r = bagua.get_rank()
    m = _qmodel(r)
    opt = q_adam.QAdamOptimizer(m.parameters(), lr=LR, warmup_steps=WARMUP)
    m = m.with_bagua([opt], q_adam.QAdamAlgorithm(opt, hierarchical=False))
    x, y = _qdata(r)
    states = []
    for _ in range(QSTEPS):
        params = list(m.parameters())
        started = "exp_avg" in opt.state[params[0]]
        keys = ("exp_avg", "exp_avg_sq")
        moments = {k: _flat(opt.state[p][k] for p in params) for k in keys} if started else None
        before = (_flat(params), moments)
        opt.zero_grad()
        _loss(m, x, y).backward()
        opt.step()
        states.append(
            (*before, _flat(m.parameters()), _flat(opt.state[p]["exp_avg"] for p in params))
        )
    return states


def _qadam_under_a_loss_scaler():
    bagua.init_process_group()
    r = bagua.get_rank()
    m = _qmodel(r)
    opt = q_adam.QAdamOptimizer(m.parameters(), lr=LR, warmup_steps=WARMUP)
    m = m.with_bagua([opt], q_adam.QAdamAlgorithm(opt, hierarchical=False))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(m, *_qdata(r))).backward()
    with pytest.raises(RuntimeError, match="cannot follow a loss scaler") as raised:
        scaler.step(opt)
    return str(raised.value)


def test_qadam_refuses_a_loss_scaler_on_every_rank():
    """Its momentum takes the gradients in backward(), before a scaler unscales them."""
    for message in run_distributed(_qadam_under_a_loss_scaler, 2):
        assert "bfloat16 autocast needs none" in message


def _qadam_loaded_after_with_bagua():
    bagua.init_process_group()
    r = bagua.get_rank()
    m = _qmodel(0)
    opt = q_adam.QAdamOptimizer(m.parameters(), lr=LR, warmup_steps=WARMUP)
    m = m.with_bagua([opt], q_adam.QAdamAlgorithm(opt, hierarchical=False))
    x, y = _qdata(r)
    for _ in range(WARMUP + 2):
        opt.zero_grad()
        _loss(m, x, y).backward()
        opt.step()
    saved = opt.state_dict()  # a checkpoint past the warm-up ...
    fresh = _qmodel(0)
    fresh_opt = q_adam.QAdamOptimizer(fresh.parameters(), lr=LR, warmup_steps=WARMUP)
    fresh = fresh.with_bagua([fresh_opt], q_adam.QAdamAlgorithm(fresh_opt, hierarchical=False))
    fresh_opt.load_state_dict(saved)  # ... loaded after with_bagua, in the warm-up's stage
    momenta = []
    for _ in range(2):
        momenta.append(_flat(fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()))
        fresh_opt.zero_grad()
        _loss(fresh, x, y).backward()
        fresh_opt.step()
    momenta.append(_flat(fresh_opt.state[p]["exp_avg"] for p in fresh.parameters()))
    return momenta


def test_qadam_loaded_after_with_bagua_switches_to_its_stage():
    # After warm-up only the compressed stage's operations update the momentum.
    for momenta in run_distributed(_qadam_loaded_after_with_bagua, 2):
        assert not torch.equal(momenta[0], momenta[1]) and not torch.equal(momenta[1], momenta[2])


def _qgrads(v):
    m = _qmodel(0)
    _set(m, v)
    return [_flat(_grads(m, *_qdata(r))) for r in range(N)]


def _quantized_average(vectors, sizes):
    """ByteGrad's 8-bit averaging of per-rank vectors (parameter order) over N chunks."""

    def to_bucket(v):  # buckets hold the parameters in reverse order
        return torch.cat(list(reversed(v.split(sizes))))

    c = MinMaxUInt8()

    def qd(t):
        return c.decompress(c.compress(t))

    flats = [to_bucket(v) for v in vectors]
    numel = flats[0].numel()
    count = -(-numel // N)
    chunks = [torch.cat([f, f.new_zeros(N * count - numel)]).view(N, count) for f in flats]
    out = []
    for j in range(N):
        acc = qd(chunks[0][j]).clone()
        for i in range(1, N):
            acc.add_(qd(chunks[i][j]))
        out.append(qd(acc.div_(N)))
    bucket = torch.cat(out)[:numel]
    return torch.cat(list(reversed(bucket.split(list(reversed(sizes))))))


def test_qadam_warmup_is_adam_and_compressed_steps_within_5_percent():
    got = run_distributed(_qadam, N)
    sizes = [p.numel() for p in _qmodel(0).parameters()]
    beta1, beta2 = 0.9, 0.999
    # warm-up: Adam on the averaged gradients, step for step
    ref = _qmodel(0)
    adam = torch.optim.Adam(ref.parameters(), lr=LR)
    for t in range(WARMUP):
        mean = sum(_qgrads(_flat(ref.parameters()))) / N
        offset = 0
        for p in ref.parameters():
            p.grad = mean[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        adam.step()
        for rank_states in got:
            torch.testing.assert_close(
                rank_states[t][2], _flat(ref.parameters()), rtol=0, atol=1e-5
            )
    # compression: gradients averaged in 8 bits (simulated exactly), m updated, v frozen
    fp = None
    start = got[0][WARMUP][0]
    for t in range(WARMUP, QSTEPS):
        x_t, moments, x_next, m_next = got[0][t]
        gs = _qgrads(x_t)
        m = moments["exp_avg"]
        torch.testing.assert_close(
            m_next, beta1 * m + (1 - beta1) * _quantized_average(gs, sizes), rtol=0, atol=1e-6
        )
        step = t + 1
        denom = (moments["exp_avg_sq"].sqrt() / (1 - beta2**step) ** 0.5).add_(1e-8)
        torch.testing.assert_close(x_next, x_t - LR / (1 - beta1**step) * m_next / denom)
        # the step is within 5 % of the step with full-precision averaged momenta
        full = -LR / (1 - beta1**step) * (beta1 * m + (1 - beta1) * sum(gs) / N) / denom
        assert (x_next - x_t - full).norm() < 0.05 * full.norm(), t
        for rank_states in got[1:]:
            torch.testing.assert_close(rank_states[t][2], x_next, rtol=0, atol=0)
        # the same steps with full-precision averaged gradients all along
        if fp is None:
            fp, fm = start.clone(), m.clone()
        fm = beta1 * fm + (1 - beta1) * sum(_qgrads(fp)) / N
        fp = fp - LR / (1 - beta1**step) * fm / denom
    moved = fp - start
    assert (got[0][-1][2] - fp).norm() < 0.05 * moved.norm()


# ---------------------------------------------------------------------- low precision
LP_STEPS, LP_LR = 60, 0.02


def _low_precision_steps(steps, kwargs, skip=()):
    """``skip``: (step, rank) whose scaled loss overflows under a ``torch.amp.GradScaler``."""
    """This rank's weights after every step of Bagua's low-precision algorithm(**kwargs)."""
    bagua.init_process_group()
    r = bagua.get_rank()
    m = _model(r)  # with_bagua starts every rank from rank 0's model
    opt = torch.optim.SGD(m.parameters(), lr=LP_LR)
    m = m.with_bagua([opt], decentralized.LowPrecisionDecentralizedAlgorithm(**kwargs))
    x, y = _data(r)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, enabled=bool(skip))
    models = []
    for k in range(steps):
        opt.zero_grad()
        loss = _loss(m, x, y)
        scaler.scale(loss * float("inf") if (k, r) in skip else loss).backward()
        scaler.step(opt)
        scaler.update()
        models.append(_flat(m.parameters()))
    return models


def _low_precision(kwargs):
    return _low_precision_steps(LP_STEPS, {"hierarchical": False, **kwargs})[-1]


def _gossip_reference(W):
    """Full-precision difference gossip: y_{t+1} = W y_t - lr * grad_i(y_t)."""
    models = [_model(0) for _ in range(N)]
    for _ in range(LP_STEPS):
        ys = [_flat(m.parameters()) for m in models]
        gs = [_flat(_grads(m, *_data(r))) for r, m in enumerate(models)]
        for i, m in enumerate(models):
            _set(m, sum(W[j][i] * ys[j] for j in range(N)) - LP_LR * gs[i])
    return [_flat(m.parameters()) for m in models]


RING = [[1 / 3 if (i - j) % N in (0, 1, N - 1) else 0.0 for j in range(N)] for i in range(N)]


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"compression": "uint8:4", "topology": topo.exponential_two(N)}],
    ids=["bagua-ring-uint8", "exp2-uint8x4"],
)
def test_low_precision_ring_stays_within_10_percent_of_full_precision(kwargs):
    W = RING if "topology" not in kwargs else kwargs["topology"].weights.tolist()
    got = run_distributed(_low_precision, N, args=(kwargs,))
    ref = _gossip_reference(W)
    start = _flat(_model(0).parameters())
    for mine, full in zip(got, ref, strict=True):
        assert (mine - full).norm() < 0.1 * (full - start).norm()


# ---------------------------------------------------------------------- random streams
def _stochastic_gossip(spec, rounds):
    from gossamer.bagua.compressed import LowPrecisionGossip

    bagua.init_process_group()
    comm = LowPrecisionGossip(spec)
    x = torch.randn(300, generator=torch.Generator().manual_seed(bagua.get_rank()))
    x0 = x.clone()
    for _ in range(rounds):
        comm.next_round()
        x = comm.start(x).wait()
    return x0, x, comm.state_dict()["compressor"]


def _ring_round(cs, reps, xs):
    """Bagua's ring (1/3 each) in one process: every rank's new model; ``reps`` updated."""
    n = len(xs)
    ds = []
    for i in range(n):
        d = xs[i].clone()  # the library's order of float32 operations
        d.add_(reps[i]["left"], alpha=1 / 3).add_(reps[i]["right"], alpha=1 / 3)
        d.add_(reps[i]["self"], alpha=1 / 3 - 2)
        ds.append(cs[i].decompress(cs[i].compress(d)))
    for i in range(n):
        reps[i]["left"] += ds[(i - 1) % n]
        reps[i]["right"] += ds[(i + 1) % n]
        reps[i]["self"] += ds[i]
    return [r["self"].clone() for r in reps]


def _simulate_stochastic_gossip(spec, starts, rounds):
    """Bagua's ring in one process, each rank with its own compressor stream."""
    from gossamer.compression import for_rank, get_compressor

    cs = [for_rank(get_compressor(spec), r) for r in range(len(starts))]
    reps = [{"self": x.clone(), "left": x.clone(), "right": x.clone()} for x in starts]
    xs = [x.clone() for x in starts]
    for _ in range(rounds):
        xs = _ring_round(cs, reps, xs)
    return xs


@pytest.mark.parametrize("world_size", [2, 3])
def test_low_precision_gossip_draws_a_stream_per_rank(world_size):
    got = run_distributed(_stochastic_gossip, world_size, args=("qsgd:2", 3))
    want = _simulate_stochastic_gossip("qsgd:2", [g[0] for g in got], 3)
    for (_, x, stream), w in zip(got, want, strict=True):
        torch.testing.assert_close(x, w, rtol=1e-5, atol=1e-5)  # a flipped rounding: ~0.1
        assert stream == {"step": 3}


# ------------------------------------------------- the ring's differences left in flight
def _low_precision_simulated(n, steps, skip=()):
    """Bagua's low-precision decentralized SGD in one process, blocking rounds.

    A rank in ``skip`` at a step leaves out its update there, and still takes its round.
    """
    models = [_model(0) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=LP_LR) for m in models]
    x0 = _flat(models[0].parameters())
    reps = [{"self": x0.clone(), "left": x0.clone(), "right": x0.clone()} for _ in range(n)]
    out = []
    for k in range(steps):
        for r, (m, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            _loss(m, *_data(r)).backward()
            if (k, r) not in skip:
                opt.step()
        xs = _ring_round([MinMaxUInt8()] * n, reps, [_flat(m.parameters()) for m in models])
        for m, x in zip(models, xs, strict=True):
            _set(m, x)
        out.append(xs)
    return out


@pytest.mark.parametrize(("world_size", "hierarchical"), [(2, False), (4, False), (4, True)])
def test_low_precision_steps_are_the_blocking_rings_while_differences_travel(
    world_size, hierarchical
):
    """A round's new model is final before its neighbours' differences arrive (posted).

    Hierarchical with one rank per machine is the same ring, posted too.
    """
    env = {"GOSSAMER_NODES_PER_MACHINE": "1"}
    args = (8, {"hierarchical": hierarchical})
    got = run_distributed(_low_precision_steps, world_size, args=args, env=env)
    want = _low_precision_simulated(world_size, 8)
    for rank, models in enumerate(got):
        for step, model in enumerate(models):
            torch.testing.assert_close(model, want[step][rank], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("world_size", [2, 3])
def test_low_precision_ring_keeps_its_rounds_when_a_loss_scaler_skips_a_step(world_size):
    """torch.amp.GradScaler skips optimizer.step(), and with it the step's ring round.

    The engine runs that round at the next forward pass instead, on the unchanged weights;
    before, the rank paired its rounds with its peers' next ones, and its peers failed
    when it finished first.
    """
    skip = {(2, 1), (5, 0)}
    env = {"GOSSAMER_NODES_PER_MACHINE": "1"}  # a ring between machines: compressed
    got = run_distributed(_low_precision_steps, world_size, args=(8, {}, skip), env=env)
    want = _low_precision_simulated(world_size, 8, skip)
    for rank, models in enumerate(got):
        for step, model in enumerate(models):
            if (step, rank) in skip:  # nothing changed yet: the round runs at the next forward
                torch.testing.assert_close(model, models[step - 1], rtol=0, atol=0)
            else:
                torch.testing.assert_close(model, want[step][rank], rtol=1e-5, atol=1e-6)
