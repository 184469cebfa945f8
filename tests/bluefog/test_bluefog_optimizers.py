"""bf.Distributed*Optimizer on the core optimizers: convergence, knobs, methods, utilities."""

import warnings
from functools import partial

import pytest
import torch
from torch import nn

import gossamer
import gossamer.bluefog as bf
from gossamer import optim
from gossamer import topology as topo
from gossamer.testing import run_distributed
from problems import (
    D,
    least_squares_data,
    least_squares_loss,
    least_squares_optimum,
    linear_model,
    train_least_squares,
)

HIER = {"GOSSAMER_NODES_PER_MACHINE": "2"}


# ---------------------------------------------------------------------- convergence
def _make(kind, base, model):
    C = bf.CommunicationType
    if kind == "awc":
        return bf.DistributedAdaptWithCombineOptimizer(base, model)
    if kind == "awc-allreduce":
        return bf.DistributedAdaptWithCombineOptimizer(base, model, C.allreduce)
    if kind == "atc":
        return bf.DistributedAdaptThenCombineOptimizer(base, model)
    if kind == "atc-hierarchical":
        assert bf.set_machine_topology(bf.ExponentialTwoGraph(bf.machine_size()))
        return bf.DistributedAdaptThenCombineOptimizer(
            base, model, communication_type=C.hierarchical_neighbor_allreduce
        )
    if kind == "gradient-allreduce":
        return bf.DistributedGradientAllreduceOptimizer(base, model)
    if kind == "win-put":
        return bf.DistributedWinPutOptimizer(base, model)
    raise AssertionError(kind)


def _train(kind, steps, lr, decay):
    bf.init()
    model, opt = train_least_squares(partial(_make, kind), steps, lr, decay)
    opt.synchronize()
    if kind == "win-put":
        opt.unregister_window()
    return model.weight.detach().squeeze(0).clone()


CASES = [
    ("awc", 300, 0.3, 10),
    ("awc-allreduce", 300, 0.3, 10),
    ("atc", 300, 0.3, 10),
    ("gradient-allreduce", 100, 0.3, 1e9),
    ("win-put", 300, 0.3, 10),
]


@pytest.mark.parametrize(("kind", "steps", "lr", "decay"), CASES, ids=[c[0] for c in CASES])
def test_optimizers_reach_the_least_squares_optimum(kind, steps, lr, decay):
    optimum = least_squares_optimum(4)
    for weight in run_distributed(_train, 4, args=(kind, steps, lr, decay), timeout=120):
        assert (weight - optimum).norm() / optimum.norm() < 1e-2, kind


# ---------------------------------------------------------------------- dynamic knobs
def _one_peer(kind, steps):
    """BlueFog's per-step one-peer knobs, and the core optimizer with the same schedule."""
    bf.init()
    r, n = bf.rank(), bf.size()
    A, b = least_squares_data(r)
    results = []
    for facade in (True, False):
        model = linear_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
        if facade:
            cls = {
                "awc": bf.DistributedAdaptWithCombineOptimizer,
                "atc": bf.DistributedAdaptThenCombineOptimizer,
            }[kind]
            opt = cls(sgd, model)
            pairs = bf.GetDynamicOnePeerSendRecvRanks(bf.ExponentialTwoGraph(n), r)
        else:
            cls = {"awc": optim.AdaptWithCombine, "atc": optim.AdaptThenCombine}[kind]
            schedule = topo.one_peer_exponential(topo.exponential_two(n), r)
            opt = cls(sgd, model, schedule=schedule)
        for _ in range(steps):
            if facade:  # as BlueFog's examples do, before each forward pass
                send, recv = next(pairs)
                opt.dst_weights = send
                opt.src_weights = {s: 1 / (len(recv) + 1) for s in recv}
                opt.self_weight = 1 / (len(recv) + 1)
                opt.enable_topo_check = True
            opt.zero_grad()
            least_squares_loss(model, A, b).backward()
            opt.step()
        opt.synchronize()
        results.append(model.weight.detach().clone())
    return results


@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_one_peer_knobs_match_the_core_schedule(kind):
    for facade, core in run_distributed(_one_peer, 4, args=(kind, 12)):
        torch.testing.assert_close(facade, core, rtol=1e-14, atol=1e-14)


