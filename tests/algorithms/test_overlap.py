"""Overlapped adapt-then-combine against the serial algorithm computed in one process.

With ``overlap=True`` each bucket is stepped and sent from the backward pass and combined
in its module's forward pre-hook; the result must still be, step by step,
:math:`x_i^{k+1} = \\sum_j W_k[j, i]\\,\\psi_j^k` with :math:`\\psi_j^k` the wrapped torch
optimizer's step from :math:`x_j^k` (ATC diffusion), which ``serial_atc`` computes for all
ranks in one process from the full weight matrices.
"""

import json
import time

import pytest
import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.compression import get_compressor
from gossamer.optim.overlap import queue_order
from gossamer.profiling import timeline
from gossamer.testing import run_distributed
from oracle import mix

STEPS = 4
TOLERANCE = dict(rtol=1e-9, atol=1e-11)


class Net(nn.Module):
    """Three layers in use and one never used (its bucket gets no gradient)."""

    def __init__(self, rank):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 6)
        self.unused = nn.Linear(6, 6)
        self.b = nn.Linear(6, 6)
        self.c = nn.Linear(6, 1)
        self.double()
        # Different starting points per rank, so that the combine matters everywhere.
        g = torch.Generator().manual_seed(50 + rank)
        with torch.no_grad():
            for p in self.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g, dtype=p.dtype))

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x))))).squeeze(1)


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 3, generator=g, dtype=torch.float64), torch.randn(
        8, generator=g, dtype=torch.float64
    )


def _loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def _torch_optimizer(kind, model):
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.05, weight_decay=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


CASES = {
    # name: (torch optimizer, num_steps_per_communication, dynamic schedule, accumulate,
    #        exact diffusion)
    "sgd-momentum": ("sgd", 1, False, False, False),
    "adam": ("adam", 1, False, False, False),
    "every-2": ("sgd", 2, False, False, False),
    "one-peer": ("adam", 1, True, False, False),
    "accumulate": ("sgd", 1, False, True, False),
    "exact-diffusion": ("sgd", 1, False, False, True),
}


# ---------------------------------------------------------------- the serial algorithm
def _static_weights(n):
    """exponential_two(n) with uniform weights: in-neighbours i - 2^k, all 1/(degree+1)."""
    shifts = sorted({2**k % n for k in range(max(1, (n - 1).bit_length())) if 2**k % n})
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        for j in [i] + [(i - s) % n for s in shifts]:
            W[j, i] = 1.0 / (len(shifts) + 1)
    return W


def _one_peer_weights(n, round_):
    """Round ``round_`` of one-peer exponential-two: average with rank i - 2^(r mod log2 n)."""
    shift = 2 ** (round_ % max(1, (n - 1).bit_length()))
    W = torch.zeros(n, n, dtype=torch.float64)
    for i in range(n):
        W[i, i] += 0.5
        W[(i - shift) % n, i] += 0.5
    return W


def serial_atc(case, n):
    """Every rank's parameters before each step and at the end, simulated in one process."""
    kind, every, dynamic, accumulate, exact = CASES[case]
    models = [Net(r) for r in range(n)]
    opts = [_torch_optimizer(kind, m) for m in models]
    history, rounds, psi_prev = [], 0, None
    for step in range(STEPS):
        history.append([[p.detach().clone() for p in m.parameters()] for m in models])
        start = history[-1]  # x_k of every rank
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            x, y = _batch(rank, step)
            if accumulate:
                _loss(model, x[:4], y[:4]).backward()
                _loss(model, x[4:], y[4:]).backward()
            else:
                _loss(model, x, y).backward()
            opt.step()
        if (step + 1) % every == 0:
            W = _one_peer_weights(n, rounds) if dynamic else _static_weights(n)
            rounds += 1
            params = [list(m.parameters()) for m in models]
            psi = [[p.detach().clone() for p in ps] for ps in params]
            if exact:  # phi = psi + x - psi_prev; x+ = (phi + W phi) / 2
                before = start if psi_prev is None else psi_prev
                sent = [
                    [a + b - c for a, b, c in zip(*t, strict=True)]
                    for t in zip(psi, start, before, strict=True)
                ]
                psi_prev = psi
            else:
                sent = psi
            for k in range(len(params[0])):
                mixed = mix(W.numpy(), [sent[r][k] for r in range(n)])
                with torch.no_grad():
                    for r in range(n):
                        value = (sent[r][k] + mixed[r]) / 2 if exact else mixed[r]
                        params[r][k].copy_(value)
    final = [[p.detach().clone() for p in m.parameters()] for m in models]
    return history, final


