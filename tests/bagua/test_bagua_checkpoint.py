"""gossamer.checkpoint resumes a model under the Bagua facade exactly, for every algorithm.

N + M steps in one job against N steps, a save, a new job (another initialization) that
wraps its model, loads, and takes M steps: equal bit for bit. The facade's step counter
(which decides the communication steps), ``shift_one``'s round (which picks the peer) and
the low-precision replicas live beside the model, not in it; the control reloads without
them and must differ, so each of them matters.
"""

import pytest
import torch
from bagua_problems import data, loss, model

import gossamer.bagua as bagua
from gossamer import checkpoint
from gossamer.bagua.algorithms import decentralized, gradient_allreduce, q_adam
from gossamer.bagua.data_parallel import DistributedDataParallel
from gossamer.testing import run_distributed

N, M = 3, 4  # an odd N: resume between two communication steps of interval 2
ALGORITHMS = {
    "gradient_allreduce": lambda opt: gradient_allreduce.GradientAllReduceAlgorithm(),
    "shift_one": lambda opt: decentralized.DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="shift_one"
    ),
    "interval_2": lambda opt: decentralized.DecentralizedAlgorithm(
        hierarchical=False, peer_selection_mode="shift_one", communication_interval=2
    ),
    "low_precision": lambda opt: decentralized.LowPrecisionDecentralizedAlgorithm(
        hierarchical=False
    ),
    "low_precision_qsgd": lambda opt: decentralized.LowPrecisionDecentralizedAlgorithm(
        hierarchical=False, compression="qsgd:8"
    ),
    "qadam": lambda opt: q_adam.QAdamAlgorithm(opt, hierarchical=False),
}
CONTROLLED = ["shift_one", "interval_2", "low_precision", "low_precision_qsgd"]


def _job(name, seed, ddp):
    r = bagua.get_rank()
    torch.manual_seed(seed)
    m = model(r + seed)
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(m.parameters(), lr=0.05, warmup_steps=2)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    if ddp:
        return DistributedDataParallel(m, optimizers=[opt], algorithm=ALGORITHMS[name](opt)), opt
    return m.with_bagua([opt], ALGORITHMS[name](opt)), opt


def _train(net, opt, steps):
    x, y = data(bagua.get_rank())
    for _ in range(steps):
        opt.zero_grad()
        loss(net, x, y).backward()
        opt.step()
    return [p.detach().clone() for p in net.parameters()]


def _resume(root, names, ddp):
    bagua.init_process_group()
    out = {}
    for name in names:
        reference = _train(*_job(name, 0, ddp), N + M)
        net, opt = _job(name, 0, ddp)
        _train(net, opt, N)
        checkpoint.save(f"{root}/{name}", net, opt)
        results = []
        for control in (False, True):
            net, opt = _job(name, 7, ddp)
            engine = net.inner if ddp else net.bagua_ddp
            fresh = engine.state_dict()
            checkpoint.load(f"{root}/{name}", net, opt)
            if control:  # the facade's own state as a new job has it
                engine.load_state_dict(fresh)
            got = _train(net, opt, M)
            results.append(all(torch.equal(a, b) for a, b in zip(reference, got, strict=True)))
        out[name] = results
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_every_algorithm_resumes_exactly(tmp_path, world_size):
    # Of two ranks, shift_one's peer is the other one at every round.
    controlled = CONTROLLED[world_size == 2 :]
    for out in run_distributed(_resume, world_size, args=(str(tmp_path), list(ALGORITHMS), False)):
        for name, (exact, control_exact) in out.items():
            assert exact, name
            assert not control_exact or name not in controlled, name


def test_the_ddp_wrapper_resumes_exactly(tmp_path):
    names = ["shift_one", "low_precision"]
    for out in run_distributed(_resume, 3, args=(str(tmp_path), names, True)):
        assert out == {name: [True, False] for name in names}


class _Outer(torch.nn.Module):
    """A model whose submodule alone trains under the facade."""

    def __init__(self, body):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x)


def _submodule_resume(root):
    bagua.init_process_group()
    r = bagua.get_rank()
    out = []
    for phase in ("reference", "save", "load"):
        torch.manual_seed(7 if phase == "load" else 0)
        net = _Outer(model(r + (7 if phase == "load" else 0)))
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        net.body.with_bagua([opt], ALGORITHMS["interval_2"](opt))
        if phase == "load":
            checkpoint.load(root, net, opt)
        steps = {"reference": N + M, "save": N, "load": M}[phase]
        out.append(_train(net, opt, steps))
        if phase == "save":
            checkpoint.save(root, net, opt)
    return all(torch.equal(a, b) for a, b in zip(out[0], out[2], strict=True))


def test_a_wrapped_submodule_resumes_exactly_with_its_parent(tmp_path):
    assert run_distributed(_submodule_resume, 3, args=(str(tmp_path),)) == [True] * 3


def _save_low_precision(root):
    bagua.init_process_group()
    net, opt = _job("low_precision", 0, False)
    _train(net, opt, N)
    checkpoint.save(root, net, opt)


def _resized_low_precision(root):
    bagua.init_process_group()
    net, opt = _job("low_precision", 7, False)
    checkpoint.load(root, net, opt, resize=True)
    loaded = [p.detach().clone() for p in net.parameters()]
    bucket = net.bagua_buckets[0]
    replicas = [bucket._weight, bucket._left_peer_weight, bucket._right_peer_weight]
    in_step = all(torch.equal(rep, bucket.pack()) for rep in replicas)
    for group in opt.param_groups:
        group["lr"], group["momentum"] = 0.0, 0.0
    after = _train(net, opt, M)  # gossip alone: the ranks agree, so nothing moves
    drift = max(float((a - b).abs().max()) for a, b in zip(loaded, after, strict=True))
    return in_step, drift


def test_a_resized_facade_checkpoint_starts_the_replicas_at_the_average(tmp_path):
    run_distributed(_save_low_precision, 3, args=(str(tmp_path),))
    for in_step, drift in run_distributed(_resized_low_precision, 2, args=(str(tmp_path),)):
        assert in_step and drift < 1e-6, drift


def _other_algorithm(root):
    bagua.init_process_group()
    net, opt = _job("shift_one", 0, False)
    checkpoint.save(root, net, opt)
    net, opt = _job("gradient_allreduce", 0, False)
    try:
        checkpoint.load(root, net, opt)
    except ValueError as err:
        return str(err)


def test_a_checkpoint_of_another_algorithm_is_refused(tmp_path):
    for message in run_distributed(_other_algorithm, 2, args=(str(tmp_path),)):
        assert "saved by DecentralizedAlgorithmImpl(peer_selection_mode='shift_one')" in message
        assert "this module runs GradientAllReduceAlgorithmImpl" in message


def _unwrapped_load(root):
    bagua.init_process_group()
    net, opt = _job("shift_one", 0, False)
    checkpoint.save(root, net, opt)
    plain = model(0)
    try:
        checkpoint.load(root, plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9))
    except ValueError as err:
        return str(err)


def test_a_facade_checkpoint_needs_the_facade_set_up_before_load(tmp_path):
    for message in run_distributed(_unwrapped_load, 2, args=(str(tmp_path),)):
        assert "holds state attached to model 0 as ['bagua']" in message
