"""CoCoFL: frozen layers run int8 and stay put; trainable layers follow a 1-process reference.

The reference quantizes a constrained rank's frozen layer through another torch entry point
(``torch.ao.quantization.quantize_dynamic`` on the whole layer), trains the trainable layer
with plain SGD on that forward, and averages each parameter, written out by hand (global
mean or the ring's weights; masked: over the ranks that train it, else over all).
"""

import copy
import warnings

import numpy as np
import pytest
import torch
from torch import nn
from torch.ao.nn.quantized import dynamic as qdynamic

import gossamer
from gossamer import topology as topo
from gossamer.optim import CoCoFL
from gossamer.testing import run_distributed
from problems import least_squares_data

LR, STEPS = 0.05, 4


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 1))


def _data(rank):
    A, b = least_squares_data(rank)
    return A.float(), b.float()


def _loss(out, b):
    return ((out.squeeze(1) - b) ** 2).mean() / 2


def _constrained(rank):
    return rank % 2 == 1


def _train(ring, period, masked):
    rank, n = gossamer.rank(), gossamer.size()
    A, b = _data(rank)
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    opt = CoCoFL(
        sgd,
        model,
        frozen=["0"],
        constrained=_constrained(rank),
        topology=topo.ring(n) if ring else None,
        num_steps_per_communication=period,
        masked=masked,
    )
    checks = [opt.masked == (not ring if masked is None else masked)]
    for k in range(STEPS):
        before = model[0].weight.detach().clone()
        opt.zero_grad()
        _loss(model(A), b).backward()
        opt.step()
        if _constrained(rank):
            checks.append(isinstance(opt.quantized["0"], qdynamic.Linear))
            checks.append(model[0].weight.grad is None)
            if (k + 1) % period:  # no averaging this step: the frozen layer did not move
                checks.append(torch.equal(model[0].weight, before))
            # the int8 layer in use is the current float layer, quantized
            q = opt.quantized["0"].weight()
            error = (q.dequantize() - model[0].weight).abs().max()
            checks.append(bool(error <= q.q_scale() / 2 + 1e-7))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, checks


def _quantized(linear):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return torch.ao.quantization.quantize_dynamic(
            nn.Sequential(copy.deepcopy(linear)), {nn.Linear}, dtype=torch.qint8
        )


