"""What optimizers and communicators put in state_dict, and what they refuse to load."""

import pytest
import torch
from sampling import RandomShift

import gossamer
import gossamer.bluefog as bf
from gossamer import optim
from gossamer.communicators import NeighborAllreduce
from gossamer.testing import run_distributed
from problems import least_squares_data, linear_model


def _loss(model, rank):
    A, b = least_squares_data(rank)
    return ((model(A).squeeze(1) - b) ** 2).mean()


def _win_put_steps(wait):
    """Three barrier-separated WindowPut steps; ``wait`` is how the puts are waited for."""
    model = linear_model()
    opt = optim.WindowPut(torch.optim.SGD(model.parameters(), lr=0.1), model)
    for _ in range(3):
        opt.zero_grad()
        _loss(model, gossamer.rank()).backward()
        getattr(opt, wait)()
        gossamer.barrier()
        opt.step()
        gossamer.barrier()
    opt.free()
    return model.weight.detach().clone()


def _unnamed(communication: dict) -> dict:
    """A communication state as saved before states carried the algorithm's name."""
    return {k: v for k, v in communication.items() if k != "algorithm"}


def _sgd(cls, **kwargs):
    """``cls`` over SGD on a model of its own."""
    model = linear_model()
    return cls(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)


def _states():
    r = gossamer.rank()
    out = {}
    # synchronize() before step() must not drop the step's combine.
    out["synchronize_keeps_combine"] = torch.equal(
        _win_put_steps("synchronize"), _win_put_steps("wait_puts")
    )
    progress = []
    for cls in (optim.AdaptWithCombine, optim.AdaptThenCombine, optim.GradientAllreduce):
        model = linear_model()
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.1), model)
        loss = _loss(model, r)
        after_forward = opt.step_in_progress
        loss.backward()
        after_backward = opt.step_in_progress
        opt.step()
        progress.append((after_forward, after_backward, opt.step_in_progress))
        opt.close()
    out["progress"] = progress

    # A model each: an optimizer over the parameters of another closes it.
    model = linear_model()
    push = optim.PushSum(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model = linear_model()
    put = optim.WindowPut(torch.optim.SGD(model.parameters(), lr=0.1), model)
    out["push_keys"] = sorted(push.state_dict()["communication"])
    out["put_keys"] = sorted(put.state_dict()["communication"])
    model = linear_model()
    awc = optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.1), model)
    model = linear_model()
    errors = {}
    for label, call in {
        "another algorithm": lambda: awc.load_state_dict(push.state_dict()),
        "foreign keys": lambda: awc.load_state_dict(
            {**push.state_dict(), "communication": _unnamed(push.state_dict()["communication"])}
        ),
        "same keys, another algorithm": lambda: optim.GradientAllreduce(
            torch.optim.SGD(model.parameters(), lr=0.1), model
        ).load_state_dict(awc.state_dict()),
        "window count": lambda: put.communicator.load_state_dict(
            {"rounds": 0, "buffers": [], "p_buffers": []}
        ),
        "psi_prev": lambda: optim.AdaptThenCombine(
            torch.optim.SGD(model.parameters(), lr=0.1), model
        ).load_state_dict(
            {
                "optimizer": awc.optimizer.state_dict(),
                "communication": {"steps": 0, "rounds": 0, "psi_prev": {3: torch.zeros(2)}},
            }
        ),
        "rng": lambda: NeighborAllreduce().load_state_dict(RandomShift(1).state_dict()),
        "another compression": lambda: _sgd(
            optim.AdaptWithCombine, compression="uint8"
        ).load_state_dict(awc.state_dict()),
        "error feedback": lambda: _sgd(
            optim.GradientAllreduce, compression="uint8", error_feedback=False
        ).load_state_dict(_sgd(optim.GradientAllreduce, compression="uint8").state_dict()),
    }.items():
        try:
            call()
            errors[label] = None
        except ValueError as err:
            errors[label] = str(err)
    out["errors"] = errors
    # The BlueFog facade runs the same algorithm: its optimizers load gossamer's states.
    model = linear_model()
    facade = bf.DistributedAdaptWithCombineOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model
    )
    facade.load_state_dict(awc.state_dict())
    out["facade_loads"] = facade.state_dict()["communication"]["algorithm"]
    facade.close()
    shift = RandomShift(5)
    for _ in range(3):
        shift.next_round()
    saved, drawn = shift.state_dict(), [shift.next_round() or shift.shift for _ in range(4)]
    fresh = RandomShift(5)
    fresh.load_state_dict(saved)
    out["rng_resumes"] = drawn == [fresh.next_round() or fresh.shift for _ in range(4)]
    for opt in (awc, put, push):
        opt.close()
    return out


@pytest.fixture(scope="module")
def states():
    return run_distributed(_states, 4, timeout=120)


def test_window_put_synchronize_keeps_the_combine(states):
    assert all(s["synchronize_keeps_combine"] for s in states)


def test_step_in_progress_spans_one_step(states):
    awc, atc, gradient_allreduce = states[0]["progress"]
    assert awc == (True, True, False)  # the combine starts at the forward pass
    assert atc == (False, True, False)  # backward takes the local steps; step() ends them
    assert gradient_allreduce == (False, True, False)  # gradients wait for step()


def test_window_patterns_save_their_slots(states):
    slots = {"algorithm", "buffers", "p_buffers", "versions", "rounds", "schedule_steps", "steps"}
    slots.add("compression_config")
    assert set(states[0]["put_keys"]) == slots
    assert set(states[0]["push_keys"]) == slots | {"p", "x"}


def test_mismatched_state_is_refused_with_a_reason(states):
    errors = states[0]["errors"]
    assert errors["another algorithm"] == (
        "state was saved by PushSum; this optimizer runs AdaptWithCombine (AdaptWithCombine)"
    )
    assert "['buffers', 'p', 'p_buffers', 'versions', 'x']" in errors["foreign keys"]
    assert (
        "saved by AdaptWithCombine; this optimizer runs GradientAllreduce"
        in (errors["same keys, another algorithm"])
    )
    assert states[0]["facade_loads"] == "AdaptWithCombine"
    assert "holds 0 windows" in errors["window count"]
    assert "psi_prev'][3]" in errors["psi_prev"]
    assert "random generator" in errors["rng"]
    assert errors["another compression"] == (
        "state was saved with no compression; this AdaptWithCombine runs compression='uint8'"
    )
    assert errors["error feedback"] == (
        "state was saved with compression='uint8', error_feedback=True; this "
        "GradientAllreduce runs compression='uint8', error_feedback=False"
    )


def test_a_sampling_communicator_resumes_its_draws(states):
    assert all(s["rng_resumes"] for s in states)
