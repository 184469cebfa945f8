"""Fuzz the operations, windows and optimizers in a world of one rank.

Each ``fuzz_*`` function is a hypothesis test that runs inside one rank process of
``run_distributed(..., 1)`` (gossamer initialized, world size 1), so the whole search stays
in one process: :data:`EXAMPLES_PER_RUN` adds up to more than 1000 generated calls per run.
In a world of one every collective is the identity (or a scaling), which makes the
reference simple while every argument check runs as on a real job. Valid arguments must
give the reference's result, bad ones a TypeError or ValueError naming them
(:func:`fuzz_cases.verdict`), every dtype with a wire code included; after each fuzzer
nothing is left behind (no window, no unmatched operation).

Multi-rank fuzzing is in ``test_fuzz_distributed.py``, the fuzzers' findings as fixed
examples in ``test_fuzz_regressions.py``.
"""

import numpy as np
import pytest
import torch
from fuzz_cases import (
    EXAMPLES,
    FUZZ,
    Arg,
    bad,
    bad_float,
    bad_int,
    call,
    flag,
    good,
    mostly,
    verdict,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import gossamer
import gossamer.bluefog as bf
from gossamer import optim
from gossamer import topology as T
from gossamer.testing import run_distributed
from gossamer.topology import Step, Topology
from gossamer.transport import DTYPES

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
COMPLEX = (torch.complex64, torch.complex128)
INTS = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
# Dtypes that travel as bytes (broadcast, gathers, windows) but have no reduction.
WIDE_UNSIGNED = (torch.uint16, torch.uint32, torch.uint64)
ALL = tuple(DTYPES)  # every dtype with a wire code
assert set(ALL) == {*FLOATS, *COMPLEX, *INTS, torch.bool, *WIDE_UNSIGNED}
# Dtypes no operation supports.
UNSUPPORTED = (torch.float8_e4m3fn, torch.float8_e5m2)


# Examples per run of each fuzzer (hypothesis stops there; the test checks they ran).
EXAMPLES_PER_RUN = {
    "collectives": 300,
    "neighbor_allreduce": 220,
    "neighbor_allgather": 100,
    "pair_gossip": 30,
    "window": 160,
    "optimizer": 100,
    "window_optimizer": 60,
    "bluefog_neighbor_allreduce": 80,
}


@st.composite
def tensors(draw, dtypes, min_dims=0):
    shape = draw(st.lists(st.integers(0, 4), min_size=min_dims, max_size=3))
    dtype = draw(st.sampled_from(dtypes))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    if dtype.is_floating_point or dtype.is_complex:
        wide = torch.complex128 if dtype.is_complex else torch.float64
        t = (torch.randn(shape, generator=gen, dtype=wide) * 4).to(dtype)
    elif dtype == torch.bool:
        t = torch.randint(0, 2, shape, generator=gen).bool()
    else:
        t = torch.randint(0, 100, shape, generator=gen).to(dtype)
    if len(shape) >= 2 and draw(st.booleans()):
        t = t.transpose(0, 1)  # not contiguous
    return t


def tensor_arg(dtypes, others=(), min_dims=0):
    """A tensor of ``dtypes``; bad: not a tensor, or a tensor of ``others``' dtypes."""
    wrong = [bad(st.sampled_from([None, [1.0, 2.0], 3.0, "t"]), "not a tensor")]
    if others:
        wrong.append(bad(tensors(others, min_dims), "dtype"))
    if min_dims:
        wrong.append(bad(tensors(dtypes, 0).filter(lambda t: t.dim() == 0), "a scalar"))
    return mostly(good(tensors(dtypes, min_dims)), st.one_of(wrong), 5)


def group_arg():
    return mostly(good(st.none()), bad(st.sampled_from(["world", 0, object()]), "not a group"), 8)


def finish(result, async_op):
    return result.wait() if async_op else result


def same(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    if expected.dtype.is_floating_point or expected.dtype.is_complex:
        torch.testing.assert_close(got, expected, equal_nan=True)
    else:  # integers and bool exactly (assert_close lacks the wide unsigned types)
        assert torch.equal(got, expected), (got, expected)


# ---------------------------------------------------------------------- collectives
@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["collectives"])
@given(
    op=st.sampled_from(
        ["allreduce", "allreduce_", "broadcast", "broadcast_", "allgather", "alltoall", "barrier"]
    ),
    data=st.data(),
    group=group_arg(),
    async_op=flag(),
)
def fuzz_collectives(op, data, group, async_op):
    EXAMPLES["collectives"] += 1
    args = {"group": group, "async_op": async_op}
    kwargs = {}
    if op == "barrier":
        result = verdict(call(gossamer.barrier, group=group.value, async_op=async_op.value), args)
        if result is not None:
            result.wait()
        return
    if op.startswith("allreduce"):
        average = data.draw(flag(), "average")
        args["average"] = kwargs["average"] = average
        # Sums also take integers and bool (a logical or); averages floating and complex
        # types only; the wide unsigned types have no reduction.
        averaging = (*FLOATS, *COMPLEX)
        dtypes = averaging if average.value is True else (*averaging, *INTS, torch.bool)
        others = UNSUPPORTED + WIDE_UNSIGNED
        others += (*INTS, torch.bool) if average.value is True else ()
        tensor = data.draw(tensor_arg(dtypes, others), "tensor")
    elif op.startswith("broadcast"):
        root = data.draw(mostly(good(st.just(0)), bad_int(0, 0)), "root")
        args["root"] = kwargs["root"] = root
        tensor = data.draw(tensor_arg(ALL, UNSUPPORTED), "tensor")
    else:  # allgather, alltoall: at least one dimension (dim 0 a multiple of 1)
        tensor = data.draw(tensor_arg(ALL, UNSUPPORTED, 1), "tensor")
    args["tensor"] = tensor
    before = tensor.value.clone() if isinstance(tensor.value, torch.Tensor) else None
    fn = getattr(gossamer, op)
    outcome = call(
        fn, tensor.value, group=group.value, async_op=async_op.value,
        **{k: a.value for k, a in kwargs.items()},
    )  # fmt: skip
    result = verdict(outcome, args, names={"tensor": (op,)})
    if result is None:
        return
    out = finish(result, async_op.value)
    same(out, before)  # sum, average, broadcast, gathers over one rank are the identity
    if op.endswith("_"):
        assert out is tensor.value
    else:
        assert out.data_ptr() != tensor.value.data_ptr() or out.numel() == 0
        same(tensor.value, before)  # out of place: the input is untouched


# ---------------------------------------------------------------------- neighbour operations
def weight(none_ok=False):
    valid = st.floats(-3, 3) | st.integers(-2, 2) | st.just(1.0)
    if none_ok:
        valid = st.none() | valid
    return mostly(good(valid), bad_float(none_ok=none_ok), 8)


def size_one_topologies():
    # Mostly a self weight other than 1: the case a world of one can get wrong.
    self_weighted = st.floats(0, 2).map(lambda w: Topology([[w]]))
    return st.one_of(st.just(T.exponential_two(1)), self_weighted, self_weighted)


def topology_arg():
    return mostly(
        good(st.none() | size_one_topologies()),
        st.one_of(
            bad(st.integers(2, 4).map(T.ring), "size differs from the world's"),
            bad(st.sampled_from([[[1.0]], "ring", 1]), "not a Topology"),
        ),
        8,
    )


def rank_map(values):
    """{rank: weight} maps over a world of one: only {} is valid."""
    return mostly(
        good(st.just({})),
        st.one_of(
            bad(st.builds(dict, st.just([(0, 0.5)])), "this rank"),
            bad(
                st.dictionaries(st.integers(1, 5) | st.integers(-3, -1), values, min_size=1), "rank"
            ),
            bad(st.sampled_from([{"0": 1.0}, {True: 1.0}, {0.0: 1.0}]), "key type"),
            bad(st.sampled_from([[(0, 1.0)], "01", 0.5]), "not a mapping"),
        ),
        4,
    )


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["neighbor_allreduce"])
@given(
    tensor=tensor_arg(FLOATS + COMPLEX, (*INTS, torch.bool, *WIDE_UNSIGNED)),
    mode=st.sampled_from(["static", "weights", "dynamic", "dynamic list", "bad pairing"]),
    self_weight=weight(),
    src_weights=rank_map(st.floats(-1, 1)),
    dst_weights=rank_map(st.floats(-1, 1)),
    topology=topology_arg(),
    check_topology=flag(),
    group=group_arg(),
    async_op=flag(),
)
def fuzz_neighbor_allreduce(
    tensor, mode, self_weight, src_weights, dst_weights, topology, check_topology, group, async_op
):
    EXAMPLES["neighbor_allreduce"] += 1
    kwargs = {"topology": topology, "check_topology": check_topology, "group": group}
    kwargs["async_op"] = async_op
    extra = {}
    if mode == "static":
        pass
    elif mode == "weights":
        kwargs.update(self_weight=self_weight, src_weights=src_weights)
    elif mode == "dynamic":
        kwargs.update(self_weight=self_weight, src_weights=src_weights, dst_weights=dst_weights)
    elif mode == "dynamic list":
        dst = Arg([]) if dst_weights.bad is None else Arg([0], "this rank")
        kwargs.update(self_weight=self_weight, src_weights=src_weights, dst_weights=dst)
    else:  # a weight argument without its partner
        kwargs.update(self_weight=self_weight)
        extra["self_weight"] = "without src_weights"
    names = {"self_weight": ("src_weights",), "dst_weights": ("src_weights", "self_weight")}
    before = tensor.value.clone() if isinstance(tensor.value, torch.Tensor) else None
    outcome = call(
        gossamer.neighbor_allreduce, tensor.value, **{k: a.value for k, a in kwargs.items()}
    )
    result = verdict(outcome, {"tensor": tensor, **kwargs}, names=names, extra_bad=extra)
    if result is None:
        return
    out = finish(result, async_op.value)
    if "self_weight" in kwargs:
        w = self_weight.value
    else:  # the topology's self weight: W[0, 0]
        w = (topology.value or T.exponential_two(1)).weights[0, 0]
    wide = torch.float32 if before.dtype in (torch.float16, torch.bfloat16) else before.dtype
    expected = before if w == 1.0 else (before.to(wide) * w).to(before.dtype)
    same(out, expected)
    same(tensor.value, before)


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["neighbor_allgather"])
@given(
    tensor=tensor_arg(ALL, UNSUPPORTED, 1),
    ranks=st.sampled_from(["static", "dynamic", "src only", "dst only"]),
    src=mostly(good(st.just([]) | st.just(())), bad(st.sampled_from([[0], [1], ["0"], 5]), "r")),
    dst=mostly(good(st.just([])), bad(st.sampled_from([[0], [0, 0], [-1], "0"]), "rank")),
    topology=topology_arg(),
    async_op=flag(),
)
def fuzz_neighbor_allgather(tensor, ranks, src, dst, topology, async_op):
    EXAMPLES["neighbor_allgather"] += 1
    args = {"tensor": tensor, "topology": topology, "async_op": async_op}
    extra = {}
    if ranks == "dynamic":
        args.update(src_ranks=src, dst_ranks=dst)
    elif ranks == "src only":
        args.update(src_ranks=src)
        extra["src_ranks"] = "without dst_ranks"
    elif ranks == "dst only":
        args.update(dst_ranks=dst)
        extra["dst_ranks"] = "without src_ranks"
    names = {"src_ranks": ("dst_ranks",), "dst_ranks": ("src_ranks",)}
    kwargs = {k: a.value for k, a in args.items() if k != "tensor"}
    outcome = call(gossamer.neighbor_allgather, tensor.value, **kwargs)
    result = verdict(outcome, args, names=names, extra_bad=extra)
    if result is None:
        return
    out = finish(result, async_op.value)
    assert out.shape == (0, *tensor.value.shape[1:]) and out.dtype == tensor.value.dtype


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["pair_gossip"])
@given(
    tensor=tensor_arg(FLOATS, INTS),
    target=st.integers(-1, 3) | st.sampled_from([None, 0.0, True]),
    weights=st.sampled_from([(None, None), (0.5, 0.5), (0.5, None)]),
)
def fuzz_pair_gossip(tensor, target, weights):
    EXAMPLES["pair_gossip"] += 1
    # In a world of one there is no other rank to gossip with: every call is refused.
    self_weight, pair_weight = weights
    args = {"tensor": tensor, "target": Arg(target, "no other rank")}
    outcome = call(
        gossamer.pair_gossip, tensor.value, target, self_weight=self_weight,
        pair_weight=pair_weight,
    )  # fmt: skip
    verdict(outcome, args, names={"target": ("pair_weight", "self_weight")})


