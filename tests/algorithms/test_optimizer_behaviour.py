import warnings

import pytest
import torch
from torch import nn

import gossamer
from gossamer import communicators, ops, optim
from gossamer.testing import run_distributed
from problems import (
    least_squares_data,
    least_squares_loss,
    least_squares_optimum,
    linear_model,
    train_least_squares,
)


class Awkward(nn.Module):
    """A layer called twice, an unused layer, a frozen layer, and a float64 parameter."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.shared = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 1).double()

    def forward(self, x):
        h = torch.tanh(self.shared(torch.tanh(self.shared(self.frozen(x)))))
        return self.head(h.double()).squeeze(1)


def _data(rank, n=8):
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(n, 4, generator=g), torch.randn(n, generator=g, dtype=torch.float64)


def _awkward_sgd(model):
    """Two parameter groups, each mixing used and unused (or frozen) parameters."""
    groups = [
        {"params": list(model.shared.parameters()) + list(model.unused.parameters())},
        {"params": list(model.head.parameters()) + list(model.frozen.parameters()), "lr": 0.05},
    ]
    return torch.optim.SGD(groups, lr=0.1, momentum=0.9)


def _awkward_optimizer(model, kind):
    sgd = _awkward_sgd(model)
    if kind == "gradient-allreduce":
        return optim.GradientAllreduce(sgd, model, fusion_threshold_bytes=64)
    if kind == "awc":
        return optim.AdaptWithCombine(sgd, model, fusion_threshold_bytes=64)
    return optim.AdaptThenCombine(sgd, model, fusion_threshold_bytes=64)


def _train_awkward(kind, steps, accumulate):
    warnings.simplefilter("error")  # no false warnings
    model = Awkward()
    opt = _awkward_optimizer(model, kind)
    x, y = _data(gossamer.rank())
    for _ in range(steps):
        opt.zero_grad()
        if accumulate:  # two half batches, the first without communication
            with opt.no_sync():
                ((model(x[:4]) - y[:4]) ** 2).mean().backward()
            ((model(x[4:]) - y[4:]) ** 2).mean().backward()
        else:
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
    opt.synchronize()
    warnings.resetwarnings()
    return {k: v.clone() for k, v in model.state_dict().items()}


def _centralized_reference(world_size, steps, accumulate):
    """One process: gradient of the mean of the ranks' losses, same optimizer."""
    model = Awkward()
    sgd = _awkward_sgd(model)
    data = [_data(r) for r in range(world_size)]
    for _ in range(steps):
        sgd.zero_grad()
        for x, y in data:
            if accumulate:
                ((model(x[:4]) - y[:4]) ** 2).mean().div(world_size).backward()
                ((model(x[4:]) - y[4:]) ** 2).mean().div(world_size).backward()
            else:
                ((model(x) - y) ** 2).mean().div(world_size).backward()
        sgd.step()
    return model.state_dict()


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("world_size", [1, 3])
def test_gradient_allreduce_matches_centralized_training_on_an_awkward_model(
    world_size, accumulate
):
    got = run_distributed(_train_awkward, world_size, args=("gradient-allreduce", 5, accumulate))
    reference = _centralized_reference(world_size, 5, accumulate)
    for state in got:
        for name, value in reference.items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_neighbour_optimizers_run_on_an_awkward_model(kind):
    got = run_distributed(_train_awkward, 4, args=(kind, 5, False))
    for state in got:
        assert torch.equal(state["frozen.weight"], Awkward().frozen.weight)
        assert all(torch.isfinite(v).all() for v in state.values())


def _fusion(threshold, kind):
    torch.manual_seed(1)
    model = nn.Sequential(
        nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 1)
    )
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    cls = optim.AdaptWithCombine if kind == "awc" else optim.AdaptThenCombine
    opt = cls(sgd, model, fusion_threshold_bytes=threshold)
    return len(opt.buckets), _regress(model, opt, 10)


