from functools import partial

import pytest

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.testing import run_distributed
from problems import least_squares_optimum, train_least_squares

HIER = {"GOSSAMER_NODES_PER_MACHINE": "2"}


def _make(kind, sgd, model):
    r, n = gossamer.rank(), gossamer.size()
    if kind == "awc":
        return optim.AdaptWithCombine(sgd, model)
    if kind == "awc-allreduce":
        return optim.AdaptWithCombine(sgd, model, communication="allreduce")
    if kind == "awc-one-peer":
        schedule = topo.one_peer_exponential(topo.exponential_two(n), r)
        return optim.AdaptWithCombine(sgd, model, schedule=schedule)
    if kind == "atc":
        return optim.AdaptThenCombine(sgd, model)
    if kind == "atc-exact-diffusion":
        return optim.AdaptThenCombine(sgd, model, exact_diffusion=True)
    if kind == "atc-hierarchical":
        gossamer.set_machine_topology(topo.exponential_two(gossamer.machine_size()))
        return optim.AdaptThenCombine(sgd, model, communication="hierarchical_neighbor_allreduce")
    if kind == "atc-local-steps":
        return optim.AdaptThenCombine(
            sgd, model, num_steps_per_communication=2, global_average_every=5
        )
    if kind == "gradient-allreduce":
        return optim.GradientAllreduce(sgd, model)
    raise AssertionError(kind)


def _train(kind, steps, lr, decay):
    distances = []

    def measure(k, opt, model):
        if k in (5, steps - 1):
            opt.synchronize()
            distances.append(optim.consensus_distance(model))

    model, opt = train_least_squares(partial(_make, kind), steps, lr, decay, measure)
    opt.synchronize()
    gossamer.set_machine_topology(None)
    return model.weight.detach().squeeze(0).clone(), distances


CASES = [
    # (kind, steps, lr, decay of the step size: lr / (1 + k / decay))
    ("awc", 400, 0.3, 10),
    ("awc-allreduce", 400, 0.3, 10),
    ("awc-one-peer", 400, 0.3, 10),
    ("atc", 400, 0.3, 10),
    ("atc-exact-diffusion", 120, 0.3, 1e9),
    ("atc-local-steps", 400, 0.3, 10),
    ("gradient-allreduce", 150, 0.3, 1e9),
]


@pytest.mark.parametrize(("kind", "steps", "lr", "decay"), CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("world_size", [2, 4])
def test_least_squares_reaches_the_centralized_optimum(kind, steps, lr, decay, world_size):
    got = run_distributed(_train, world_size, args=(kind, steps, lr, decay), timeout=240)
    optimum = least_squares_optimum(world_size)
    for weight, _distances in got:
        error = (weight - optimum).norm() / optimum.norm()
        assert error < 1e-3, f"{kind}: relative error {error:.2e}"
    first, last = got[0][1]
    assert last <= 1e-12 or last < first  # the consensus distance decays during training
    if kind == "gradient-allreduce":
        assert first == last == 0.0  # identical models throughout


def test_hierarchical_neighbor_allreduce_reaches_the_optimum():
    got = run_distributed(_train, 4, args=("atc-hierarchical", 400, 0.3, 10), env=HIER, timeout=240)
    optimum = least_squares_optimum(4)
    for weight, _ in got:
        assert (weight - optimum).norm() / optimum.norm() < 1e-3