# ---------------------------------------------------------------- the distributed runs
def _overlapped(case, overlap, send_order="backward"):
    """Train with AdaptThenCombine; the parameters each forward pass sees, and the end."""
    kind, every, dynamic, accumulate, exact = CASES[case]
    rank, n = gossamer.rank(), gossamer.size()
    model = Net(rank)
    options = {"schedule": topo.one_peer_exponential(topo.exponential_two(n), rank)}
    if not dynamic:
        options = {"topology": topo.exponential_two(n)}
    opt = optim.AdaptThenCombine(
        _torch_optimizer(kind, model),
        model,
        overlap=overlap,
        exact_diffusion=exact,
        num_steps_per_communication=every,
        fusion_threshold_bytes=100,  # 7 buckets of float64 parameters
        send_order=send_order,
        **options,
    )
    seen, stepped_in_backward = [], []
    # Registered after the optimizer's pre-hooks: runs once every module waited for its own.
    model.register_forward_hook(
        lambda m, i, o: seen.append([p.detach().clone() for p in model.parameters()])
    )
    for step in range(STEPS):
        opt.zero_grad()
        x, y = _batch(rank, step)
        if accumulate:
            with opt.no_sync():
                _loss(model, x[:4], y[:4]).backward()
            loss = _loss(model, x[4:], y[4:])
        else:
            loss = _loss(model, x, y)
        before = model.c.weight.detach().clone()  # after forward, which wrote the combine
        loss.backward()
        stepped_in_backward.append(not torch.equal(before, model.c.weight))
        opt.step()
    opt.synchronize()
    final = [p.detach().clone() for p in model.parameters()]
    opt.close()
    # With accumulation two forward passes run per step; the first one sees x_k.
    return seen[:: 2 if accumulate else 1], final, stepped_in_backward, len(opt.buckets)


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"{n}-ranks")
def runs(request):
    n = request.param
    got = {}
    for case in CASES:
        got[case, True] = run_distributed(_overlapped, n, args=(case, True), timeout=120)
    got["sgd-momentum", False] = run_distributed(_overlapped, n, args=("sgd-momentum", False))
    for case, order in ORDERED:
        got[case, order] = run_distributed(_overlapped, n, args=(case, True, order), timeout=120)
    return n, got


def _names():
    return [name for name, _ in Net(0).named_parameters()]


def _assert_follows(rank, seen, end, history, final, lazy=()):
    """Rank ``rank``'s parameters before every step (``seen``) and at the end, against the
    serial run; layers named in ``lazy`` are checked at the end only (their combine is
    written when their module next runs forward, which an unused module never does)."""
    names = _names()
    assert len(seen) == STEPS
    for step in range(STEPS):
        for name, a, b in zip(names, seen[step], history[step][rank], strict=True):
            if not name.startswith(lazy):
                msg = f"rank {rank}, step {step}, {name}: "
                torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, s=msg: s + m)
    for name, a, b in zip(names, end, final[rank], strict=True):
        torch.testing.assert_close(a, b, **TOLERANCE, msg=lambda m, s=name: f"{s}: {m}")


# Other queue orders of the rounds (send_order): the algorithm must not change. The unused
# layer's bucket sits in the middle, so step() queues the buckets behind it.
ORDERED = [("one-peer", "forward"), ("exact-diffusion", "forward"), ("sgd-momentum", 3)]


@pytest.mark.parametrize(
    "case, run", [(c, True) for c in CASES] + ORDERED, ids=lambda v: str(v).lower()
)
def test_overlapped_atc_matches_the_serial_algorithm_step_by_step(runs, case, run):
    n, got = runs
    history, final = serial_atc(case, n)
    for rank, (seen, end, _, buckets) in enumerate(got[case, run]):
        assert buckets == 7
        _assert_follows(rank, seen, end, history, final, lazy="unused")


@pytest.mark.parametrize("case", list(CASES))
def test_the_local_step_is_taken_during_backward_on_communication_steps(runs, case):
    _, got = runs
    every = CASES[case][1]
    for _, _, stepped_in_backward, _ in got[case, True]:
        assert stepped_in_backward == [(k + 1) % every == 0 for k in range(STEPS)]


def test_without_overlap_the_result_is_the_same_and_nothing_steps_in_backward(runs):
    _, got = runs
    for (_, a, _, _), (_, b, stepped, _) in zip(
        got["sgd-momentum", True], got["sgd-momentum", False], strict=True
    ):
        assert stepped == [False] * STEPS
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **TOLERANCE)


