"""PowerSGD through gossamer's interface against torch's own DDP hook on the same ranks."""

import io

import pytest
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as torch_powersgd
from torch.nn.parallel import DistributedDataParallel

import gossamer
from gossamer import communicators, optim, profiling
from gossamer.testing import run_distributed

STEPS, START = 6, 2


def _model():
    # One compressible matrix (12 x 16 at rank 1: 56 numbers instead of 192); the biases and
    # the 1 x 12 matrix are averaged uncompressed. One compressed tensor keeps the random
    # initial Q independent of DDP's reversed parameter order.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 12), nn.Tanh(), nn.Linear(12, 1))


def _batch(step):
    g = torch.Generator().manual_seed(1000 * gossamer.rank() + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)


def _train(model, opt, steps, first=0):
    for step in range(first, first + steps):
        x, y = _batch(step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _powersgd_vs_ddp():
    ref = _model()
    ddp = DistributedDataParallel(ref, bucket_cap_mb=64)
    state = torch_powersgd.PowerSGDState(None, 1, start_powerSGD_iter=START)
    ddp.register_comm_hook(state, torch_powersgd.powerSGD_hook)
    _train(ddp, torch.optim.SGD(ref.parameters(), lr=0.1), STEPS)

    model = _model()
    comm = communicators.PowerSGDAllreduce(1, start_iter=START)
    opt = optim.GradientAllreduce(
        torch.optim.SGD(model.parameters(), lr=0.1), model, communicator=comm
    )
    _train(model, opt, STEPS - 1)
    # Resume from a checkpoint (through torch.save, weights only) for the last step.
    buffer = io.BytesIO()
    torch.save(opt.state_dict(), buffer)
    profiling.reset_bytes_sent()
    twin = communicators.PowerSGDAllreduce(1, start_iter=START)
    opt.close()
    opt = optim.GradientAllreduce(
        torch.optim.SGD(model.parameters(), lr=0.1), model, communicator=twin
    )
    buffer.seek(0)
    opt.load_state_dict(torch.load(buffer, weights_only=True))
    _train(model, opt, 1, first=STEPS - 1)
    sent = profiling.bytes_sent("powersgd_allreduce")
    opt.close()
    pairs = zip(model.parameters(), ref.parameters(), strict=True)
    diff = max((a - b).abs().max().item() for a, b in pairs)
    return diff, sent, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_powersgd_matches_torchs_ddp_hook(world_size):
    results = run_distributed(_powersgd_vs_ddp, world_size)
    n = world_size
    # 12 + 1 (biases) + 12 (the 1 x 12 matrix) uncompressed, P (12) and Q (16) of the matrix.
    want = 2 * (n - 1) * (25 + 28) * 4 // n
    for diff, sent, params in results:
        assert diff < 1e-6
        assert sent == want
        for p, q in zip(params, results[0][2], strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=0)  # ranks stay identical


def test_powersgd_spec_and_options_are_checked():
    comm = communicators.make("allreduce", compression="powersgd:4")
    assert isinstance(comm, communicators.PowerSGDAllreduce) and comm.rank == 4
    assert communicators.make("allreduce", compression="powersgd").state.use_error_feedback
    assert communicators.make("allreduce", compression=" PowerSGD:2 ").rank == 2  # as the others
    with pytest.raises(ValueError, match="powersgd:<rank"):
        communicators.make("allreduce", compression="powersgd:0")
    with pytest.raises(ValueError, match="communication='allreduce'"):
        communicators.make("neighbor_allreduce", compression="powersgd:2")
    with pytest.raises(ValueError, match="start_iter"):
        communicators.PowerSGDAllreduce(2, start_iter=1)
    with pytest.raises(TypeError, match="warm_start"):
        communicators.PowerSGDAllreduce(2, warm_start=1)


def test_a_state_of_another_configuration_is_refused():
    saved = communicators.PowerSGDAllreduce(1).state_dict()
    for other in (
        communicators.PowerSGDAllreduce(2),
        communicators.PowerSGDAllreduce(1, start_iter=20),
        communicators.PowerSGDAllreduce(1, warm_start=False),
    ):
        with pytest.raises(ValueError, match=r"state was saved with (rank|start_iter|warm_start)"):
            other.load_state_dict(saved)
    fresh = communicators.PowerSGDAllreduce(1, seed=3)  # the seed's draws are state: loaded
    fresh.load_state_dict(saved)
    assert fresh.state.matrix_approximation_rank == 1


def _with_an_empty_parameter(empty):
    model = _model()
    if empty:
        model.register_parameter("empty", nn.Parameter(torch.zeros(0, 4)))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    comm = communicators.PowerSGDAllreduce(1, start_iter=START)
    opt = optim.GradientAllreduce(sgd, model, communicator=comm)
    _train(model, opt, STEPS)
    opt.close()
    return [p.detach().clone() for p in model.parameters() if p.numel()]


@pytest.mark.parametrize("world_size", [2, 3])
def test_an_empty_parameter_changes_nothing(world_size):
    with_empty = run_distributed(_with_an_empty_parameter, world_size, args=(True,))
    without = run_distributed(_with_an_empty_parameter, world_size, args=(False,))
    for a, b in zip(with_empty, without, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
