"""Exact resume: N + M steps equal N steps, save, a new job, load, M steps, bit for bit.

Every optimizer (core and BlueFog facade; static graph and one-peer schedule) runs on 4 ranks
in one pooled call (process start dominates on 2 cores). Per case: a reference of N + M
steps; a job of N steps that saves and frees its windows; a new job (new model with another
initialization, new optimizer, new windows) that loads and takes M steps. A control then
resumes with one piece of the saved state undone, and must *not* match: that piece matters,
so the exact match is not luck.
"""

import json

import pytest
import torch
from sampling import RandomShift
from torch import nn

import gossamer
import gossamer.bluefog as bf
from gossamer import checkpoint, optim
from gossamer import topology as topo
from gossamer.testing import run_distributed

N, M = 3, 3  # odd N: resume in the middle of the one-peer cycle and of every-2 periods
SEED = 10


class Net(nn.Module):
    """Dropout makes the resumed run depend on the saved random generator too."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(5, 8)
        self.drop = nn.Dropout(0.25)
        self.out = nn.Linear(8, 1)

    def forward(self, x):
        return self.out(torch.tanh(self.drop(self.hidden(x)))).squeeze(1)


def _one_peer():
    return topo.one_peer_exponential(topo.exponential_two(gossamer.size()), gossamer.rank())


def _sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.01)


def _probe_score(model):
    """A smooth stand-in for an accuracy: losses stay below the threshold, periods grow."""
    x = torch.randn(16, 5, generator=torch.Generator().manual_seed(gossamer.rank()))
    return 0.5 + 0.01 * float(torch.tanh(model(x)).mean())


def _skewscout(model):
    atc = optim.AdaptThenCombine(_sgd(model), model)
    controller = optim.PeriodController(max_period=4)
    return optim.SkewScout(atc, _probe_score, controller=controller, probe_every=2)


def _cocofl(model):
    constrained = gossamer.rank() % 2 == 1
    return optim.CoCoFL(
        _adam(model),
        model,
        frozen=["hidden"],
        constrained=constrained,
        num_steps_per_communication=2,
    )


SMALL = {"fusion_threshold_bytes": 128}  # several buckets: per-bucket state is exercised
# name: (build(model) -> optimizer, protocol)
CASES = {
    "awc": (lambda m: optim.AdaptWithCombine(_sgd(m), m, **SMALL), "sync"),
    "awc-one-peer": (lambda m: optim.AdaptWithCombine(_adam(m), m, schedule=_one_peer()), "sync"),
    "awc-every-2": (
        lambda m: optim.AdaptWithCombine(_sgd(m), m, num_steps_per_communication=2),
        "sync",
    ),
    "awc-random-shift": (
        lambda m: optim.AdaptWithCombine(_sgd(m), m, communicator=RandomShift(7)),
        "sync",
    ),
    "atc": (lambda m: optim.AdaptThenCombine(_adam(m), m, **SMALL), "sync"),
    "atc-one-peer": (lambda m: optim.AdaptThenCombine(_sgd(m), m, schedule=_one_peer()), "sync"),
    "atc-global-average-2": (
        lambda m: optim.AdaptThenCombine(_sgd(m), m, global_average_every=2),
        "sync",
    ),
    "atc-exact": (
        lambda m: optim.AdaptThenCombine(_sgd(m), m, exact_diffusion=True, **SMALL),
        "sync",
    ),
    "atc-exact-one-peer": (
        lambda m: optim.AdaptThenCombine(_sgd(m), m, exact_diffusion=True, schedule=_one_peer()),
        "sync",
    ),
    "atc-difference-gossip": (
        lambda m: optim.AdaptThenCombine(_sgd(m), m, communication="difference_gossip", **SMALL),
        "sync",
    ),
    "gradient-allreduce": (lambda m: optim.GradientAllreduce(_adam(m), m, **SMALL), "sync"),
    "gradient-allreduce-topk": (
        lambda m: optim.GradientAllreduce(_sgd(m), m, compression="topk:0.3", **SMALL),
        "sync",
    ),
    "awc-choco-uint8": (
        lambda m: optim.AdaptWithCombine(_sgd(m), m, compression="uint8", **SMALL),
        "sync",
    ),
    "atc-choco-one-peer": (
        lambda m: optim.AdaptThenCombine(_sgd(m), m, compression="topk:0.3", schedule=_one_peer()),
        "sync",
    ),
    "win-put": (lambda m: optim.WindowPut(_sgd(m), m, **SMALL), "win-put"),
    "win-put-randomk": (  # one random-k stream per window (bucket)
        lambda m: optim.WindowPut(_sgd(m), m, compression="randomk:0.3", **SMALL),
        "win-put",
    ),
    "ngc-qsgd": (  # CompNGC with an unbiased compressor: no error feedback holds its stream
        lambda m: optim.NGC(
            _sgd(m), m, topology=topo.ring(gossamer.size()), compression="qsgd:8", **SMALL
        ),
        "closure",
    ),
    "win-put-one-peer": (lambda m: optim.WindowPut(_sgd(m), m, schedule=_one_peer()), "win-put"),
    "push-sum": (lambda m: optim.PushSum(_sgd(m), m, **SMALL), "push-sum"),
    "push-sum-one-peer": (lambda m: optim.PushSum(_sgd(m), m, schedule=_one_peer()), "push-sum"),
    "skewscout": (_skewscout, "sync"),  # probes at steps 2, 4, 6: the period grows
    "cocofl": (_cocofl, "sync"),  # quantized frozen layers, masked averaging every 2
    "bf-awc": (lambda m: bf.DistributedAdaptWithCombineOptimizer(_sgd(m), m), "sync"),
    "bf-awc-one-peer-knobs": (
        lambda m: bf.DistributedAdaptWithCombineOptimizer(_adam(m), m),
        "knobs",
    ),
    "bf-atc": (lambda m: bf.DistributedAdaptThenCombineOptimizer(_adam(m), m), "sync"),
    "bf-gradient-allreduce": (
        lambda m: bf.DistributedGradientAllreduceOptimizer(_sgd(m), m),
        "sync",
    ),
    "bf-win-put": (lambda m: bf.DistributedWinPutOptimizer(_sgd(m), m), "win-put"),
}


def _edit(**changes):
    """A control that reloads the optimizer's state with some communication entries replaced."""

    def control(opt):
        state = opt.state_dict()
        for key, change in changes.items():
            state["communication"][key] = change(state["communication"][key])
        opt.load_state_dict(state)

    return control