def _second_backward():
    model = Net(gossamer.rank())
    opt = optim.AdaptThenCombine(_torch_optimizer("sgd", model), model, fusion_threshold_bytes=100)
    x, y = _batch(gossamer.rank(), 0)
    _loss(model, x, y).backward()
    with pytest.raises(RuntimeError, match=r"'c\.\w+' arrived twice before step\(\).*no_sync"):
        _loss(model, x, y).backward()
    with pytest.raises(TypeError, match="overlap must be a bool"):
        optim.AdaptThenCombine(_torch_optimizer("sgd", model), model, overlap=1)
    opt.step()
    opt.close()
    return True


def test_a_second_backward_pass_before_step_is_refused_naming_the_parameter():
    assert run_distributed(_second_backward, 2) == [True, True]


def _skipped_step(kind, skip):
    """Four iterations; with ``skip``, iteration 1 leaves out step() after its backward pass."""
    model = Net(gossamer.rank())
    sgd = _torch_optimizer("sgd", model)
    make = {
        "atc": optim.AdaptThenCombine,
        "push-sum": optim.PushSum,
        "gradient-allreduce": optim.GradientAllreduce,
    }[kind]
    opt = make(sgd, model, fusion_threshold_bytes=100)
    for step in range(4):
        opt.zero_grad()
        x, y = _batch(gossamer.rank(), step)
        if skip or step != 1 or kind != "gradient-allreduce":
            _loss(model, x, y).backward()
        if skip and step == 1:
            continue
        opt.step()
    opt.synchronize()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["atc", "push-sum", "gradient-allreduce"])
