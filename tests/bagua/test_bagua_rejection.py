"""The facade's own argument checks fail fast on every rank, as gossamer.ops' checks do.

One rank passes a bad argument to a ``gossamer.bagua`` call (``with_bagua`` or a
primitive whose check runs before its ``gossamer.ops`` call): it raises its own
``TypeError``/``ValueError``, every other rank raises ``PeerArgumentError`` naming it and
its reason well before the deadline, and the next call works everywhere.
"""

import time

import pytest
import torch
from torch import nn

import gossamer.bagua as bagua
from gossamer.bagua.algorithms import bytegrad, decentralized, gradient_allreduce, q_adam
from gossamer.bagua.data_parallel.distributed import DistributedDataParallel_V1_9_0
from gossamer.errors import PeerArgumentError, PeerError
from gossamer.testing import run_distributed

# Only a guard against a hang (the pool's deadline is 60 s).
HANG_GUARD_S = 20.0
BAD = 1


def _call(name, r, n):
    """The call of case ``name`` on rank ``r`` (bad arguments on rank ``BAD``)."""
    is_bad = r == BAD
    x = torch.ones(2 * n)
    if name == "with_bagua optimizers":
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        optimizers = ["sgd"] if is_bad else [opt]
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        return lambda: model.with_bagua(optimizers, algorithm)
    if name == "with_bagua algorithm":
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        algorithm = "decentralized" if is_bad else gradient_allreduce.GradientAllReduceAlgorithm()
        return lambda: model.with_bagua([opt], algorithm)
    if name in ("with_bagua do_flatten", "with_bagua no trainable parameter"):
        model = nn.Linear(2, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if is_bad and name == "with_bagua no trainable parameter":
            model.requires_grad_(False)
        flatten = "no" if is_bad and name == "with_bagua do_flatten" else True
        algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
        return lambda: model.with_bagua([opt], algorithm, do_flatten=flatten)
    if name == "with_bagua QAdam optimizer":
        model = nn.Linear(2, 2)
        own = q_adam.QAdamOptimizer(model.parameters(), warmup_steps=1)
        other = q_adam.QAdamOptimizer(nn.Linear(2, 2).parameters(), warmup_steps=1)
        algorithm = q_adam.QAdamAlgorithm(other if is_bad else own)
        return lambda: model.with_bagua([own], algorithm)
    if name.startswith("DistributedDataParallel"):
        return _ddp_call(name, is_bad)
    if name == "allreduce recv":
        recv = torch.zeros(3 if is_bad else 2 * n)
        return lambda: bagua.allreduce(x, recv)
    if name == "allreduce op":
        op = 42 if is_bad else bagua.ReduceOp.SUM
        return lambda: bagua.allreduce_inplace(x, op=op)
    if name == "reduce recv":
        recv = torch.zeros(1 if is_bad else 2 * n)
        return lambda: bagua.reduce(x, recv, dst=BAD)
    if name == "allgather recv":
        recv = torch.zeros(1 if is_bad else 2 * n * n)
        return lambda: bagua.allgather(x, recv)
    if name == "allgather_inplace size":
        t = torch.zeros(2 * n + 1 if is_bad else 2 * n)
        return lambda: bagua.allgather_inplace(t)
    if name == "gather recv":
        recv = torch.zeros(1 if is_bad else 2 * n * n)
        return lambda: bagua.gather(x, recv, dst=BAD)
    if name == "scatter recv":
        recv = [0.0, 0.0] if is_bad else torch.zeros(2)
        return lambda: bagua.scatter(x, recv, src=0)
    if name == "reduce_scatter op":
        op = 42 if is_bad else bagua.ReduceOp.SUM
        return lambda: bagua.reduce_scatter(x, torch.zeros(2), op=op)
    if name == "reduce_scatter_inplace op":
        op = 42 if is_bad else bagua.ReduceOp.SUM
        return lambda: bagua.reduce_scatter_inplace(x.clone(), op=op)
    if name == "alltoall recv":
        recv = torch.zeros(1 if is_bad else 2 * n)
        return lambda: bagua.alltoall(x, recv)
    if name == "alltoall_v recv":
        recv = torch.zeros(2, n).t() if is_bad else torch.zeros(2 * n)  # not contiguous
        counts, displs = [2] * n, [2 * k for k in range(n)]
        return lambda: bagua.alltoall_v(x, counts, displs, recv, counts, displs)
    if name in ("broadcast src", "reduce dst", "scatter src"):
        root = n + 5 if is_bad else 0  # Bagua's name for the root, not gossamer's
        return {
            "broadcast src": lambda: bagua.broadcast(x, src=root),
            "reduce dst": lambda: bagua.reduce(x, torch.zeros(2 * n), dst=root),
            "scatter src": lambda: bagua.scatter(x, torch.zeros(2), src=root),
        }[name]
    raise AssertionError(name)


def _ddp_call(name, is_bad):
    """The DDP wrapper's own checks: ``DistributedDataParallel`` and its module class."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    device_ids = None
    if is_bad and name == "DistributedDataParallel no trainable parameter":
        model.requires_grad_(False)
    if is_bad and name == "DistributedDataParallel device_ids":
        device_ids = [0, 1]  # the factory falls back to torch DDP; the class refuses
    if is_bad and name == "DistributedDataParallel device types":
        model[1].to("meta")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    algorithm = gradient_allreduce.GradientAllReduceAlgorithm()
    return lambda: DistributedDataParallel_V1_9_0(
        model, device_ids=device_ids, optimizers=[opt], algorithm=algorithm
    )


CASES = [
    "with_bagua optimizers",
    "with_bagua algorithm",
    "with_bagua do_flatten",
    "with_bagua no trainable parameter",
    "with_bagua QAdam optimizer",
    "DistributedDataParallel no trainable parameter",
    "DistributedDataParallel device_ids",
    "DistributedDataParallel device types",
    "allreduce recv",
    "allreduce op",
    "reduce recv",
    "allgather recv",
    "allgather_inplace size",
    "gather recv",
    "scatter recv",
    "reduce_scatter op",
    "reduce_scatter_inplace op",
    "alltoall recv",
    "alltoall_v recv",
    "broadcast src",
    "reduce dst",
    "scatter src",
]


def _every_case():
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    out = []
    for name in CASES:
        call = _call(name, r, n)
        bagua.barrier()
        start = time.monotonic()
        try:
            call()
            outcome = ("ok", "")
        except PeerArgumentError as err:
            outcome = ("peer", str(err), err.rank)
        except (ValueError, TypeError) as err:
            outcome = ("own", f"{type(err).__name__}: {err}")
        elapsed = time.monotonic() - start
        after = torch.ones(2)  # the next call works on every rank
        bagua.allreduce_inplace(after)
        out.append((name, outcome, elapsed, after.tolist()))
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_bad_facade_argument_on_one_rank_raises_on_every_rank(world_size):
    got = run_distributed(_every_case, world_size)
    for k, name in enumerate(CASES):
        own = got[BAD][k][1]
        assert own[0] == "own", (name, own)
        for r in range(world_size):
            _, outcome, elapsed, after = got[r][k]
            assert after == [float(world_size)] * 2, (name, r)
            if r == BAD:
                continue
            assert elapsed < HANG_GUARD_S, (name, r, elapsed)
            assert outcome[0] == "peer", (name, r, outcome)
            assert f"rank {BAD} rejected its arguments: {own[1]}" in outcome[1], (name, outcome)
            assert outcome[2] == BAD
    # the messages name the argument, on the rank that passed it and on its peers
    assert got[0][0][1][1] == (
        "with_bagua: barrier: rank 1 rejected its arguments: TypeError: optimizers must be a "
        "list of torch.optim.Optimizer (not gossamer ones, which communicate themselves); "
        "got ['sgd']"
    )
    assert got[BAD][2][1][1] == "TypeError: do_flatten must be a bool; got 'no'"
    assert got[BAD][3][1][1] == (
        "ValueError: with_bagua is not needed when a module has no parameter that requires a "
        "gradient"
    )
    assert got[BAD][4][1][1].startswith(
        "ValueError: QAdamAlgorithm's q_adam_optimizer must be one of the optimizers given"
    )
    assert got[0][7][1][1] == (
        "DistributedDataParallel: barrier: rank 1 rejected its arguments: ValueError: "
        "the module's parameters must be on one type of device; got ['cpu', 'meta']"
    )
    assert got[BAD][8][1][1] == (
        f"ValueError: allreduce: recv_tensor must have {2 * world_size} elements; got 3"
    )
    for k in range(len(CASES) - 3, len(CASES)):  # Bagua's src / dst, not gossamer's root
        assert "must be a rank of the communicator (0.." in got[BAD][k][1][1]
        assert CASES[k].split()[1] + " must be" in got[BAD][k][1][1]


def _other_algorithm(case):
    bagua.init_process_group()
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    first = bagua.get_rank() == 0
    if case == "class":
        algorithm = (
            gradient_allreduce.GradientAllReduceAlgorithm()
            if first
            else decentralized.DecentralizedAlgorithm()
        )
    else:
        algorithm = bytegrad.ByteGradAlgorithm(hierarchical=first)
    try:
        model.with_bagua([opt], algorithm)
    except PeerError as err:
        return str(err)
    return "wrapped"


@pytest.mark.parametrize("case", ["class", "hierarchical"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_wrapping_with_other_algorithms_raise_on_every_rank(case, world_size):
    # Both ran on before: gradient allreduce averaged its gradients with the other rank's
    # weights (the same allreduce sizes), and the hierarchical mismatch hung for the deadline.
    others = list(range(1, world_size))
    for message in run_distributed(_other_algorithm, world_size, args=(case,)):
        assert message.startswith(
            f"with_bagua: ranks {others} gave other settings than rank 0; every "
            "rank must give the same (this rank: algorithm="
        ), message