def _zero_slots(slots):
    return [{s: torch.zeros_like(b) for s, b in window.items()} for window in slots]


def _first_period(state):
    state["skewscout"]["controller"] = {"period": 1}
    return state


def _restart_schedule(opt):
    opt.communicator.schedule, opt.communicator.schedule_steps = _one_peer(), 0


# name: what the control undoes after loading
CONTROLS = {
    "awc": lambda opt: torch.manual_seed(12345),  # the dropout masks' generator
    "awc-one-peer": _restart_schedule,
    "awc-every-2": _edit(steps=lambda steps: 0),
    "awc-random-shift": lambda opt: opt.communicator.generator.manual_seed(7),
    "atc-global-average-2": _edit(rounds=lambda rounds: 0),
    "atc-exact": _edit(psi_prev=lambda psi: {}),
    "atc-difference-gossip": _edit(replicas=lambda r: {}),
    "gradient-allreduce-topk": _edit(feedback=lambda f: {**f, "residuals": {}}),
    "awc-choco-uint8": _edit(copies=lambda c: {}),
    "atc-choco-one-peer": _edit(copies=lambda c: {}),
    "win-put-one-peer": _edit(buffers=_zero_slots),
    "ngc-qsgd": _edit(compressor=lambda c: {**c, "step": 0}),
    "skewscout": lambda opt: opt.load_state_dict(_first_period(opt.state_dict())),
    "cocofl": lambda opt: setattr(opt, "steps", 0),
    "push-sum": _edit(
        buffers=_zero_slots, p_buffers=lambda ps: [dict.fromkeys(p, 0.0) for p in ps]
    ),
}


def _batch(rank, k):
    g = torch.Generator().manual_seed(1000 * rank + k)
    return torch.randn(16, 5, generator=g), torch.randn(16, generator=g)