def test_zero_grad_after_a_skipped_step_finishes_it_and_training_goes_on(kind):
    """A skipped ``step()`` after backward no longer wedges every later backward pass.

    ATC and push-sum took the local steps in that backward pass: ``zero_grad()`` finishes
    the step (with a warning), the same as calling ``step()`` (push-sum, which combines what
    has arrived, only goes on). Gradient allreduce drops the
    averaged gradients, as torch DDP does: the same as not training on that batch.
    """
    for n in (2, 3):
        skipped = run_distributed(_skipped_step, n, args=(kind, True))
        if kind == "push-sum":  # asynchronous: it combines what has arrived, so no reference
            assert all(torch.isfinite(p).all() for params in skipped for p in params)
            continue
        reference = run_distributed(_skipped_step, n, args=(kind, False))
        for got, want in zip(skipped, reference, strict=True):
            for a, b in zip(got, want, strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


def _warns_on_skipped_step():
    model = Net(gossamer.rank())
    opt = optim.AdaptThenCombine(_torch_optimizer("sgd", model), model)
    _loss(model, *_batch(gossamer.rank(), 0)).backward()
    with pytest.warns(RuntimeWarning, match=r"zero_grad\(\) before step\(\).*finished the step"):
        opt.zero_grad()
    assert not opt.step_in_progress
    opt.close()
    return True


def test_zero_grad_before_step_warns_that_it_finished_the_step():
    assert run_distributed(_warns_on_skipped_step, 2) == [True, True]


# ---------------------------------------------------------------- the timeline shows it
class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the model's first layer, so the last in backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.4)
        return grad


class _SlowNet(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(3, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 1)

    def forward(self, x):
        h = _SlowBackward.apply(torch.tanh(self.a(x)))
        return self.c(torch.tanh(self.b(h))).squeeze(1)


def _traced_training(kind, path):
    model = _SlowNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "atc":
        opt = optim.AdaptThenCombine(sgd, model, fusion_threshold_bytes=64)
    elif kind == "awc":
        opt = optim.AdaptWithCombine(sgd, model, fusion_threshold_bytes=64)
    else:
        opt = optim.GradientAllreduce(sgd, model, fusion_threshold_bytes=64)
    x, y = _batch(gossamer.rank(), 0)
    timeline.start_timeline(path)
    try:
        for _ in range(2):
            opt.zero_grad()
            with timeline.activity("train", "forward"):
                loss = _loss(model, x.float(), y.float())
            with timeline.activity("train", "backward"):
                loss.backward()
            opt.step()
        opt.synchronize()
    finally:
        (written,) = timeline.stop_timeline()
    opt.close()
    return str(written)


def _spans(path):
    """``[(row, activity, start us, end us)]`` of a per-rank trace file."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    return [
        (rows[e["tid"]].split(" (")[0], e["name"], e["ts"], e["ts"] + e["dur"])
        for e in events
        if e["ph"] == "X"
    ]


@pytest.mark.parametrize(
    ("kind", "op"), [("atc", "neighbor_allreduce"), ("gradient-allreduce", "allreduce")]
)
def test_timeline_shows_communication_inside_the_backward_pass(tmp_path, kind, op):
    paths = run_distributed(_traced_training, 2, args=(kind, str(tmp_path / kind)))
    for path in paths:
        spans = _spans(path)
        backward = [(t0, t1) for row, what, t0, t1 in spans if (row, what) == ("train", "backward")]
        rounds = [(t0, t1) for row, what, t0, t1 in spans if (row, what) == (op, "communicating")]
        assert len(backward) == 2 and rounds
        # Some exchange both started and finished while backward was still running.
        for b0, b1 in backward:
            assert any(b0 <= r0 and r1 <= b1 for r0, r1 in rounds), (backward, rounds)
        if kind == "atc":
            steps = [(t0, t1) for row, what, t0, t1 in spans if what == "local step"]
            assert all(any(b0 <= s0 and s1 <= b1 for s0, s1 in steps) for b0, b1 in backward)


def test_timeline_shows_awc_waiting_for_its_combine_in_step(tmp_path):
    for path in run_distributed(_traced_training, 2, args=("awc", str(tmp_path / "awc"))):
        spans = _spans(path)
        backward = [t1 for row, what, _, t1 in spans if (row, what) == ("train", "backward")]
        waits = [
            t0 for row, what, t0, _ in spans if (row, what) == ("optimizer", "waiting for combine")
        ]
        assert len(backward) == 2 and len(waits) == 2, spans
        assert all(b1 <= w0 for b1, w0 in zip(backward, sorted(waits), strict=True))


def _train_compiled(kind, compiled):
    model = Net(gossamer.rank())
    make = {"awc": optim.AdaptWithCombine, "atc": optim.AdaptThenCombine}[kind]
    opt = make(_torch_optimizer("sgd", model), model)
    # Dynamo traces the forward (the eager backend: no compiler needed); the hooks stay eager.
    # torch does not guard compiled code on module hooks (skip_nnmodule_hook_guards): code
    # compiled for an earlier Net of this worker would skip ATC's per-module pre-hooks.
    torch._dynamo.reset()
    run = torch.compile(model, backend="eager") if compiled else model
    for step in range(STEPS):
        opt.zero_grad()
        _loss(run, *_batch(gossamer.rank(), step)).backward()
        opt.step()
    opt.synchronize()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_a_compiled_model_trains_as_the_eager_one(kind):
    eager = run_distributed(_train_compiled, 2, args=(kind, False))
    compiled = run_distributed(_train_compiled, 2, args=(kind, True))
    for mine, reference in zip(compiled, eager, strict=True):
        for p, q in zip(mine, reference, strict=True):
            torch.testing.assert_close(p, q, **TOLERANCE)


# ---------------------------------------------------------------- push-sum
def _push_sum(overlap):
    """Push-sum with ranks taking whole steps in turn, so each collect is deterministic."""
    rank, n = gossamer.rank(), gossamer.size()
    model = Net(rank)
    opt = optim.PushSum(
        _torch_optimizer("sgd", model),
        model,
        topology=topo.exponential_two(n),
        overlap=overlap,
        fusion_threshold_bytes=100,
    )
    stepped_in_backward = []
    for step in range(STEPS):
        for turn in range(n):
            if turn == rank:
                opt.zero_grad()
                x, y = _batch(rank, step)
                loss = _loss(model, x, y)
                before = model.c.weight.detach().clone()
                loss.backward()
                stepped_in_backward.append(not torch.equal(before, model.c.weight))
                opt.step()
            gossamer.barrier()
    final = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return final, stepped_in_backward


@pytest.mark.parametrize("world_size", [2, 4])
def test_overlapped_push_sum_matches_push_sum_stepped_in_step(world_size):
    overlapped = run_distributed(_push_sum, world_size, args=(True,))
    serial = run_distributed(_push_sum, world_size, args=(False,))
    for (a, in_backward), (b, not_in_backward) in zip(overlapped, serial, strict=True):
        assert in_backward == [True] * STEPS and not_in_backward == [False] * STEPS
        for x, y in zip(a, b, strict=True):
            torch.testing.assert_close(x, y, **TOLERANCE)


def test_queue_orders_and_a_bad_send_order_is_refused_naming_it():
    assert queue_order(5, "backward") == [0, 1, 2, 3, 4]
    assert queue_order(5, "forward") == [0, 4, 3, 2, 1]
    assert queue_order(5, 2) == [0, 1, 2, 4, 3]
    assert queue_order(5, 99) == queue_order(5, "forward")
    assert queue_order(1, "forward") == [0] and queue_order(0, "forward") == []
    for bad in ("front", -1, True, 1.5):
        with pytest.raises(ValueError, match=f"send_order.*{bad!r}"):
            queue_order(3, bad)


# ---------------------------------------------------------------- win-put of the local step
def _window_atc(kind):
    """WindowAdaptThenCombine on exp-2; every put lands before any rank combines."""
    rank, n = gossamer.rank(), gossamer.size()
    model = Net(rank)
    opt = optim.WindowAdaptThenCombine(
        _torch_optimizer(kind, model),
        model,
        topology=topo.exponential_two(n),
        fusion_threshold_bytes=100,
        send_order="forward",
    )
    seen, stepped_in_backward = [], []
    model.register_forward_hook(
        lambda m, i, o: seen.append([p.detach().clone() for p in model.parameters()])
    )
    for step in range(STEPS):
        opt.zero_grad()
        loss = _loss(model, *_batch(rank, step))
        before = model.c.weight.detach().clone()
        loss.backward()
        stepped_in_backward.append(not torch.equal(before, model.c.weight))
        opt.step()
        # Windows are asynchronous: a neighbour's next put may land before a slow rank
        # combines. Every put of this round lands, then every rank combines, then the next.
        opt.wait_puts()
        gossamer.barrier()
        opt.synchronize()
        gossamer.barrier()
    final = [p.detach().clone() for p in model.parameters()]
    opt.free()
    return seen, final, stepped_in_backward


@pytest.mark.parametrize("world_size", [2, 4])
def test_window_atc_matches_the_serial_algorithm_step_by_step(world_size):
    history, final = serial_atc("adam", world_size)
    got = run_distributed(_window_atc, world_size, args=("adam",), timeout=120)
    for rank, (seen, end, stepped_in_backward) in enumerate(got):
        assert stepped_in_backward == [True] * STEPS
        _assert_follows(rank, seen, end, history, final)


def test_window_atc_refuses_exact_diffusion():
    model = Net(0)
    with pytest.raises(ValueError, match="exact_diffusion=True"):
        optim.WindowAdaptThenCombine(_torch_optimizer("sgd", model), model, exact_diffusion=True)


# ---------------------------------------------------------------- ATC with DCD-PSGD
def serial_atc_dcd(n):
    """ATC whose rounds are DCD with 8-bit differences, per parameter, in one process."""
    c = get_compressor("uint8")
    models = [Net(r) for r in range(n)]
    opts = [_torch_optimizer("sgd", m) for m in models]
    W = _static_weights(n)
    public = [[torch.zeros_like(p) for p in m.parameters()] for m in models]
    history = []
    for step in range(STEPS):
        history.append([[p.detach().clone() for p in m.parameters()] for m in models])
        for rank, (model, opt) in enumerate(zip(models, opts, strict=True)):
            opt.zero_grad()
            _loss(model, *_batch(rank, step)).backward()
            opt.step()
        params = [list(m.parameters()) for m in models]
        for k in range(len(params[0])):
            diffs = [
                params[i][k].detach()
                + sum(W[j, i] * public[j][k] for j in range(n) if j != i and W[j, i] != 0)
                + (W[i, i] - 2) * public[i][k]
                for i in range(n)
            ]
            for i in range(n):
                d = diffs[i].reshape(-1)
                public[i][k] = public[i][k] + c.decompress(c.compress(d)).view_as(d).view_as(
                    public[i][k]
                )
            with torch.no_grad():
                for i in range(n):
                    params[i][k].copy_(public[i][k])
    return history, [[p.detach().clone() for p in m.parameters()] for m in models]


def _atc_dcd():
    rank, n = gossamer.rank(), gossamer.size()
    model = Net(rank)
    opt = optim.AdaptThenCombine(
        _torch_optimizer("sgd", model),
        model,
        topology=topo.exponential_two(n),
        communication="difference_gossip",
        fusion_threshold_bytes=None,  # a bucket per parameter, as the simulation compresses
    )
    seen = []
    model.register_forward_hook(
        lambda m, i, o: seen.append([p.detach().clone() for p in model.parameters()])
    )
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, *_batch(rank, step)).backward()
        opt.step()
    opt.synchronize()
    final = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return seen, final


@pytest.mark.parametrize("world_size", [2, 4])
def test_atc_with_difference_gossip_matches_the_serial_algorithm(world_size):
    history, final = serial_atc_dcd(world_size)
    for rank, (seen, end) in enumerate(run_distributed(_atc_dcd, world_size, timeout=120)):
        _assert_follows(rank, seen, end, history, final, lazy="unused")
