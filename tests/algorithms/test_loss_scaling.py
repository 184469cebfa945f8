"""Training under ``torch.amp.GradScaler`` against the algorithms simulated in one process.

A loss scaler skips the update of a rank whose scaled gradients overflowed. The optimizers
take the scaler's scale and its verdict themselves (``_step_supports_amp_scaling``), so that
rank still takes part in its round: step by step, with ``skip`` the set of (step, rank)
whose gradients held an inf,

- AWC: :math:`x_i^+ = \\sum_j W[j, i] x_j - [(k, i) \\notin skip]\\, \\eta g_i(x_i)`;
- ATC: :math:`x_i^+ = \\sum_j W[j, i] (x_j - [(k, j) \\notin skip]\\, \\eta g_j(x_j))`;
- gradient allreduce: every rank skips step k if any rank's gradient overflowed, else
  :math:`x^+ = x - \\eta \\bar g`.
"""

import numpy as np
import pytest
import torch

import gossamer
import gossamer.bluefog as bf
from gossamer import optim
from gossamer.communicators import PowerSGDAllreduce
from gossamer.testing import run_distributed
from gossamer.topology import Topology
from oracle import mix
from problems import least_squares_data, least_squares_loss, linear_model

STEPS, LR = 5, 0.05
OVERFLOW = {(1, 1), (3, 0)}  # (step, rank): that rank's scaled loss is multiplied by inf


def _weights(n):
    """A column-stochastic matrix with unequal weights (column j: rank j's receive weights)."""
    W = np.arange(1, n * n + 1, dtype=np.float64).reshape(n, n) % 5 + 1
    return W / W.sum(axis=0, keepdims=True)


def _optimizer(kind, sgd, model, n):
    if kind == "gradient-allreduce":
        return optim.GradientAllreduce(sgd, model)
    if kind == "bluefog-atc":  # BlueFog's ATC overlaps, and takes no overlap=
        return bf.DistributedAdaptThenCombineOptimizer(sgd, model)
    topology = Topology(_weights(n))
    if kind == "awc":
        return optim.AdaptWithCombine(sgd, model, topology=topology)
    return optim.AdaptThenCombine(sgd, model, topology=topology, overlap=kind == "atc-overlap")


def _train(kind, unscale_first):
    rank = gossamer.rank()
    A, b = least_squares_data(rank)
    model = linear_model()
    opt = _optimizer(kind, torch.optim.SGD(model.parameters(), lr=LR), model, gossamer.size())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1)
    scales = []
    for k in range(STEPS):
        opt.zero_grad()
        loss = least_squares_loss(model, A, b)
        if (k, rank) in OVERFLOW:
            loss = loss * float("inf")
        scaler.scale(loss).backward()
        if kind == "gradient-allreduce":
            opt.synchronize()  # the scaler then sees the averaged gradients
        if unscale_first:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    opt.synchronize()
    return model.weight.detach().clone().squeeze(0), scales