def _regress(model, opt, steps):
    """``steps`` of least squares on this rank's data; the parameters after them."""
    g = torch.Generator().manual_seed(gossamer.rank())
    x, y = torch.randn(32, 6, generator=g), torch.randn(32, 1, generator=g)
    for _ in range(steps):
        opt.zero_grad()
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_fusion_on_and_off_give_the_same_result(kind):
    fused = run_distributed(_fusion, 4, args=(8 * 2**20, kind))
    apart = run_distributed(_fusion, 4, args=(None, kind))
    assert fused[0][0] == 1 and apart[0][0] == 6
    for (_, a), (_, b) in zip(fused, apart, strict=True):
        for pa, pb in zip(a, b, strict=True):
            torch.testing.assert_close(pa, pb, rtol=1e-6, atol=1e-7)


def _in_buckets(kind, compression, adopt):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 1))
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    cls = optim.AdaptWithCombine if kind == "awc" else optim.AdaptThenCombine
    cls = type("Variant", (cls,), {"params_in_buckets": adopt})
    opt = cls(sgd, model, compression=compression, fusion_threshold_bytes=256)
    views = {p: v for b in opt.buckets for p, v in zip(b.tensors, b.views, strict=True)}
    trained = _regress(model, opt, 6)
    return [p.data_ptr() == views[p].data_ptr() for p in model.parameters()], trained


@pytest.mark.parametrize("compression", [None, "uint8"])
@pytest.mark.parametrize("kind", ["awc", "atc"])
def test_parameters_live_in_the_buckets_and_train_as_when_copied(kind, compression):
    # Adopted parameters are read by the rounds and written by the combines in place; the
    # same steps with the parameters copied into and out of the buckets are the reference.
    inside = run_distributed(_in_buckets, 3, args=(kind, compression, True))
    copied = run_distributed(_in_buckets, 3, args=(kind, compression, False))
    for (where, a), (elsewhere, b) in zip(inside, copied, strict=True):
        assert all(where) and not any(elsewhere)
        for pa, pb in zip(a, b, strict=True):
            assert torch.equal(pa, pb)


def _asynchronous(kind, steps, slow_rank, flags):
    import os
    import time

    def slow_down(k, opt, model):
        if gossamer.rank() == slow_rank:
            time.sleep(0.003)
        if k + 1 == steps:
            open(os.path.join(flags, str(gossamer.rank())), "w").close()

    def others_still_training():
        return len(os.listdir(flags)) < gossamer.size()

    cls = optim.PushSum if kind == "push-sum" else optim.WindowPut
    model, opt = train_least_squares(cls, steps, 0.2, 10, slow_down, others_still_training)
    gossamer.barrier()
    opt.free()
    return model.weight.detach().squeeze(0).clone()


@pytest.mark.parametrize("kind", ["push-sum", "window-put"])
def test_asynchronous_optimizers_converge_with_a_slow_rank(kind, tmp_path):
    # Fast ranks take more steps: each trains on until every rank has taken 300, so that
    # the slow one never trains alone (it would drift toward its own optimum).
    got = run_distributed(_asynchronous, 4, args=(kind, 300, 2, str(tmp_path)), timeout=240)
    optimum = least_squares_optimum(4)
    # Asynchrony with one slow rank leaves a small bias (see PushSum's docstring); no
    # averaging leaves 5-10 % (each rank's own optimum).
    for weight in got:
        assert (weight - optimum).norm() / optimum.norm() < 2e-2


def _races_ahead(rounds):
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    opt = optim.PushSum(torch.optim.SGD(model.parameters(), lr=0.0), model)
    z = [p.detach().clone() for p in model.parameters()]
    if gossamer.rank() == 0:  # the other rank does not step at all
        for _ in range(rounds):
            opt.zero_grad()
            model(torch.ones(1, 3)).sum().backward()
            opt.step()
        opt.synchronize()
    gossamer.barrier()
    window = opt.communicator.windows[0]
    weight = window.p
    mass = weight + sum(window.p_buffers().values())
    total = ops.allreduce(torch.tensor([mass], dtype=torch.float64), average=False)
    same = all(torch.equal(a, b) for a, b in zip(z, model.parameters(), strict=True))
    gossamer.barrier()
    opt.free()
    return weight, float(total[0]), same