def _train(model, opt, protocol, first, steps, knobs):
    r, n = gossamer.rank(), gossamer.size()
    for k in range(first, first + steps):
        if protocol == "knobs":  # BlueFog's one-peer pattern: knobs set before each forward
            send, recv = next(knobs)
            opt.dst_weights = send
            opt.src_weights = {s: 1 / (len(recv) + 1) for s in recv}
            opt.self_weight = 1 / (len(recv) + 1)
        x, y = _batch(r, k)
        opt.zero_grad()
        if protocol == "push-sum":
            # A push-sum step pushes into neighbours' slots (from the backward pass, bucket
            # by bucket) and collects its own at step(): ranks take whole steps in turn, so
            # each collect sees a fixed set of arrivals.
            for turn in range(n):
                if turn == r:
                    ((model(x) - y) ** 2).mean().backward()
                    opt.step()
                gossamer.barrier()
            continue
        if protocol == "closure":
            opt.step(lambda x=x, y=y: ((model(x) - y) ** 2).mean())
            continue
        ((model(x) - y) ** 2).mean().backward()
        if protocol == "win-put":
            # Asynchronous: a combine reads whatever puts have landed, so timing decides the
            # result. Every rank's put lands (wait_puts) before any rank combines (barrier),
            # and no put of the next round lands before every combine is done (barrier).
            opt.wait_puts()
            gossamer.barrier()
            opt.step()
            gossamer.barrier()
        else:
            opt.step()


def _knobs():
    n, r = gossamer.size(), gossamer.rank()
    return bf.GetDynamicOnePeerSendRecvRanks(bf.ExponentialTwoGraph(n), r)


def _job(name, seed):
    torch.manual_seed(seed + gossamer.rank())  # every rank its own model, as in real use
    model = Net()
    return model, CASES[name][0](model)


def _finish(model, opt):
    opt.close()  # lands ATC's last combine, frees windows, removes hooks
    return [p.detach().clone() for p in model.parameters()]


def _resumed(name, root, control=None):
    """A new job: new model (another initialization) and optimizer, load, M steps."""
    model, opt = _job(name, SEED + 100)
    extra = checkpoint.load(f"{root}/{name}", model, opt)
    knobs = _knobs()
    for _ in range(extra["knobs_taken"]):
        next(knobs)
    if control is not None:
        control(opt)
        gossamer.barrier()  # undone before any neighbour puts again
    _train(model, opt, CASES[name][1], extra["step"], M, knobs)
    return _finish(model, opt)


def _same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _resume(names, root, controls=True):
    bf.init()
    gossamer.set_topology(topo.exponential_two(gossamer.size()))
    results = {}
    for name in names:
        protocol = CASES[name][1]
        model, opt = _job(name, SEED)
        _train(model, opt, protocol, 0, N + M, _knobs())
        reference = _finish(model, opt)

        model, opt = _job(name, SEED)
        _train(model, opt, protocol, 0, N, _knobs())
        checkpoint.save(f"{root}/{name}", model, opt, extra={"step": N, "knobs_taken": N})
        _finish(model, opt)

        got = _resumed(name, root)
        control_differs = None
        if controls and name in CONTROLS:
            control_differs = not _same(reference, _resumed(name, root, CONTROLS[name]))
        diff = max(float((a - b).abs().max()) for a, b in zip(reference, got, strict=True))
        results[name] = {
            "exact": _same(reference, got),
            "max_diff": diff,
            "control_differs": control_differs,
        }
    return results


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    root = tmp_path_factory.mktemp("resume")
    return root, run_distributed(_resume, 4, args=(list(CASES), str(root)), timeout=240)


@pytest.mark.parametrize("world_size", [2, 3])
def test_resume_of_streams_and_wrappers_is_bit_exact_on_other_sizes(tmp_path, world_size):
    names = ["win-put-randomk", "ngc-qsgd", "skewscout", "cocofl"]
    for results in run_distributed(_resume, world_size, args=(names, str(tmp_path)), timeout=240):
        for name in names:
            assert results[name]["exact"], (name, results[name]["max_diff"])


@pytest.mark.parametrize("name", list(CASES))
def test_resume_is_bit_exact(resumed, name):
    for rank, results in enumerate(resumed[1]):
        got = results[name]
        assert got["exact"], f"rank {rank}: resumed parameters differ by {got['max_diff']}"


@pytest.mark.parametrize("name", list(CONTROLS))
def test_resume_without_this_state_differs(resumed, name):
    # If this passes on no rank, the state undone here never mattered to the run.
    assert any(results[name]["control_differs"] for results in resumed[1])


def test_manifest_lists_every_rank(resumed):
    manifest = json.loads((resumed[0] / "push-sum" / checkpoint.MANIFEST).read_text())
    assert manifest["world_size"] == 4 and manifest["step"] == N
    assert [f["file"] for f in manifest["files"]] == [f"rank{r}.pt" for r in range(4)]
    assert all(len(f["sha256"]) == 64 and f["bytes"] > 0 for f in manifest["files"])
