"""MomentumCorrection: momentum on each rank before the gradient average.

Uncompressed, the average of the ranks' buffers is the buffer of the averaged gradients, so
plain SGD over corrected gradients must follow SGD with momentum on the averaged gradients,
computed here in one process from every rank's batches.
"""

import io

import pytest
import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer.testing import run_distributed

STEPS, LR, BETA = 5, 0.1, 0.9


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 1))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(8, 6, generator=g), torch.randn(8, 1, generator=g)


def _loss(model, rank, step):
    x, y = _batch(rank, step)
    return (model(x) - y).pow(2).mean()


def _corrected(save_at, passes=1):
    model = _model()
    correction = optim.MomentumCorrection(model, momentum=BETA)
    opt = optim.GradientAllreduce(
        torch.optim.SGD(model.parameters(), lr=LR), model, num_steps_per_communication=passes
    )
    for step in range(STEPS):
        if step == save_at:  # a round trip through torch.save must not change the run
            saved = io.BytesIO()
            torch.save(correction.state_dict(), saved)
            correction.load_state_dict({"momentum": BETA, "buffers": {}})  # forget them all
            saved.seek(0)
            correction.load_state_dict(torch.load(saved, weights_only=True))
        opt.zero_grad()
        for part in range(passes):  # gradient accumulation: one momentum step for the sum
            _loss(model, gossamer.rank() + 10 * part, step).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _reference(size, passes=1):
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR, momentum=BETA)
    for step in range(STEPS):
        sgd.zero_grad()
        losses = [_loss(model, r + 10 * part, step) for r in range(size) for part in range(passes)]
        (sum(losses) / size).backward()
        sgd.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.parametrize(("world_size", "passes"), [(2, 1), (3, 1), (2, 2), (3, 3)])
def test_corrected_sgd_is_momentum_sgd_on_averaged_gradients(world_size, passes):
    got = run_distributed(_corrected, world_size, args=(2, passes))
    expected = _reference(world_size, passes)
    for params in got:
        for p, q in zip(params, expected, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("momentum", [-0.1, 1.0, 2])
def test_bad_momentum_is_refused_naming_it(momentum):
    with pytest.raises(ValueError, match=f"momentum must be in \\[0, 1\\); got {momentum}"):
        optim.MomentumCorrection(_model(), momentum)


def test_bad_arguments_name_their_type():
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module; got list"):
        optim.MomentumCorrection([], 0.9)
    with pytest.raises(TypeError, match=r"momentum must be a number; got '0\.9'"):
        optim.MomentumCorrection(_model(), "0.9")


def _created_after_the_optimizer():
    model = _model()
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=LR), model)
    with pytest.raises(ValueError, match="create MomentumCorrection before GradientAllreduce"):
        optim.MomentumCorrection(model, momentum=BETA)
    opt.close()
    optim.MomentumCorrection(model, momentum=BETA).remove()  # fine once it is closed
    return True


def test_a_correction_created_after_the_optimizer_is_refused():
    assert all(run_distributed(_created_after_the_optimizer, 2))