# ---------------------------------------------------------------------- windows
@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["window"])
@given(
    tensor=tensor_arg(ALL),  # windows move bytes: every dtype
    zero_init=flag(),
    name=mostly(good(st.none() | st.text("abcü", min_size=1, max_size=4)), bad(st.just(3), "n")),
    push_sum=flag(),
    topology=topology_arg(),
    # Several operations on one window: each starts from what the previous one left.
    ops=st.lists(st.sampled_from(["put", "accumulate", "get", "update", "update"]), max_size=3),
    data=st.data(),
)
def fuzz_window(tensor, zero_init, name, push_sum, topology, ops, data):
    EXAMPLES["window"] += 1
    create = {
        "tensor": tensor,
        "zero_init": zero_init,
        "name": name,
        "push_sum": push_sum,
        "topology": topology,
    }
    kwargs = {k: a.value for k, a in create.items() if k != "tensor"}
    names = {"tensor": ("Window.create",)}
    window = verdict(call(gossamer.Window.create, tensor.value, **kwargs), create, names=names)
    if window is None:
        return
    try:
        for op in ops or ["update"]:
            _window_op(window, op, data, topology.value)
    finally:
        window.free()
    assert window.name not in gossamer.live_windows()


def _scaled(x, w):
    """``w * x`` in ``x``'s dtype: integer and bool windows round half to even."""
    if x.dtype.is_complex:
        return (x.to(torch.complex128) * w).to(x.dtype)
    out = x.double() * w
    return (out if x.dtype.is_floating_point else out.round()).to(x.dtype)