def test_a_rank_racing_ahead_keeps_a_push_sum_weight_and_the_mass_is_conserved():
    # Rank 0 pushes half its mass per round and gets nothing back: without the floor its
    # weight would be 2**-60 after 60 rounds; the rank keeps its mass below min_weight.
    (p0, total, same0), (p1, _, same1) = run_distributed(_races_ahead, 2, args=(60,))
    floor = optim.PushSum.gossip.min_weight
    assert floor / 2 <= p0 < floor and p1 == 1.0
    assert total == pytest.approx(2.0, abs=1e-12)
    assert same0 and same1  # lr 0, the same start: the estimate z = x / p never moves


def _state_round_trip():
    model = linear_model()
    opt = optim.AdaptThenCombine(torch.optim.Adam(model.parameters(), lr=0.01), model)
    A, b = least_squares_data(gossamer.rank())
    for _ in range(3):
        opt.zero_grad()
        least_squares_loss(model, A, b).backward()
        opt.step()
    state = opt.state_dict()
    other = linear_model()
    fresh = optim.AdaptThenCombine(torch.optim.Adam(other.parameters(), lr=0.01), other)
    fresh.load_state_dict(state)
    return state["communication"], fresh.steps, fresh.communicator.rounds


def test_state_dict_carries_the_counters():
    for comm, steps, rounds in run_distributed(_state_round_trip, 2):
        assert comm["steps"] == comm["rounds"] == 3 and (steps, rounds) == (3, 3)


def _bad_arguments():
    model = linear_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    cases = [
        (TypeError, "torch.optim.Optimizer", lambda: optim.AdaptWithCombine("sgd", model)),
        (TypeError, "nn.Module", lambda: optim.AdaptWithCombine(sgd, "model")),
        (ValueError, "not in the model", lambda: optim.AdaptWithCombine(other, model)),
        (
            ValueError,
            "num_steps_per_communication",
            lambda: optim.AdaptWithCombine(sgd, model, num_steps_per_communication=0),
        ),
        (
            ValueError,
            "communication must be one of",
            lambda: optim.AdaptWithCombine(sgd, model, communication="gossip"),
        ),
        (
            ValueError,
            "global_average_every",
            lambda: optim.AdaptWithCombine(sgd, model, global_average_every=0),
        ),
        (
            TypeError,
            "schedule must be an iterator",
            lambda: optim.AdaptWithCombine(sgd, model, schedule=[1, 2]),
        ),
        (
            ValueError,
            "threshold_bytes",
            lambda: optim.AdaptWithCombine(sgd, model, fusion_threshold_bytes=-1),
        ),
        (
            ValueError,
            r"Allreduce\(in_place=True\) writes into its input .* AdaptWithCombine keeps",
            lambda: optim.AdaptWithCombine(
                sgd, model, communicator=communicators.Allreduce(in_place=True)
            ),
        ),
        (
            ValueError,
            "exact_diffusion needs",
            lambda: optim.AdaptThenCombine(
                sgd, model, exact_diffusion=True, num_steps_per_communication=2
            ),
        ),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    return True


def test_bad_arguments_are_rejected():
    assert all(run_distributed(_bad_arguments, 2))


def _train_once(opt, model):
    x, y = _data(0)  # the same on every rank: averaging identical models moves nothing
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _lifecycle(kind):
    make = {"atc": optim.AdaptThenCombine, "awc": optim.AdaptWithCombine}.get(
        kind, optim.GradientAllreduce
    )
    model = Awkward()
    old = make(torch.optim.SGD(model.parameters(), lr=0.1), model)
    _train_once(old, model)
    with pytest.warns(UserWarning, match=r"still drove parameters of this model; it is closed"):
        new = make(torch.optim.SGD(model.parameters(), lr=0.0), model)
    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(2):  # the first optimizer's hooks, lr 0.1, would move them
        _train_once(new, model)
    moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)]
    with pytest.raises(RuntimeError, match=f"{type(old).__name__} was closed"):
        old.step()
    model.frozen.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"\['frozen.weight', 'frozen.bias'\] had requires_g"):
        new.step()
    new.close()
    model.frozen.requires_grad_(False)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = make(sgd, model)
    sgd.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    with pytest.raises(RuntimeError, match=r"has 9 parameters, 8 when .* built \(add_param_group"):
        opt.step()
    opt.close()
    return any(moved)


