"""Bagua's full-precision algorithms, step by step against one-process references."""

import pytest
import torch
from bagua_problems import (
    data,
    decentralized_reference,
    flat,
    gradient_allreduce_reference,
    grads,
    loss,
    model,
    sgd,
)

import gossamer
import gossamer.bagua as bagua
from gossamer.bagua.algorithms import (
    Algorithm,
    AlgorithmImpl,
    GlobalAlgorithmRegistry,
    decentralized,
    gradient_allreduce,
)
from gossamer.bagua.data_parallel import DistributedDataParallel
from gossamer.testing import run_distributed

STEPS = 6


def _train(make_algorithm, steps=STEPS, ddp=False):
    """Train rank r's own model on its data; return the weights after every step."""
    bagua.init_process_group()
    r = bagua.get_rank()
    m = model(r)  # different on every rank until with_bagua broadcasts rank 0's
    opt = sgd(m)
    if ddp:
        net = DistributedDataParallel(m, optimizers=[opt], algorithm=make_algorithm())
    else:
        net = m.with_bagua([opt], make_algorithm())
    x, y = data(r)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss(net, x, y).backward()
        opt.step()
        out.append(flat(m))
    return out


def _gradient_allreduce(hierarchical=False, ddp=False):
    return _train(
        lambda: gradient_allreduce.GradientAllReduceAlgorithm(hierarchical=hierarchical), ddp=ddp
    )


def _decentralized(mode, hierarchical, interval, segment_bytes=None):
    if segment_bytes is not None:  # posted shift_one rounds in several segments
        from gossamer.bagua import communicators

        communicators.SEGMENT_BYTES = segment_bytes
    return _train(
        lambda: decentralized.DecentralizedAlgorithm(
            hierarchical=hierarchical, peer_selection_mode=mode, communication_interval=interval
        )
    )


def _check(got, expected):
    for rank, (mine, ref) in enumerate(zip(got, expected, strict=True)):
        for step, (a, b) in enumerate(zip(mine, ref, strict=True)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"rank {rank} step {step + 1}")


def test_gradient_allreduce_is_ddp_every_step():
    expected = gradient_allreduce_reference(4, STEPS)
    _check(run_distributed(_gradient_allreduce, 4), [expected] * 4)
    # hierarchical (2 machines of 2) and the DDP-style wrapper give the same steps
    hier = run_distributed(
        _gradient_allreduce, 4, args=(True,), env={"GOSSAMER_NODES_PER_MACHINE": "2"}
    )
    _check(hier, [expected] * 4)
    _check(run_distributed(_gradient_allreduce, 4, kwargs={"ddp": True}), [expected] * 4)


