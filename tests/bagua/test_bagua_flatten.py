"""``do_flatten=True`` re-points the tensors into the buckets and changes no value.

Each algorithm trains the same model on the same data twice on 2 ranks, with
``do_flatten=True`` (tensors are slices of the bucket's flat buffer: no packing copy) and
``do_flatten=False`` (tensors packed into the buffer and results copied back). The weights
must be bit-identical after every step. The model has a parameter that gets no gradient,
and the steps alternate ``zero_grad(set_to_none=True)`` (fresh gradients, re-pointed when
marked ready) and ``set_to_none=False`` (gradients stay in the buffer).
"""

import pytest
import torch
from bagua_problems import data, flat, loss, model
from torch import nn

import gossamer.bagua as bagua
from gossamer.bagua.algorithms import bytegrad, decentralized, gradient_allreduce, q_adam
from gossamer.testing import run_distributed

STEPS = 5


def _algorithm(name, opt):
    if name == "gradient_allreduce":
        return gradient_allreduce.GradientAllReduceAlgorithm()
    if name == "bytegrad":
        return bytegrad.ByteGradAlgorithm(hierarchical=False)
    if name.startswith("decentralized"):
        mode = name.split("/")[1]
        return decentralized.DecentralizedAlgorithm(hierarchical=False, peer_selection_mode=mode)
    if name == "low_precision_decentralized":
        return decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    if name == "qadam":
        return q_adam.QAdamAlgorithm(opt, hierarchical=False)
    raise AssertionError(name)


def _train(name, do_flatten):
    r = bagua.get_rank()
    m = model(r)
    m.register_parameter("unused", nn.Parameter(torch.ones(3, dtype=torch.float64)))
    params = list(m.parameters())
    if name == "qadam":
        opt = q_adam.QAdamOptimizer(m.parameters(), lr=0.01, warmup_steps=2)
    else:
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    m.with_bagua([opt], _algorithm(name, opt), do_flatten=do_flatten)
    x, y = data(r)
    out = []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=step % 2 == 0)
        loss(m, x, y).backward()
        opt.step()
        out.append(flat(m))
    # the same Parameter objects, still those the optimizer steps
    assert [id(p) for p in m.parameters()] == [id(p) for p in params]
    assert [id(p) for p in opt.param_groups[0]["params"]] == [id(p) for p in params]
    flattened = [b.check_flatten() for b in m.bagua_buckets]
    return out, flattened


def _both(name):
    bagua.init_process_group()
    return _train(name, True), _train(name, False)


@pytest.mark.parametrize(
    "name",
    [
        "gradient_allreduce",
        "bytegrad",
        "decentralized/all",
        "decentralized/shift_one",
        "low_precision_decentralized",
        "qadam",
    ],
)
def test_do_flatten_gives_the_same_weights_bit_for_bit(name):
    for rank, ((flat_steps, flat_buckets), (copy_steps, copy_buckets)) in enumerate(
        run_distributed(_both, 2, args=(name,))
    ):
        for step, (a, b) in enumerate(zip(flat_steps, copy_steps, strict=True)):
            assert torch.equal(a, b), (name, rank, step + 1, (a - b).abs().max())
        assert flat_steps[0].ne(flat_steps[-1]).any()  # it trained
        assert all(flat_buckets), (name, rank)  # tensors are slices of the buckets
        assert not any(copy_buckets), (name, rank)  # ... only with do_flatten=True


class _Transposed(nn.Module):
    """A weight that is a transposed view: not contiguous."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.arange(24.0).reshape(6, 4).t() / 24)
        self.b = nn.Parameter(torch.zeros(6))

    def forward(self, x):
        return ((x @ self.w) + self.b).pow(2).sum()


def _transposed(name):
    bagua.init_process_group()
    r = bagua.get_rank()
    out = []
    for do_flatten in (True, False):
        m = _Transposed()
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        m.with_bagua([opt], _algorithm(name, opt), do_flatten=do_flatten)
        for _ in range(3):
            opt.zero_grad()
            m(torch.ones(2, 4) * (r + 1)).backward()
            opt.step()
        out.append(flat(m))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("name", ["gradient_allreduce", "decentralized/all"])
def test_a_non_contiguous_parameter_flattens_without_changing_a_value(name, world_size):
    for flattened, copied in run_distributed(_transposed, world_size, args=(name,)):
        # Flattened, the weight is contiguous: its matmul may round in another order.
        assert torch.allclose(flattened, copied, rtol=0, atol=1e-6), (flattened - copied).abs()