def _static_weights_and_types():
    """Static knobs (self and src weights alone), and switching communication_type."""
    bf.init()
    r, n = bf.rank(), bf.size()
    bf.set_topology(bf.RingGraph(n))
    C = bf.CommunicationType
    out = {}
    try:
        model = nn.Linear(3, 1, bias=False).double()
        with torch.no_grad():
            model.weight.fill_(float(r))
        opt = bf.DistributedAdaptWithCombineOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.0), model
        )
        out["default_type"] = opt.communication_type
        x = torch.zeros(1, 3, dtype=torch.float64)
        opt.self_weight = 0.5
        opt.src_weights = {(r - 1) % n: 0.5}  # only the left neighbour
        model(x).sum().backward()
        opt.step()
        out["static"] = model.weight.detach().clone()
        opt.self_weight = opt.src_weights = None
        opt.communication_type = "allreduce"  # BlueFog's value string is accepted too
        out["allreduce_type"] = opt.communication_type
        model(x).sum().backward()
        opt.step()
        out["allreduce"] = model.weight.detach().clone()
        opt.communication_type = C.empty
        with torch.no_grad():
            model.weight.fill_(float(r))
        model(x).sum().backward()
        opt.step()
        out["empty"] = model.weight.detach().clone()
        try:
            opt.communication_type = "ring"
        except ValueError:
            out["bad_type"] = True
    finally:
        bf.set_topology()
    return out


def test_static_weight_knobs_and_communication_type():
    n = 4
    for r, out in enumerate(run_distributed(_static_weights_and_types, n)):
        assert out["default_type"] is bf.CommunicationType.neighbor_allreduce
        assert out["allreduce_type"] is bf.CommunicationType.allreduce
        left = (r - 1) % n
        assert torch.equal(out["static"], torch.full((1, 3), 0.5 * r + 0.5 * left).double())
        mean = sum(0.5 * s + 0.5 * ((s - 1) % n) for s in range(n)) / n
        torch.testing.assert_close(out["allreduce"], torch.full((1, 3), mean).double())
        assert torch.equal(out["empty"], torch.full((1, 3), float(r)).double())
        assert out["bad_type"]


# ---------------------------------------------------------------------- methods
def _methods():
    bf.init()
    r = bf.rank()
    out = {}
    A, b = least_squares_data(r)
    # Gradient allreduce: synchronize, clip, then step inside skip_synchronize.
    model = linear_model()
    opt = bf.DistributedGradientAllreduceOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model
    )
    assert opt.param_groups is opt.optimizer.param_groups
    least_squares_loss(model, A, b).backward()
    opt.synchronize()
    out["averaged_grad"] = model.weight.grad.clone()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with opt.skip_synchronize():
            opt.step()  # no second allreduce: the clipped gradient is used
    out["after_clipped_step"] = model.weight.detach().clone()
    # Misuse: skip_synchronize with communication in flight waits anyway, and warns.
    opt.zero_grad()
    least_squares_loss(model, A, b).backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with opt.skip_synchronize():
            opt.step()
    out["misuse_warned"] = any("Unexpected behavior" in str(w.message) for w in caught)
    out["misuse_weight"] = model.weight.detach().clone()
    # state_dict round trip, and loading a plain torch state dict (a BlueFog checkpoint).
    awc_model = linear_model()
    adam = torch.optim.Adam(awc_model.parameters(), lr=0.01)
    awc = bf.DistributedAdaptWithCombineOptimizer(adam, awc_model)
    for _ in range(2):
        awc.zero_grad()
        least_squares_loss(awc_model, A, b).backward()
        awc.step()
    state = awc.state_dict()
    out["steps"] = state["communication"]["steps"]
    plain = adam.state_dict()
    fresh = bf.DistributedAdaptWithCombineOptimizer(
        torch.optim.Adam(awc_model.parameters(), lr=0.5), awc_model
    )
    fresh.load_state_dict(plain)
    out["plain_lr"] = fresh.param_groups[0]["lr"]
    out["plain_step"] = float(fresh.state[awc_model.weight]["step"])
    fresh.load_state_dict(state)
    out["restored_steps"] = fresh.steps
    for hook in awc._hooks + fresh._hooks:
        hook.remove()
    return out


def test_optimizer_methods():
    n = 4
    parts = [least_squares_data(r) for r in range(n)]
    grads = []
    for A, b in parts:
        model = linear_model()
        least_squares_loss(model, A, b).backward()
        grads.append(model.weight.grad)
    mean = sum(grads) / n
    clipped = mean * min(1.0, 1e-3 / (mean.norm().item() + 1e-6))
    got = run_distributed(_methods, n)
    for out in got:
        torch.testing.assert_close(out["averaged_grad"], mean)
        torch.testing.assert_close(out["after_clipped_step"], -0.1 * clipped)
        assert out["misuse_warned"]
        assert out["steps"] == 2 and out["restored_steps"] == 2
        assert out["plain_lr"] == 0.01 and out["plain_step"] == 2.0
        # The misused step waited for the averaged gradient after all.
        assert torch.equal(out["misuse_weight"], got[0]["misuse_weight"])