def _window_op(window, op, data, topology):
    x = window.tensor
    before = x.clone()
    args = {}
    if op in ("put", "accumulate"):
        other = torch.float32 if x.dtype == torch.float64 else torch.float64
        mismatched = [
            x.new_zeros(x.shape, dtype=other),
            x.new_zeros((*x.shape, 2)),
            [1.0],
        ]
        args["tensor"] = data.draw(
            mostly(
                good(st.sampled_from([None, "same"])),
                bad(st.sampled_from(mismatched), "does not match the window"),
            ),
            "tensor",
        )
        if args["tensor"].value == "same":
            args["tensor"] = Arg(x)
        args["self_weight"] = data.draw(weight(none_ok=True), "self_weight")
        args["dst_weights"] = data.draw(rank_map(st.floats(0, 1)) | good(st.none()), "dst")
        args["require_mutex"] = data.draw(flag(), "require_mutex")
        args["async_op"] = data.draw(flag(), "async_op")
        kwargs = {k: a.value for k, a in args.items() if k != "tensor"}
        result = verdict(call(getattr(window, op), args["tensor"].value, **kwargs), args)
        if result is None and any(a.bad for a in args.values()):
            return
        if args["async_op"].value:
            result.wait()
        w = args["self_weight"].value
        expected = before if w is None or w == 1.0 else _scaled(before, w)
        same(x, expected)  # the registered tensor is scaled in place by self_weight
        return
    if op == "get":
        args["src_weights"] = data.draw(rank_map(st.floats(0, 1)) | good(st.none()), "src")
        args["async_op"] = data.draw(flag(), "async_op")
        kwargs = {k: a.value for k, a in args.items()}
        result = verdict(call(window.get, **kwargs), args)
        if result is not None:
            result.wait()
        return
    weights = data.draw(st.booleans(), "weights given")
    if weights:
        args["self_weight"] = data.draw(weight(), "self_weight")
        args["src_weights"] = data.draw(rank_map(st.floats(0, 1)), "src_weights")
    args["reset"] = data.draw(flag(), "reset")
    args["clone"] = data.draw(flag(), "clone")
    args["require_mutex"] = data.draw(flag(), "require_mutex")
    kwargs = {k: a.value for k, a in args.items()}
    out = verdict(call(window.update, **kwargs), args)
    if out is None:
        return
    w = args["self_weight"].value if weights else (topology or T.exponential_two(1)).weights[0, 0]
    expected = before if w == 1.0 else _scaled(before, w)
    same(out, expected)
    same(x, before if args["clone"].value else expected)