@pytest.mark.parametrize("kind", ["atc", "awc", "gradient_allreduce"])
def test_a_new_optimizer_takes_over_and_a_changed_parameter_set_is_refused(kind):
    assert run_distributed(_lifecycle, 2, args=(kind,)) == [False, False]


def _gradient_allreduce_misuse():
    model = nn.Embedding(5, 3, sparse=True)
    with pytest.raises(TypeError, match=r"model must be an nn.Module .*; got None"):
        optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), None)
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), model)
    with pytest.raises(TypeError, match=r"'weight' got a sparse one"):
        model(torch.tensor([1, 2])).sum().backward()
    opt.close()
    model = nn.Linear(3, 1)
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model(torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'(weight|bias)' arrived 2 times before step\(\)"):
        model(torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.close()
    return True


def test_gradient_allreduce_refuses_sparse_gradients_and_a_pass_after_its_allreduce():
    assert run_distributed(_gradient_allreduce_misuse, 2) == [True, True]


def _second_pass_with_an_unused_parameter():
    # One bucket that waits for a parameter no pass reaches: it never starts in backward.
    model = nn.ModuleDict({"used": nn.Linear(3, 1), "unused": nn.Linear(3, 1)})
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model["used"](torch.ones(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"'used\.(weight|bias)' arrived 2 times before step"):
        model["used"](torch.ones(2, 3)).sum().backward()
    opt.step()
    opt.close()
    return True


def test_gradient_allreduce_refuses_a_second_pass_whatever_the_bucket_layout():
    assert run_distributed(_second_pass_with_an_unused_parameter, 2) == [True, True]


_CLOSURE_KINDS = {
    "awc": optim.AdaptWithCombine,
    "atc": optim.AdaptThenCombine,
    "gradient_allreduce": optim.GradientAllreduce,
    "bluefog_awc": "DistributedAdaptWithCombineOptimizer",
    "bluefog_atc": "DistributedAdaptThenCombineOptimizer",
}


def _with_closure(kind, closure, steps=3):
    import gossamer.bluefog as bf

    cls = _CLOSURE_KINDS[kind]
    cls = getattr(bf, cls) if isinstance(cls, str) else cls
    model = linear_model()
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model)
    A, b = least_squares_data(gossamer.rank())
    losses = []
    for _ in range(steps):

        def loss_of():
            opt.zero_grad()
            loss = least_squares_loss(model, A, b)
            loss.backward()
            return loss

        if closure:
            losses.append(float(opt.step(loss_of)))
        else:
            losses.append(float(loss_of()))
            opt.step()
        assert not getattr(opt, "step_in_progress", False)
    opt.close()
    return model.weight.detach().clone(), losses


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", sorted(_CLOSURE_KINDS))
def test_a_closure_steps_as_a_forward_and_backward_before_step(world_size, kind):
    """step(closure) is the plain step, bit for bit, and returns the closure's loss.

    Before, AWC ran the closure after writing the combine (its forward started a round
    while the local step changed the parameters), the BlueFog ATC counted the closure's
    pass after deciding the step was local, and ATC and gradient allreduce refused it.
    """
    with_closure = run_distributed(_with_closure, world_size, args=(kind, True))
    plain = run_distributed(_with_closure, world_size, args=(kind, False))
    for (w, losses), (w_ref, losses_ref) in zip(with_closure, plain, strict=True):
        assert torch.equal(w, w_ref)
        assert losses == losses_ref


def _two_models():
    torch.manual_seed(0)
    enc, dec = nn.Linear(3, 4), nn.Linear(4, 1)
    params = [*enc.parameters(), *dec.parameters()]
    opt = optim.AdaptWithCombine(torch.optim.SGD(params, lr=0.1), [enc, dec])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            dec(enc(torch.ones(2, 3))).sum().backward()
            opt.step()
        first = [str(w.message) for w in caught]
        dec(enc(torch.ones(2, 3)))
        dec(enc(torch.ones(2, 3)))  # the same model twice: a second forward
    opt.step()
    opt.close()
    return first, [str(w.message) for w in caught]


def test_a_list_of_models_run_once_each_is_one_forward():
    for first, after in run_distributed(_two_models, 2):
        assert first == []
        assert any("ran forward more than once" in w for w in after), after


def _awc_through_submodules():
    model = nn.ModuleDict({"enc": nn.Linear(3, 4), "head": nn.Linear(4, 1)})
    opt = optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model["head"](model["enc"](torch.ones(2, 3))).sum().backward()  # not model's forward
    with pytest.warns(UserWarning, match="no training-mode forward of the wrapped model"):
        opt.step()
    opt.close()
    return opt.communicator.rounds


def test_awc_warns_when_no_forward_of_its_model_started_a_round():
    assert run_distributed(_awc_through_submodules, 2) == [0, 0]


def _failed_constructor():
    model = Awkward()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    for bad in ({"exact_diffusion": 1}, {"send_order": "sideways"}):
        with pytest.raises((TypeError, ValueError)):
            optim.AdaptThenCombine(sgd, model, **bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing half built is taken over either
        opt = optim.AdaptThenCombine(sgd, model)
    for _ in range(2):
        _train_once(opt, model)
    opt.close()
    return True


def test_a_failed_constructor_leaves_no_hooks():
    assert run_distributed(_failed_constructor, 2) == [True, True]


def _broadcast_helpers():
    torch.manual_seed(gossamer.rank())
    model = nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.01 * (gossamer.rank() + 1))
    optim.broadcast_parameters(model.state_dict(), root_rank=1)
    optim.broadcast_optimizer_state(opt, root_rank=1)
    before = optim.consensus_distance(model)
    with torch.no_grad():
        model.weight.add_(gossamer.rank())
    optim.allreduce_parameters(model)
    return model.weight.detach().clone(), opt.param_groups[0]["lr"], before


def test_broadcast_and_allreduce_parameters():
    got = run_distributed(_broadcast_helpers, 3)
    torch.manual_seed(1)
    root = nn.Linear(3, 2)
    for weight, lr, before in got:
        assert before == 0.0 and lr == pytest.approx(0.02)
        torch.testing.assert_close(weight, root.weight.detach() + 1.0)


class Branchy(nn.Module):
    """``side`` is used only by rank 0 and only on step 0; ``idle`` never."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.main, self.side, self.idle = nn.Linear(4, 1), nn.Linear(4, 1), nn.Linear(4, 1)

    def forward(self, x, side):
        return (self.main(x) + (self.side(x) if side else 0)).squeeze(1)


def _branchy_sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)


def _train_branchy(steps, find_unused):
    model = Branchy()
    opt = optim.GradientAllreduce(
        _branchy_sgd(model), model, fusion_threshold_bytes=32, find_unused_parameters=find_unused
    )
    x, y = _data(gossamer.rank())
    for step in range(steps):
        opt.zero_grad()
        ((model(x, step == 0 and gossamer.rank() == 0) - y.float()) ** 2).mean().backward()
        opt.step()
    return {k: v.clone() for k, v in model.state_dict().items()}, model.idle.weight.grad


def _branchy_reference(world_size, steps):
    model = Branchy()
    sgd = _branchy_sgd(model)
    data = [_data(r) for r in range(world_size)]
    for step in range(steps):
        sgd.zero_grad()
        for r, (x, y) in enumerate(data):
            loss = ((model(x, step == 0 and r == 0) - y.float()) ** 2).mean()
            loss.div(world_size).backward()
        sgd.step()
    return model.state_dict()


@pytest.mark.parametrize("world_size", [2, 3])
def test_find_unused_parameters_leaves_globally_unused_gradients_none(world_size):
    reference = _branchy_reference(world_size, 4)
    for find_unused in (True, False):
        got = run_distributed(_train_branchy, world_size, args=(4, find_unused))
        for state, idle_grad in got:
            assert (idle_grad is None) == find_unused
            for name, value in reference.items():
                close = torch.allclose(state[name], value, rtol=1e-5, atol=1e-6)
                # Without the flag the unused parameters get zero gradients, which the weight
                # decay and momentum act on: the control shows the test can tell.
                assert close == (find_unused or name.startswith("main")), (name, find_unused)


def _bad_flag():
    model = Branchy()
    with pytest.raises(TypeError, match="find_unused_parameters must be a bool; got 1"):
        optim.GradientAllreduce(_branchy_sgd(model), model, find_unused_parameters=1)
    return True


def test_find_unused_parameters_must_be_a_bool():
    assert all(run_distributed(_bad_flag, 2))


def _clipped(world_size, steps, max_norm):
    model = Branchy()
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = _data(gossamer.rank())
    for _ in range(steps):
        opt.zero_grad()
        ((model(x, False) - y.float()) ** 2).mean().mul(gossamer.rank() + 1).backward()
        opt.synchronize()  # the documented order: average, then clip, then step
        nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
    return model.main.weight.detach().clone()


def test_gradients_clipped_after_synchronize_are_the_averaged_ones_clipped():
    steps, max_norm = 3, 0.05
    model = Branchy()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    data = [_data(r) for r in range(3)]
    for _ in range(steps):
        sgd.zero_grad()
        for r, (x, y) in enumerate(data):
            ((model(x, False) - y.float()) ** 2).mean().mul(r + 1).div(3).backward()
        assert nn.utils.clip_grad_norm_(model.parameters(), max_norm) > max_norm  # it clips
        sgd.step()
    for weight in run_distributed(_clipped, 3, args=(3, steps, max_norm)):
        torch.testing.assert_close(weight, model.main.weight.detach(), rtol=1e-5, atol=1e-7)


class TiedAutoencoder(nn.Module):
    def __init__(self, transposed):
        super().__init__()
        torch.manual_seed(0)
        self.transposed = transposed
        self.enc, self.dec = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        shared = self.enc.weight.T if transposed else self.enc.weight.data
        self.dec.weight = nn.Parameter(shared)  # one memory, two parameters

    def forward(self, x):
        return self.dec(torch.tanh(self.enc(x)))

    def tied(self):
        w = self.enc.weight.T if self.transposed else self.enc.weight
        return torch.equal(self.dec.weight, w) and (
            self.dec.weight.untyped_storage().data_ptr()
            == self.enc.weight.untyped_storage().data_ptr()
        )


def _tied(kind, transposed):
    model = TiedAutoencoder(transposed)
    cls = {"awc": optim.AdaptWithCombine, "atc": optim.AdaptThenCombine}
    opt = cls.get(kind, optim.GradientAllreduce)(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x = _data(gossamer.rank())[0]
    for _ in range(3):
        opt.zero_grad()
        (model(x) - x).pow(2).mean().backward()
        opt.step()
    opt.close()
    return model.tied()


@pytest.mark.parametrize("kind", ["awc", "atc", "gradient-allreduce"])
@pytest.mark.parametrize("transposed", [True, False])
def test_parameters_over_one_memory_stay_tied(kind, transposed):
    assert all(run_distributed(_tied, 2, args=(kind, transposed)))


def _changed_after_build(kind, change):
    model = TiedAutoencoder(False)  # any small model
    model.dec.weight = nn.Parameter(model.dec.weight.detach().clone())  # untied
    cls = {
        "awc": optim.AdaptWithCombine,
        "atc": optim.AdaptThenCombine,
        "gradient-allreduce": optim.GradientAllreduce,
    }[kind]
    opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x = _data(gossamer.rank())[0]
    if change == "dtype":
        model.double()
        x = x.double()
    elif change == "replaced":
        model.dec.weight = nn.Parameter(model.dec.weight.detach().clone())
    elif change == "assign":
        state = {k: v.clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    else:
        opt.optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})
    before = [p.detach().clone() for p in model.parameters()]
    try:
        (model(x) - x).pow(2).mean().backward()
        opt.step()
    except RuntimeError as err:
        message = str(err)
    else:
        message = None
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    opt.close()
    return message, unchanged


_REFUSAL = {
    "dtype": "changed dtype",
    "param-group": "add_param_group",
    "replaced": "parameters ['dec.weight'] of the model are not the ones",
    "assign": "of the model are not the ones",
}


@pytest.mark.parametrize("kind", ["awc", "atc", "gradient-allreduce"])
@pytest.mark.parametrize("change", list(_REFUSAL))
def test_a_model_changed_after_build_is_refused_before_anything_steps(kind, change):
    for message, unchanged in run_distributed(_changed_after_build, 2, args=(kind, change)):
        assert message is not None and _REFUSAL[change] in message, message
        if change == "dtype":
            assert "enc.weight (torch.float32 -> torch.float64)" in message
        assert unchanged  # refused before a local step moved anything


def _scheduled(kind, on_wrapper):
    import gossamer.bluefog as bf

    model = Awkward()
    sgd = _awkward_sgd(model)
    opt = {
        "awc": lambda: optim.AdaptWithCombine(sgd, model),
        "atc": lambda: optim.AdaptThenCombine(sgd, model),
        "bluefog-awc": lambda: bf.DistributedAdaptWithCombineOptimizer(sgd, model=model),
    }[kind]()
    target = opt if on_wrapper else sgd
    step_lr = torch.optim.lr_scheduler.StepLR(target, step_size=2, gamma=0.5)
    plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(target, patience=0, factor=0.1)
    x, y = _data(gossamer.rank())
    lrs = []
    for _ in range(6):
        opt.zero_grad()
        loss = (model(x) - y).pow(2).mean()
        loss.backward()
        opt.step()
        step_lr.step()
        plateau.step(1.0)  # never improves after the first step
        lrs.append([g["lr"] for g in opt.param_groups])
    opt.close()
    return lrs, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("kind", ["awc", "atc", "bluefog-awc"])
def test_learning_rate_schedulers_take_the_decentralized_optimizer(kind, world_size):
    """A scheduler given the gossamer optimizer acts as one given the torch optimizer inside."""
    wrapped = run_distributed(_scheduled, world_size, args=(kind, True))
    inner = run_distributed(_scheduled, world_size, args=(kind, False))
    for (lrs, params), (lrs_inner, params_inner) in zip(wrapped, inner, strict=True):
        # StepLR halves every 2 steps; the plateau scheduler cuts 10x from the second step.
        expected = [0.5 ** ((k + 1) // 2) * 0.1**k for k in range(6)]
        for got, want in zip(lrs, expected, strict=True):
            assert got == pytest.approx([0.1 * want, 0.05 * want])
        assert lrs == lrs_inner
        assert all(torch.equal(p, q) for p, q in zip(params, params_inner, strict=True))


def _wrapped_twice():
    model = nn.Linear(2, 1)
    inner = optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
    errors = []
    for build in (
        lambda: optim.AdaptWithCombine(inner, model),
        lambda: optim.CoCoFL(inner, model),
        lambda: inner.add_param_group({"params": [nn.Parameter(torch.zeros(1))]}),
        lambda: inner.register_step_post_hook(lambda *a: None),
    ):
        try:
            build()
        except (TypeError, RuntimeError) as err:
            errors.append(str(err))
    inner.close()
    return errors


def test_a_decentralized_optimizer_is_not_wrapped_again_nor_given_groups():
    for errors in run_distributed(_wrapped_twice, 2):
        assert len(errors) == 4
        assert "not a gossamer one" in errors[0] and "not a gossamer one" in errors[1]
        assert "cannot take a parameter group" in errors[2]
        assert "takes no optimizer hooks" in errors[3]


def test_a_lazy_module_not_yet_run_is_refused_naming_it():
    gossamer.init()
    try:
        model = nn.Sequential(nn.Linear(2, 3), nn.LazyLinear(4))
        with pytest.raises(ValueError, match=r"\['1.weight', '1.bias'\] .* not initialized"):
            optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
        model(torch.zeros(1, 2))  # now sized
        optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model).close()
    finally:
        gossamer.shutdown()
