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
            fresh = net.bagua_ddp.state_dict() if not ddp else net.inner.state_dict()
            checkpoint.load(f"{root}/{name}", net, opt)
            if control:  # the facade's own state as a new job has it
                (net.inner if ddp else net.bagua_ddp).load_state_dict(fresh)
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