# ---------------------------------------------------------------------- optimizers
def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 2), nn.Tanh(), nn.Linear(2, 1))


def _train(opt, model, steps=2):
    x = torch.linspace(-1, 1, 12).reshape(4, 3)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).sum().backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def identity_topologies():
    # W[0, 0] = 1: combining is the identity, so training must match plain SGD.
    return st.sampled_from([T.exponential_two(1), T.ring(1), Topology([[1.0]])])


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["optimizer"])
@given(
    kind=st.sampled_from(["AdaptThenCombine", "AdaptWithCombine", "GradientAllreduce"]),
    steps=mostly(good(st.integers(1, 3)), bad_int(1)),
    fusion=mostly(
        good(st.none() | st.integers(0, 64) | st.just(8 * 2**20)), bad_int(0, none_ok=True)
    ),
    communication=mostly(
        good(st.none() | st.sampled_from(["neighbor_allreduce", "allreduce", "none"])),
        bad(st.sampled_from(["gossip", "", 1, "NEIGHBOR_ALLREDUCE"]), "unknown"),
        8,
    ),
    topology=mostly(
        good(st.none() | identity_topologies()),
        st.one_of(
            bad(st.integers(2, 3).map(T.ring), "size differs from the world's"),
            bad(st.sampled_from(["ring", [[1.0]]]), "not a Topology"),
        ),
        8,
    ),
    schedule=st.booleans(),
    every=mostly(good(st.none() | st.integers(1, 3)), bad_int(1, none_ok=True), 8),
    exact_diffusion=flag(),
)
def fuzz_optimizer(kind, steps, fusion, communication, topology, schedule, every, exact_diffusion):
    EXAMPLES["optimizer"] += 1
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    args = {"num_steps_per_communication": steps, "fusion_threshold_bytes": fusion}
    if kind != "GradientAllreduce":
        args.update(communication=communication, topology=topology, global_average_every=every)
        if schedule:
            args["schedule"] = Arg(iter([Step.uniform([], [])] * 10))
    if kind == "AdaptThenCombine":
        args["exact_diffusion"] = exact_diffusion
    extra = {}
    if schedule and topology.value is not None and kind != "GradientAllreduce":
        extra["topology"] = "with a schedule"
    # exact_diffusion is checked first (a failed constructor must leave no hooks)
    if kind == "AdaptThenCombine" and exact_diffusion.value and steps.value != 1:
        extra["exact_diffusion"] = "needs num_steps_per_communication=1"
    names = {
        "topology": ("schedule",),
        "exact_diffusion": ("num_steps_per_communication",),
    }
    cls = getattr(optim, kind)
    kwargs = {k: a.value for k, a in args.items()}
    opt = verdict(call(cls, base, model, **kwargs), args, names=names, extra_bad=extra)
    if opt is None:
        return
    assert opt.num_steps_per_communication == steps.value
    with opt:
        got = _train(opt, model)
    reference_model = _model()
    reference = _train(torch.optim.SGD(reference_model.parameters(), lr=0.1), reference_model)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["window_optimizer"])