def _deprecated():
    bf.init()
    model = linear_model()
    out = {}
    for name in (
        "DistributedAllreduceOptimizer",
        "DistributedNeighborAllreduceOptimizer",
        "DistributedHierarchicalNeighborAllreduceOptimizer",
    ):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = getattr(bf, name)(torch.optim.SGD(model.parameters(), lr=0.1), model)
        assert isinstance(opt, bf.DistributedAdaptWithCombineOptimizer)
        kinds = [w.category for w in caught]
        out[name] = (kinds, opt.communication_type, caught[0].filename == __file__)
        opt.close()
    return out


def test_deprecated_optimizers_warn():
    C = bf.CommunicationType
    want = {
        "DistributedAllreduceOptimizer": C.allreduce,
        "DistributedNeighborAllreduceOptimizer": C.neighbor_allreduce,
        "DistributedHierarchicalNeighborAllreduceOptimizer": C.hierarchical_neighbor_allreduce,
    }
    for out in run_distributed(_deprecated, 4):
        for name, (kinds, kind, at_caller) in out.items():
            assert kinds == [PendingDeprecationWarning], name
            assert kind is want[name]
            assert at_caller  # the warning points at the line that made the optimizer


def _win_put_knob():
    """dst_weights names one out-neighbour per step: only it receives the put."""
    bf.init()
    r, n = bf.rank(), bf.size()
    model = nn.Linear(2, 1, bias=False).double()
    with torch.no_grad():
        model.weight.fill_(float(r))
    opt = bf.DistributedWinPutOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.0), model, window_prefix="win."
    )
    opt.force_barrier = True
    try:
        opt.dst_weights = [(r + 1) % n]
        model(torch.zeros(1, 2, dtype=torch.float64)).sum().backward()
        optim.WindowPut.synchronize(opt)  # the core's: wait for this rank's put only
        bf.barrier()  # every put has landed
        versions = opt.windows[0].versions()
        opt.step()  # with a barrier; the puts were waited for, so a local step
        return versions
    finally:
        opt.unregister_window()


def test_win_put_dst_weights_knob():
    n = 4
    # ExponentialGraph(4): the in-neighbours of r are r-1 and r-2; only r-1 put to r.
    for r, versions in enumerate(run_distributed(_win_put_knob, n)):
        assert versions == {(r - 1) % n: 1, (r - 2) % n: 0}


# ---------------------------------------------------------------------- utilities
def _utilities():
    bf.init()
    r = bf.rank()
    torch.manual_seed(r)
    model = nn.Sequential(nn.Linear(3, 2), nn.BatchNorm1d(2))
    model.train()
    model(torch.randn(4, 3))  # batch-norm buffers differ per rank
    bf.broadcast_parameters(model.state_dict(), root_rank=1)
    out = {"state_dict": [t.clone() for t in model.state_dict().values()]}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(r)
    bf.broadcast_parameters(list(model.named_parameters()), 2)
    out["named"] = [p.detach().clone() for p in model.parameters()]
    tensors = [torch.full((2,), float(r)), torch.full((3,), 10.0 * r)]
    bf.broadcast_parameters(tensors, 0)
    out["tensors"] = tensors
    bf.allreduce_parameters(model.state_dict())
    moved = [torch.full((2,), float(r))]
    bf.allreduce_parameters(moved)
    out["averaged"] = moved[0]
    named = [("w", torch.full((2,), 2.0 * r))]
    bf.allreduce_parameters(named)
    out["averaged_named"] = named[0][1]
    # Optimizer state: the facade optimizer and a plain torch optimizer.
    lin = linear_model()
    adam = torch.optim.Adam(lin.parameters(), lr=0.01 * (r + 1))
    if r == 0:
        lin(torch.ones(1, D, dtype=torch.float64)).sum().backward()
        adam.step()  # only the root has state
    opt = bf.DistributedAdaptWithCombineOptimizer(adam, lin)
    bf.broadcast_optimizer_state(opt, root_rank=0)
    out["lr"] = opt.param_groups[0]["lr"]
    out["exp_avg"] = opt.state[lin.weight]["exp_avg"].clone()
    sgd = torch.optim.SGD(lin.parameters(), lr=0.1 * (r + 1), momentum=0.9)
    bf.broadcast_optimizer_state(sgd, 1)
    out["sgd_lr"] = sgd.param_groups[0]["lr"]
    for hook in opt._hooks:
        hook.remove()
    return out