def _serial(kind, n):
    """The algorithm of the module docstring for all ranks in one process (float64)."""
    data = [least_squares_data(r) for r in range(n)]
    W = _weights(n) if kind != "gradient-allreduce" else np.full((n, n), 1 / n)
    xs = [torch.zeros(A.shape[1], dtype=torch.float64) for A, _ in data]
    for k in range(STEPS):
        grads = [A.T @ (A @ x - b) / len(b) for x, (A, b) in zip(xs, data, strict=True)]
        if kind == "gradient-allreduce":
            skipped = any((k, r) in OVERFLOW for r in range(n))
            mean = sum(grads) / n
            xs = [x if skipped else x - LR * mean for x in xs]
            continue
        updates = [0 if (k, r) in OVERFLOW else LR * g for r, g in enumerate(grads)]
        if kind == "awc":
            xs = [y - u for y, u in zip(mix(W, xs), updates, strict=True)]
        else:
            xs = mix(W, [x - u for x, u in zip(xs, updates, strict=True)])
    return xs


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale-then-step"])
@pytest.mark.parametrize("kind", ["awc", "atc", "gradient-allreduce"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_a_rank_whose_scaled_gradients_overflow_still_takes_part_in_its_round(
    world_size, kind, unscale_first
):
    results = run_distributed(_train, world_size, args=(kind, unscale_first))
    expected = _serial(kind, world_size)
    for rank, ((weights, scales), want) in enumerate(zip(results, expected, strict=True)):
        torch.testing.assert_close(weights, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}")
        # Each rank's scaler backs off on the steps this optimizer skipped on that rank.
        skipped = [
            any((k, r) in OVERFLOW for r in range(world_size))
            if kind == "gradient-allreduce"
            else (k, rank) in OVERFLOW
            for k in range(STEPS)
        ]
        scale, want_scales = 2.0**10, []
        for skip in skipped:
            scale = scale / 2 if skip else scale * 2
            want_scales.append(scale)
        assert scales == want_scales, f"rank {rank}"


def _refused(kind):
    model = linear_model()
    A, b = least_squares_data(gossamer.rank())
    opt = _optimizer(kind, torch.optim.SGD(model.parameters(), lr=LR), model, gossamer.size())
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(least_squares_loss(model, A, b)).backward()
    try:
        scaler.step(opt)
    except RuntimeError as error:
        return str(error)
    finally:
        opt.synchronize()  # what backward started finishes, so the ranks stay usable
        opt.close()
    return None


@pytest.mark.parametrize(
    "kind, words",
    [
        ("atc-overlap", "build it with overlap=False"),
        ("bluefog-atc", "DistributedAdaptWithCombineOptimizer"),
        ("gradient-allreduce", "call opt.synchronize() before scaler.unscale_(opt)"),
    ],
)
def test_a_loss_scaler_that_cannot_be_followed_is_refused_on_every_rank(kind, words):
    for message in run_distributed(_refused, 2, args=(kind,)):
        assert message is not None and words in message


def _wrapped(kind, model, n):
    """The other synchronous optimizers (and wrappers) that follow a loss scaler."""
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    topology = Topology(_weights(n))
    if kind == "dacfl":
        return optim.DACFL(sgd, model, topology=topology)
    if kind == "cocofl":
        return optim.CoCoFL(sgd, model, topology=topology)
    if kind == "skewscout":
        awc = optim.AdaptWithCombine(sgd, model, topology=topology)
        return optim.SkewScout(awc, lambda m: 1.0, probe_every=2)
    return bf.DistributedAdaptWithCombineOptimizer(sgd, model)


def _train_either_way(kind, scaled):
    """With a scaler and overflows, or without one and a zero gradient where they were.

    Plain SGD's update of a zero gradient is zero, as a skipped update is, so both runs
    must give the same models if a skipped update leaves the rank in its rounds.
    """
    rank = gossamer.rank()
    A, b = least_squares_data(rank)
    model = linear_model()
    opt = _wrapped(kind, model, gossamer.size())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, enabled=scaled)
    for k in range(STEPS):
        opt.zero_grad()
        loss = least_squares_loss(model, A, b)
        overflow = (k, rank) in OVERFLOW
        scaler.scale(loss * float("inf") if overflow and scaled else loss).backward()
        if overflow and not scaled:
            model.weight.grad.zero_()
        scaler.step(opt)
        scaler.update()
    opt.synchronize()
    return model.weight.detach().clone()


@pytest.mark.parametrize("kind", ["dacfl", "cocofl", "skewscout", "bluefog-awc"])
def test_a_skipped_update_equals_a_zero_gradient_under_every_synchronous_optimizer(kind):
    scaled = run_distributed(_train_either_way, 3, args=(kind, True))
    plain = run_distributed(_train_either_way, 3, args=(kind, False))
    for rank, (got, want) in enumerate(zip(scaled, plain, strict=True)):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=f"rank {rank}")
    assert not torch.equal(scaled[0], linear_model().weight.detach()), "nothing trained"


def _train_compressed(compression, steps, overflow_step):
    """Gradient allreduce with a compressor that keeps residuals; one overflow on rank 1.

    ``"+momentum"`` after the compressor adds a :class:`optim.MomentumCorrection`, whose
    buffers would keep the overflow too.
    """
    compression, _, momentum = compression.partition("+")
    rank = gossamer.rank()
    g = torch.Generator().manual_seed(rank)
    X = torch.randn(64, 16, generator=g)
    Y = X @ torch.linspace(-1, 1, 256).reshape(16, 16)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 16, bias=False)
    if momentum:
        optim.MomentumCorrection(model, momentum=0.5)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05)
    if compression == "powersgd":
        opt = optim.GradientAllreduce(sgd, model, communicator=PowerSGDAllreduce(1, start_iter=2))
    else:
        opt = optim.GradientAllreduce(sgd, model, compression=compression, error_feedback=True)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
    scales, losses = [], []
    for k in range(steps):
        opt.zero_grad()
        loss = ((model(X) - Y) ** 2).mean()
        losses.append(loss.item())
        scaled = scaler.scale(loss * float("inf") if (k, rank) == (overflow_step, 1) else loss)
        scaled.backward()
        opt.synchronize()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return model.weight.detach().clone(), scales, losses


@pytest.mark.parametrize(
    "compression", ["topk:0.25", "uint8", "sign", "powersgd", "sign:bucket=4+momentum"]
)
@pytest.mark.parametrize("world_size", [2, 3])
def test_an_overflow_stays_neither_in_residuals_nor_in_momentum_buffers(world_size, compression):
    """Without dropping them, one rank's infinite residual overflowed every later round."""
    steps, overflow_step = 10, 4
    results = run_distributed(
        _train_compressed, world_size, args=(compression, steps, overflow_step)
    )
    weights, scales, losses = results[0]
    # Exactly one skipped step (the scale halves there, and never again).
    assert scales == [2.0**10] * overflow_step + [2.0**9] * (steps - overflow_step)
    assert torch.isfinite(weights).all()
    assert losses[-1] < losses[overflow_step] < losses[0]
    for rank, (other, _, _) in enumerate(results[1:], start=1):
        torch.testing.assert_close(other, weights, rtol=0, atol=0, msg=f"rank {rank}")