@given(
    kind=st.sampled_from(["PushSum", "WindowPut"]),
    steps=mostly(good(st.integers(1, 3)), bad_int(1)),
    fusion=mostly(good(st.none() | st.integers(0, 64)), bad_int(0, none_ok=True)),
    communication=mostly(
        good(st.none() | st.just("neighbor_allreduce")),
        bad(st.sampled_from(["allreduce", "none", "", 3]), "windows only"),
        6,
    ),
    topology=mostly(
        good(st.none() | identity_topologies()),
        st.one_of(
            bad(st.integers(2, 3).map(T.ring), "size differs from the world's"),
            bad(st.sampled_from(["ring", [[1.0]]]), "not a Topology"),
        ),
        6,
    ),
)
def fuzz_window_optimizer(kind, steps, fusion, communication, topology):
    EXAMPLES["window_optimizer"] += 1
    model = _model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    args = {
        "num_steps_per_communication": steps,
        "fusion_threshold_bytes": fusion,
        "communication": communication,
        "topology": topology,
    }
    kwargs = {k: a.value for k, a in args.items()}
    opt = verdict(call(getattr(optim, kind), base, model, **kwargs), args)
    # A refused optimizer must not leave windows behind (they would block set_topology).
    if opt is None:
        assert gossamer.live_windows() == []
        return
    try:
        got = _train(opt, model)
    finally:
        opt.close()
    assert gossamer.live_windows() == []
    reference_model = _model()
    reference = _train(torch.optim.SGD(reference_model.parameters(), lr=0.1), reference_model)
    for a, b in zip(got, reference, strict=True):
        torch.testing.assert_close(a, b)


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["bluefog_neighbor_allreduce"])
@given(
    tensor=mostly(
        good(tensors(FLOATS[:2])),
        bad(tensors((torch.int64, torch.int32)), "not floating point"),
        6,
    ),
    mode=st.sampled_from(["static", "weights", "dynamic", "dynamic list", "self_weight alone"]),
    self_weight=mostly(
        good(st.floats(-3, 3) | st.integers(-2, 2) | st.just(np.float64(0.5))),
        bad(st.sampled_from(["0.5", True, [0.5]]), "not a float"),
        8,
    ),
    src_weights=mostly(
        good(st.just({})),
        st.one_of(
            bad(st.just({0: 0.5}), "this rank"),
            bad(st.just({np.int64(3): 0.5}), "not a rank"),
            bad(st.sampled_from([[0], "0"]), "not a dict"),
        ),
        6,
    ),
    removed=st.sampled_from([None, None, None, "neighbor_weights", "send_neighbors"]),
    nonblocking=st.booleans(),
    name=st.none() | st.text("xyz", min_size=1, max_size=3),
)
def fuzz_bluefog_neighbor_allreduce(
    tensor, mode, self_weight, src_weights, removed, nonblocking, name
):
    EXAMPLES["bluefog_neighbor_allreduce"] += 1
    bf.init()
    args = {"tensor": tensor}
    extra = {}
    if mode != "static":
        args["self_weight"] = self_weight
    if mode in ("weights", "dynamic", "dynamic list"):
        args["src_weights"] = src_weights
    if mode == "dynamic":
        args["dst_weights"] = Arg({})
    elif mode == "dynamic list":
        args["dst_weights"] = Arg([])
    elif mode == "self_weight alone":
        extra["self_weight"] = "without src_weights"
    kwargs = {k: a.value for k, a in args.items() if k != "tensor"}
    if removed is not None:
        kwargs[removed] = {}
        extra[removed] = "a removed argument"  # BlueFog raises TypeError with a hint
    fn = bf.neighbor_allreduce_nonblocking if nonblocking else bf.neighbor_allreduce
    names = {
        "tensor": ("floating-point",),
        "self_weight": ("src_weights",),
        "src_weights": ("self_weight",),
    }
    outcome = call(fn, tensor.value, name=name, **kwargs)
    result = verdict(outcome, args, names=names, extra_bad=extra)
    if result is None:
        return
    out = bf.synchronize(result) if nonblocking else result
    w = float(self_weight.value) if "self_weight" in args else 1.0
    expected = tensor.value if w == 1.0 else tensor.value * w
    same(out, expected)


# ---------------------------------------------------------------------- the pytest side
FUZZERS = {
    "collectives": fuzz_collectives,
    "neighbor_allreduce": fuzz_neighbor_allreduce,
    "neighbor_allgather": fuzz_neighbor_allgather,
    "pair_gossip": fuzz_pair_gossip,
    "window": fuzz_window,
    "optimizer": fuzz_optimizer,
    "window_optimizer": fuzz_window_optimizer,
    "bluefog_neighbor_allreduce": fuzz_bluefog_neighbor_allreduce,
}


def _run(name):
    assert gossamer.size() == 1
    EXAMPLES[name] = 0
    FUZZERS[name]()
    # Every example freed what it created, and left no operation half done.
    assert gossamer.live_windows() == []
    assert torch.equal(gossamer.allreduce(torch.ones(2)), torch.ones(2))
    return EXAMPLES[name]


@pytest.mark.parametrize("name", sorted(FUZZERS))
def test_world_of_one(name):
    (examples,) = run_distributed(_run, 1, args=(name,), timeout=240)
    assert examples >= EXAMPLES_PER_RUN[name]


def test_examples_per_run():
    # The bar: at least 1000 generated calls per CI run in one process.
    assert sum(EXAMPLES_PER_RUN.values()) >= 1000