def test_parameter_and_state_utilities():
    n = 4
    got = run_distributed(_utilities, n)
    for r, out in enumerate(got):
        for mine, root in zip(out["state_dict"], got[1]["state_dict"], strict=True):
            assert torch.equal(mine, root)
        for mine, root in zip(out["named"], got[2]["named"], strict=True):
            assert torch.equal(mine, root)
        assert torch.equal(out["tensors"][0], torch.zeros(2))
        assert torch.equal(out["tensors"][1], torch.zeros(3))
        torch.testing.assert_close(out["averaged"], torch.full((2,), 1.5))
        torch.testing.assert_close(out["averaged_named"], torch.full((2,), 3.0))
        assert out["lr"] == pytest.approx(0.01) and out["sgd_lr"] == pytest.approx(0.2)
        assert torch.equal(out["exp_avg"], got[0]["exp_avg"]) and out["exp_avg"].abs().sum() > 0
        assert r in range(n)


# ---------------------------------------------------------------------- machine level
def _train_hierarchical():
    try:
        return _train("atc-hierarchical", 300, 0.3, 10)
    finally:
        gossamer.set_machine_topology(None)


def test_hierarchical_atc_reaches_the_optimum():
    optimum = least_squares_optimum(4)
    for weight in run_distributed(_train_hierarchical, 4, env=HIER, timeout=120):
        assert (weight - optimum).norm() / optimum.norm() < 1e-2


def _machine_one_peer(steps):
    bf.init()
    r, n, local = bf.rank(), bf.size(), bf.local_size()
    A, b = least_squares_data(r)
    results = []
    for facade in (True, False):
        model = linear_model()
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        if facade:
            opt = bf.DistributedAdaptWithCombineOptimizer(
                sgd, model, bf.CommunicationType.hierarchical_neighbor_allreduce
            )
            pairs = bf.GetExp2DynamicSendRecvMachineRanks(n, local, r, bf.local_rank())
        else:
            schedule = topo.machine_exponential_two(n, local, r)
            opt = optim.AdaptWithCombine(
                sgd, model, communication="hierarchical_neighbor_allreduce", schedule=schedule
            )
        for _ in range(steps):
            if facade:
                send, recv = next(pairs)
                opt.dst_machine_weights = send
                opt.src_machine_weights = {m: 1 / (len(recv) + 1) for m in recv}
                opt.self_weight = 1 / (len(recv) + 1)
            opt.zero_grad()
            least_squares_loss(model, A, b).backward()
            opt.step()
        results.append(model.weight.detach().clone())
    return results


def test_machine_knobs_match_the_core_schedule():
    for facade, core in run_distributed(_machine_one_peer, 4, args=(8,), env=HIER):
        torch.testing.assert_close(facade, core, rtol=1e-14, atol=1e-14)