def _reference(n, ring, period, masked):
    W = topo.ring(n).weights if ring else np.full((n, n), 1 / n)
    models = [_model() for _ in range(n)]
    for k in range(STEPS):
        for r, model in enumerate(models):
            A, b = _data(r)
            if _constrained(r):
                with torch.no_grad():
                    hidden = _quantized(model[0])(A)
                out = model[2](model[1](hidden))
                params = list(model[2].parameters())
            else:
                out = model(A)
                params = list(model.parameters())
            grads = torch.autograd.grad(_loss(out, b), params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p -= LR * g
        if (k + 1) % period == 0:
            states = [{k: v.clone() for k, v in m.state_dict().items()} for m in models]
            for i, model in enumerate(models):
                new = {}
                for name in states[i]:
                    trains = [
                        0.0 if masked and _constrained(j) and name.startswith("0.") else 1.0
                        for j in range(n)
                    ]
                    weight = sum(W[j, i] * trains[j] for j in range(n))
                    if weight == 0:
                        new[name] = states[i][name]
                    else:
                        total = sum(W[j, i] * trains[j] * states[j][name] for j in range(n))
                        new[name] = total / weight
                model.load_state_dict(new)
    return [m.state_dict() for m in models]


@pytest.mark.parametrize(
    ("world_size", "ring", "period", "masked"),
    # On the ring the average is taken once, at the end: a float32 average that differs from
    # the reference's in the last bit can flip an int8 value of the re-quantized layer, and
    # the forward passes after it would then differ by a quantum (the global averages happen
    # to round alike).
    [(2, False, 1, None), (4, False, 2, None), (4, True, STEPS, None), (4, True, STEPS, True)],
)
def test_cocofl_matches_a_one_process_reference(world_size, ring, period, masked):
    results = run_distributed(_train, world_size, args=(ring, period, masked))
    masked = not ring if masked is None else masked
    want = _reference(world_size, ring, period, masked)
    for rank, (state, checks) in enumerate(results):
        assert all(checks) and (checks or not _constrained(rank)), f"rank {rank}: {checks}"
        for name, value in want[rank].items():
            torch.testing.assert_close(state[name], value, rtol=1e-5, atol=1e-6, msg=name)
    if not ring:  # the global average leaves every rank with the same model
        for state, _ in results[1:]:
            for name, value in state.items():
                torch.testing.assert_close(value, results[0][0][name])


def _misuse():
    errors = []
    model = _model()
    sgd = torch.optim.SGD(model.parameters(), lr=LR)
    for kwargs in (
        {"frozen": ["9"]},
        {"frozen": ["1"]},
        {"frozen": "0"},
        {"num_steps_per_communication": 0},
    ):
        try:
            CoCoFL(sgd, model, constrained=True, **kwargs)
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    # a frozen layer after a trainable one would silently lose the gradient: refused
    opt = CoCoFL(sgd, model, frozen=["2"], constrained=True)
    try:
        model(torch.zeros(3, 5))
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    opt.close()
    model(torch.zeros(3, 5)).sum().backward()  # float forward and gradients are back
    errors.append(model[2].weight.grad is not None)

    # state: steps and rounds come back; a state that froze other layers is refused
    def sgd():
        return torch.optim.SGD(model.parameters(), lr=LR)

    opt = CoCoFL(sgd(), model, frozen=["0"], constrained=True)
    for _ in range(3):
        opt.step()
    fresh = CoCoFL(sgd(), model, frozen=["0"])
    try:
        fresh.load_state_dict(opt.state_dict())
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    fresh.close()
    again = CoCoFL(
        torch.optim.SGD(model.parameters(), lr=LR), model, frozen=["0"], constrained=True
    )
    again.load_state_dict(opt.state_dict())
    errors.append((again.steps, again.rounds, again.masked))
    for made in (again, opt):  # the last made first: each gives back what it found
        made.close()
    try:
        CoCoFL(sgd(), model, frozen=None, constrained=True)
    except TypeError as err:
        errors.append(f"{type(err).__name__}: {err}")
    # close() gives back what the user had set, a parameter frozen by the user included
    model[0].bias.requires_grad_(False)
    closed = CoCoFL(sgd(), model, frozen=["0"], constrained=True)
    closed.close()
    errors.append((model[0].weight.requires_grad, model[0].bias.requires_grad))
    try:  # a closed optimizer steps no more, as the others (its masks no longer hold)
        closed.step()
    except RuntimeError as err:
        errors.append(f"{type(err).__name__}: {err}")
    other = torch.nn.Linear(2, 3)  # the model given does not own what the optimizer trains
    try:
        CoCoFL(torch.optim.SGD(other.parameters(), lr=LR), model)
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    # int8 dynamic quantization runs on the CPU only (a meta layer stands for a GPU one)
    elsewhere = torch.nn.Sequential(torch.nn.Linear(5, 3, device="meta"))
    try:
        CoCoFL(
            torch.optim.SGD(elsewhere.parameters(), lr=LR),
            elsewhere,
            frozen=["0"],
            constrained=True,
        )
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    double = torch.nn.Sequential(torch.nn.Linear(5, 3)).double()
    try:
        CoCoFL(torch.optim.SGD(double.parameters(), lr=LR), double, frozen=["0"], constrained=True)
    except ValueError as err:
        errors.append(f"{type(err).__name__}: {err}")
    masked = CoCoFL(sgd(), model, masked=True)  # a state of another masking is refused
    saved = masked.state_dict()
    masked.close()
    unmasked = CoCoFL(sgd(), model, masked=False)
    for state in (saved, {"optimizer": saved["optimizer"], "cocofl": {"steps": 1}}):
        try:
            unmasked.load_state_dict(state)
        except ValueError as err:
            errors.append(f"{type(err).__name__}: {err}")
    unmasked.close()
    return errors


def test_cocofl_argument_errors():
    (errors,) = run_distributed(_misuse, 1)
    assert errors[0] == "ValueError: frozen names ['9'] are not modules of the model"
    assert errors[1].startswith("TypeError: frozen layer '1' is a Tanh; only nn.Linear")
    assert errors[2].startswith("TypeError: frozen must be a sequence of module names")
    assert errors[3] == "ValueError: num_steps_per_communication must be an int >= 1; got 0"
    assert errors[4].startswith("ValueError: CoCoFL: frozen layer '2' got an input that requires")
    assert errors[5] is True
    assert errors[6] == "ValueError: state froze layers ['0']; this optimizer freezes []"
    assert errors[7] == (3, 3, True)
    assert errors[8] == "TypeError: frozen must be a sequence of module names; got None"
    assert errors[9] == (True, False)
    assert errors[10] == "RuntimeError: CoCoFL was closed; build a new optimizer"
    assert errors[11] == (
        "ValueError: the optimizer has parameters that are not in the model (shapes [(3, 2), (3,)])"
    )
    assert errors[12] == (
        "ValueError: frozen layer '0' is torch.float32 on meta; torch's dynamic int8 "
        "quantization, which runs a frozen layer, takes float32 layers on the CPU only"
    )
    assert errors[13].startswith("ValueError: frozen layer '0' is torch.float64 on cpu;")
    assert errors[14] == (
        "ValueError: state was saved with masked=True; this optimizer has masked=False"
    )
    assert errors[15].startswith(
        "ValueError: state['cocofl'] must hold steps, rounds and frozen (CoCoFL.state_dict())"
    )