def _frozen_first_layer():
    bagua.init_process_group()
    m = model(bagua.get_rank())  # every rank's own start, the frozen layer included
    m[0].requires_grad_(False)
    opt = torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.05)
    m.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    return [p.detach().clone() for p in m.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_with_bagua_gives_every_rank_rank_0s_frozen_parameters_too(world_size):
    """As torch DDP: else gradients of different functions would be averaged."""
    ranks = run_distributed(_frozen_first_layer, world_size)
    start = list(model(0).parameters())
    for params in ranks:
        assert all(torch.equal(p, q) for p, q in zip(params, start, strict=True))


@pytest.mark.parametrize(
    ("mode", "interval"), [("all", 1), ("shift_one", 1), ("shift_one", 2), ("all", 3)]
)
def test_decentralized_matches_d_psgd(mode, interval):
    got = run_distributed(_decentralized, 4, args=(mode, False, interval))
    _check(got, decentralized_reference(4, STEPS, mode, interval))


def test_posted_shift_one_in_segments_matches_d_psgd():
    # segments of 20 bytes: each round of the model's weights travels in several pieces,
    # each averaged as it arrives
    got = run_distributed(_decentralized, 4, args=("shift_one", False, 1, 20))
    _check(got, decentralized_reference(4, STEPS, "shift_one", 1))


def _buffers_per_step():
    bagua.init_process_group()
    m = model(bagua.get_rank())
    opt = sgd(m)
    net = m.with_bagua([opt], decentralized.DecentralizedAlgorithm(hierarchical=False))
    x, y = data(bagua.get_rank())
    out = []
    for _ in range(4):
        opt.zero_grad()
        loss(net, x, y).backward()
        opt.step()
        (bucket,) = net.bagua_buckets
        out.append((next(m.parameters()).data_ptr(), bucket.check_flatten()))
    with pytest.raises(AttributeError, match="no _peer_weight: DecentralizedAlgorithm swaps"):
        _ = bucket._peer_weight  # Bagua's private buffer, not kept (one copy a round saved)
    return out


def test_decentralized_weights_trade_buffers_with_peer_weight():
    # the averaged weights are swapped in rather than copied back: two buffers alternate,
    # and the weights stay one flat buffer (the steps' values: the tests above)
    for steps in run_distributed(_buffers_per_step, 2):
        pointers = [p for p, _ in steps]
        assert all(flattened for _, flattened in steps)
        assert pointers[0] == pointers[2] != pointers[1] == pointers[3]


def test_decentralized_shift_one_on_an_odd_world():
    # 3 ranks: Bagua refuses; here the rank matched with a phantom 4th rank keeps its value
    got = run_distributed(_decentralized, 3, args=("shift_one", False, 1))
    _check(got, decentralized_reference(3, STEPS, "shift_one"))


@pytest.mark.parametrize("mode", ["all", "shift_one"])
def test_hierarchical_decentralized_mixes_machine_means(mode):
    env = {"GOSSAMER_NODES_PER_MACHINE": "1"}
    got = run_distributed(_decentralized, 4, args=(mode, True, 1), env=env)
    _check(got, decentralized_reference(4, STEPS, mode, machines_of=[0, 1, 2, 3]))
    env = {"GOSSAMER_NODES_PER_MACHINE": "2"}
    got = run_distributed(_decentralized, 4, args=(mode, True, 1), env=env)
    _check(got, decentralized_reference(4, STEPS, mode, machines_of=[0, 0, 1, 1]))


def _world_of_one_and_registry():
    out = {}
    alg = Algorithm.init("decentralized", hierarchical=False, peer_selection_mode="shift_one")
    out["class"] = type(alg).__name__
    out["traj"] = _train(lambda: alg, steps=3)
    # wrapping a module again replaces the previous algorithm's hooks
    m = model(0)
    opt = sgd(m)
    m.with_bagua([opt], gradient_allreduce.GradientAllReduceAlgorithm())
    m.with_bagua([opt], alg)
    x, y = data(0)
    loss(m, x, y).backward()
    opt.step()
    out["rewrapped"] = type(m.bagua_algorithm).__name__
    return out


def test_algorithm_init_by_name_in_a_world_of_one():
    got = run_distributed(_world_of_one_and_registry, 1)[0]
    assert got["class"] == "DecentralizedAlgorithm"
    assert got["rewrapped"] == "DecentralizedAlgorithmImpl"
    # one rank: no peer, plain local SGD
    _check([got["traj"]], [decentralized_reference(1, 3, "shift_one")[0]])
    assert gossamer  # imported for the ranks


class _DoubleThenSumImpl(AlgorithmImpl):
    """A user-written algorithm: double each gradient bucket, then sum it over the ranks."""

    def init_operations(self, bagua_ddp, bucket):
        bucket.clear_ops()

        def double(name):
            for t in bucket.tensors:
                t.bagua_getter_closure().mul_(2)

        bucket.append_python_op(double)
        bucket.append_centralized_synchronous_op(average=False, group=self.process_group)


class _DoubleThenSum(Algorithm):
    def reify(self, process_group):
        return _DoubleThenSumImpl(process_group)


def _custom_and_no_sync():
    bagua.init_process_group()
    r = bagua.get_rank()
    if "double_then_sum" not in GlobalAlgorithmRegistry:
        GlobalAlgorithmRegistry.register("double_then_sum", _DoubleThenSum, "test")
    x, y = data(r)
    m = model(r).with_bagua([sgd(model(r))], Algorithm.init("double_then_sum"))
    loss(m, x, y).backward()
    custom = [p.grad.clone() for p in m.parameters()]
    # DDP wrapper: the first backward inside no_sync stays local, the second averages both
    m2 = model(r)
    ddp = DistributedDataParallel(m2, optimizers=[sgd(m2)])
    with ddp.no_sync():
        loss(ddp, x[:8], y[:8]).backward()
    local = [p.grad.clone() for p in m2.parameters()]
    loss(ddp, x[8:], y[8:]).backward()
    return custom, local, [p.grad.clone() for p in m2.parameters()]


def test_custom_algorithm_and_no_sync():
    got = run_distributed(_custom_and_no_sync, 4)
    ref = model(0)
    per_rank = [grads(ref, *data(r)) for r in range(4)]
    halves = [
        [a + b for a, b in zip(grads(ref, x[:8], y[:8]), grads(ref, x[8:], y[8:]), strict=True)]
        for x, y in (data(r) for r in range(4))
    ]
    for r, (custom, local, accumulated) in enumerate(got):
        for p, *gs in zip(custom, *per_rank, strict=True):
            torch.testing.assert_close(p, 2 * sum(gs))
        torch.testing.assert_close(local, grads(ref, data(r)[0][:8], data(r)[1][:8]))
        for p, *hs in zip(accumulated, *halves, strict=True):
            torch.testing.assert_close(p, sum(hs) / 4)


def _core_optimizer_with_bagua_communicator():
    from gossamer import optim
    from gossamer.bagua.communicators import PeerAverage

    bagua.init_process_group()
    r = bagua.get_rank()
    m = model(0)
    opt = optim.AdaptWithCombine(sgd(m), m, communicator=PeerAverage("shift_one"))
    x, y = data(r)
    out = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss(m, x, y).backward()
        opt.step()
        out.append(flat(m))
    opt.close()
    return out


def test_gossamer_optimizers_take_the_bagua_communicators():
    got = run_distributed(_core_optimizer_with_bagua_communicator, 4)
    _check(got, decentralized_reference(4, STEPS, "shift_one"))