def _atc_after_a_failed_round():
    bf.init()
    model = nn.Linear(3, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = bf.DistributedAdaptThenCombineOptimizer(sgd, model)

    def step():
        opt.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
        opt.synchronize()

    opt.self_weight = 0.5  # without src_weights: the round fails in backward
    with pytest.raises(ValueError, match="self_weight and src_weights must be given together"):
        step()
    opt.src_weights = {1 - bf.rank(): 0.5}
    step()  # a new step, not "the gradient arrived twice"
    opt.close()
    return True


def test_atc_trains_on_after_a_round_that_failed():
    assert run_distributed(_atc_after_a_failed_round, 2) == [True, True]


# ---------------------------------------------------------------------- local aggregation
def _local_aggregation(kind, passes, steps, J, resume_at=None):
    """``passes`` mini-batches (each loss / passes) before every step(), BlueFog's FAQ.

    With ``resume_at``, the optimizer is rebuilt from its ``state_dict()`` after that step.
    """
    bf.init()
    A, b = least_squares_data(bf.rank())
    model = linear_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    C = bf.CommunicationType
    make = {
        "awc": lambda: bf.DistributedAdaptWithCombineOptimizer(base, model, C.allreduce, J),
        "atc": lambda: bf.DistributedAdaptThenCombineOptimizer(base, model, C.allreduce, J),
        "win-put": lambda: bf.DistributedWinPutOptimizer(base, model, J),
    }[kind]
    opt = make()
    for step in range(steps):
        if step == resume_at:
            state = opt.state_dict()
            opt.close()
            opt = make()
            opt.load_state_dict(state)
        opt.zero_grad()
        for A_part, b_part in zip(A.chunk(passes), b.chunk(passes), strict=True):
            (least_squares_loss(model, A_part, b_part) / passes).backward()
        opt.step()
    opt.synchronize()
    rounds = opt.communicator.rounds
    if kind == "win-put":
        opt.unregister_window()
    return rounds, model.weight.detach().squeeze(0).clone()


def _simulated(kind, n, passes, steps, J):
    """The same training of n ranks in one process: x <- mean(x) on communicating steps."""
    data = [least_squares_data(r) for r in range(n)]
    xs = [torch.zeros(D, dtype=torch.float64) for _ in range(n)]
    count = 0
    for _ in range(steps):
        count += passes
        grads = []
        for x, (A, b) in zip(xs, data, strict=True):
            parts = zip(A.chunk(passes), b.chunk(passes), strict=True)
            grads.append(sum(a.T @ (a @ x - c) / len(c) for a, c in parts) / passes)
        if count < J:
            xs = [x - 0.1 * g for x, g in zip(xs, grads, strict=True)]
            continue
        count = 0
        if kind == "awc":  # combine the point the gradient was taken at, then step
            mean = sum(xs) / n
            xs = [mean - 0.1 * g for g in grads]
        else:  # atc: step, then combine
            stepped = [x - 0.1 * g for x, g in zip(xs, grads, strict=True)]
            xs = [sum(stepped) / n] * n
    return xs


@pytest.mark.parametrize(("n", "passes", "J"), [(2, 3, 3), (3, 2, 2), (2, 1, 2), (3, 2, 4)])
@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_local_aggregation_communicates_once_per_J_passes(kind, n, passes, J):
    steps = 6
    got = run_distributed(partial(_local_aggregation, kind, passes, steps, J), n)
    expected = _simulated(kind, n, passes, steps, J)
    for r, (rounds, weight) in enumerate(got):
        assert rounds == steps * passes // J
        torch.testing.assert_close(weight, expected[r])


@pytest.mark.parametrize(("passes", "J"), [(3, 3), (1, 2)])
def test_local_aggregation_of_win_put_counts_forward_passes(passes, J):
    for rounds, _ in run_distributed(partial(_local_aggregation, "win-put", passes, 6, J), 2):
        assert rounds == 6 * passes // J


@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_local_aggregation_resumes_mid_period(kind):
    # 2 passes per step, J = 4: a round every 2nd step; the state is taken between them
    reference = run_distributed(partial(_local_aggregation, kind, 2, 5, 4), 2)
    resumed = run_distributed(partial(_local_aggregation, kind, 2, 5, 4, resume_at=3), 2)
    for (_, expected), (_, got) in zip(reference, resumed, strict=True):
        assert torch.equal(got, expected)


def _atc_passes_over_two_heads(J, passes, heads_of_rank):
    """ATC on a model of two heads, each backward pass reaching one head only."""
    bf.init()
    torch.manual_seed(0)
    heads = nn.ModuleList([nn.Linear(3, 1), nn.Linear(3, 1)])
    opt = bf.DistributedAdaptThenCombineOptimizer(
        torch.optim.SGD(heads.parameters(), lr=0.1), heads, bf.CommunicationType.allreduce, J
    )
    pattern = heads_of_rank[bf.rank()]
    try:
        for _ in range(3):
            opt.zero_grad()
            for k in range(passes):
                heads[pattern[k % len(pattern)]](torch.ones(2, 3)).sum().backward()
            opt.step()
    except RuntimeError as err:
        return str(err)
    return opt.communicator.rounds


def test_atc_counts_every_backward_pass_whatever_it_reaches():
    # rank 0 reaches head 0 twice, rank 1 head 0 then head 1: both count 2 passes a step
    got = run_distributed(partial(_atc_passes_over_two_heads, 2, 2, [[0, 0], [0, 1]]), 2)
    assert got == [3, 3]


def test_atc_refuses_a_backward_pass_after_the_one_that_communicated():
    # 2 passes a step, J = 3: the round is taken in the first pass of the second step
    got = run_distributed(partial(_atc_passes_over_two_heads, 3, 2, [[0], [0]]), 2)
    assert all("backward pass 4 since the last communication" in text for text in got)
    assert all("passes per step() that divides 3" in text for text in got)
