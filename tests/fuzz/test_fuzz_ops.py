"""Fuzz the communication API in a world of one: ops, windows and optimizer constructors.

Every example is one call with generated arguments, run in one rank process (a world of
one, started once for the whole module). Valid arguments must give what the reference below
computes from the documented math (in a world of one: every collective returns this rank's
value, a neighbour average is ``self_weight * x``, a window update ``w_rr * x``); a call with
a bad argument must raise TypeError or ValueError naming it (:func:`fuzz_cases.verdict`),
and leave nothing behind: the next call still works.

:data:`EXAMPLES` calls per run; each kind of call gets its share.
"""

import os
import time

import numpy as np
import torch
from fuzz_cases import FUZZ, Arg, bad, bad_bool, bad_float, bad_int, call, good, mostly
from fuzz_cases import verdict as judge
from hypothesis import given, settings
from hypothesis import strategies as st

import gossamer
from gossamer import topology as T
from gossamer.optim import AdaptThenCombine, AdaptWithCombine, GradientAllreduce, PushSum, WindowPut
from gossamer.testing import run_distributed
from gossamer.transport import DTYPES

EXAMPLES = int(os.environ.get("GOSSAMER_FUZZ_EXAMPLES", "1050"))
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
AVERAGING = [*FLOATS, torch.complex64, torch.complex128]
SUMMABLE = [*AVERAGING, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
WRONG = st.sampled_from([None, "x", [1.0], (1,), {1: 1}, 1j, object()])
NOT_STR = bad(st.sampled_from([b"w", 1, [1.0], object()]), "not a str")


def make_tensor(dtype, shape, seed):
    """Small values that every dtype holds exactly (so sums compare exactly)."""
    g = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 5, shape, generator=g, dtype=torch.int64)
    if dtype == torch.bool:
        return values > 2
    return values.to(dtype)


@st.composite
def tensors(draw, dtypes=tuple(DTYPES), min_dims=0):
    dtype = draw(st.sampled_from(list(dtypes)))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=min_dims, max_size=3)))
    return make_tensor(dtype, shape, draw(st.integers(0, 2**16)))


def tensor_arg(dtypes=tuple(DTYPES), min_dims=0):
    good_ones = good(tensors(dtypes, min_dims))
    bad_ones = bad(WRONG | st.sampled_from([np.ones(2), 1.0, 3]), "not a tensor")
    return mostly(good_ones, bad_ones, 8)


def weight_arg():
    # None means "not given" (a combination the cases judge), so it is no bad value here.
    wrong = bad_float().filter(lambda a: a.value is not None)
    return mostly(good(st.floats(-2, 2, allow_subnormal=False)), wrong, 8)


def rank_dict_arg(name):
    """A weights mapping in a world of one: only ``{}`` names no bad rank."""
    return mostly(
        good(st.just({})),
        st.one_of(
            bad(st.sampled_from([{0: 0.5}]), f"{name} names this rank"),
            bad(st.sampled_from([{1: 0.5}, {-1: 0.5}, {True: 0.5}, {"0": 0.5}]), "bad rank"),
            bad(WRONG.filter(lambda v: v is not None and not isinstance(v, dict)), "type"),
        ),
        6,
    )


def rank_list_arg(name):
    return mostly(
        good(st.sampled_from([[], ()])),
        st.one_of(
            bad(st.sampled_from([[0]]), f"{name} names this rank"),
            bad(st.sampled_from([[1], [-1], [True], ["0"], "0"]), "bad rank"),
        ),
        6,
    )


def topology_arg():
    return mostly(
        good(st.sampled_from([None, T.fully_connected(1), T.ring(1)])),
        st.one_of(
            bad(st.sampled_from([T.ring(2), T.fully_connected(3)]), "wrong size"),
            bad(st.sampled_from(["ring", 1, np.eye(1)]), "not a Topology"),
        ),
        6,
    )


def bool_arg():
    return mostly(good(st.booleans()), bad_bool(), 8)


def assert_matches(got, want):
    assert isinstance(got, torch.Tensor), got
    assert got.dtype == want.dtype and got.shape == want.shape, (got, want)
    if want.dtype.is_floating_point or want.dtype.is_complex:
        torch.testing.assert_close(got, want)
    else:
        assert torch.equal(got, want), (got, want)


def finish(result, async_op):
    """The value of a call made with ``async_op`` (a handle's result, or the result)."""
    if async_op.bad is None and async_op.value:
        return result.wait()
    return result


def scaled(x, w):
    """``w * x`` in ``x``'s dtype, as documented: integers and bool rounded half to even."""
    if x.dtype.is_floating_point or x.dtype.is_complex:
        wide = torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype
        return (x.to(wide) * w).to(x.dtype)
    exact = np.asarray(np.round(x.to(torch.float64).numpy() * w))
    return torch.from_numpy(exact).to(x.dtype)


# ------------------------------------------------------------------------------- cases
def case_allreduce(draw):
    args = {
        "tensor": draw(tensor_arg(SUMMABLE)),
        "average": draw(bool_arg()),
        "async_op": draw(bool_arg()),
    }
    extra = {}
    t, average = args["tensor"], args["average"]
    if t.bad is None and average.bad is None and average.value and t.value.dtype not in AVERAGING:
        extra["tensor"] = "averaging an integer dtype"
    inplace = draw(st.booleans())
    fn = gossamer.allreduce_ if inplace else gossamer.allreduce
    before = t.value.clone() if isinstance(t.value, torch.Tensor) else None
    out = judge(call(fn, **{k: a.value for k, a in args.items()}), args, extra_bad=extra)
    if not extra and all(a.bad is None for a in args.values()):
        got = finish(out, args["async_op"])
        assert_matches(got, before)  # a world of one: the sum and the mean are x
        if inplace and t.value.is_contiguous():
            assert got is t.value


def case_broadcast(draw):
    args = {
        "tensor": draw(tensor_arg()),
        "root": draw(mostly(good(st.just(0)), bad_int(0, 0), 6)),
        "async_op": draw(bool_arg()),
    }
    out = judge(call(gossamer.broadcast, **{k: a.value for k, a in args.items()}), args)
    if all(a.bad is None for a in args.values()):
        assert_matches(finish(out, args["async_op"]), args["tensor"].value)


def case_allgather(draw, fn=gossamer.allgather):
    args = {"tensor": draw(tensor_arg()), "async_op": draw(bool_arg())}
    t = args["tensor"]
    extra = {}
    if t.bad is None and t.value.dim() == 0:
        extra["tensor"] = "a scalar"
    out = judge(call(fn, **{k: a.value for k, a in args.items()}), args, extra_bad=extra)
    if not extra and all(a.bad is None for a in args.values()):
        assert_matches(finish(out, args["async_op"]), t.value)


def case_alltoall(draw):
    case_allgather(draw, gossamer.alltoall)


def case_barrier(draw):
    args = {"async_op": draw(bool_arg())}
    out = judge(call(gossamer.barrier, async_op=args["async_op"].value), args)
    if args["async_op"].bad is None and args["async_op"].value:
        out.wait()


def case_neighbor_allreduce(draw):
    dynamic = draw(st.integers(0, 3))
    args = {
        "tensor": draw(tensor_arg(AVERAGING)),
        "topology": draw(topology_arg()),
        "check_topology": draw(bool_arg()),
        "async_op": draw(bool_arg()),
    }
    if dynamic:
        args["self_weight"] = draw(weight_arg())
        args["src_weights"] = draw(rank_dict_arg("src_weights"))
        if dynamic > 1:
            args["dst_weights"] = draw(
                st.one_of(rank_dict_arg("dst_weights"), rank_list_arg("dst_weights"))
            )
    extra = {}
    if draw(st.integers(0, 9)) == 0:  # weights given partly
        drop = draw(st.sampled_from(["self_weight", "src_weights"]))
        if drop in args:
            kept = "src_weights" if drop == "self_weight" else "self_weight"
            del args[drop]
            extra[kept] = "given alone"
        else:
            args["dst_weights"] = Arg([])
            extra["dst_weights"] = "without src_weights"
    t = args["tensor"]
    out = judge(
        call(gossamer.neighbor_allreduce, **{k: a.value for k, a in args.items()}),
        args,
        extra_bad=extra,
        names={"self_weight": ("src_weights",), "src_weights": ("self_weight",)},
    )
    if not extra and all(a.bad is None for a in args.values()):
        sw = args["self_weight"].value if "self_weight" in args else 1.0
        assert_matches(finish(out, args["async_op"]), scaled(t.value, sw))


def case_neighbor_allgather(draw):
    args = {
        "tensor": draw(tensor_arg(min_dims=0)),
        "topology": draw(topology_arg()),
        "check_topology": draw(bool_arg()),
        "async_op": draw(bool_arg()),
    }
    extra = {}
    if draw(st.booleans()):
        args["src_ranks"] = draw(rank_list_arg("src_ranks"))
        args["dst_ranks"] = draw(rank_list_arg("dst_ranks"))
        if draw(st.integers(0, 9)) == 0:
            del args["dst_ranks"]
            extra["src_ranks"] = "given alone"
    t = args["tensor"]
    if t.bad is None and t.value.dim() == 0:
        extra["tensor"] = "a scalar"
    out = judge(
        call(gossamer.neighbor_allgather, **{k: a.value for k, a in args.items()}),
        args,
        extra_bad=extra,
        names={"src_ranks": ("dst_ranks",)},
    )
    if not extra and all(a.bad is None for a in args.values()):
        got = finish(out, args["async_op"])
        assert_matches(got, t.value.new_empty((0, *t.value.shape[1:])))


def case_window(draw):
    """Create a window, run a few operations on it with fuzzed arguments, free it."""
    args = {
        "tensor": draw(tensor_arg(min_dims=0)),
        "zero_init": draw(bool_arg()),
        "push_sum": draw(bool_arg()),
        "name": draw(mostly(good(st.sampled_from([None, "w", "ü"])), NOT_STR, 8)),
        "topology": draw(topology_arg()),
    }
    win = judge(call(gossamer.Window.create, **{k: a.value for k, a in args.items()}), args)
    if win is None:
        return
    x = args["tensor"].value
    try:
        for _ in range(draw(st.integers(1, 4))):
            window_op(draw, win, x)
    finally:
        win.free()
    assert gossamer.Window.create is not None and not gossamer.live_windows()


def window_op(draw, win, x):
    kind = draw(st.sampled_from(["put", "accumulate", "get", "update"]))
    expected = x.clone()
    if kind in ("put", "accumulate"):
        args = {
            "self_weight": draw(mostly(good(st.none()), weight_arg(), 2)),
            "dst_weights": draw(st.one_of(good(st.none()), rank_dict_arg("dst_weights"))),
            "require_mutex": draw(bool_arg()),
            "async_op": draw(bool_arg()),
        }
        if draw(st.integers(0, 9)) == 0:
            args["tensor"] = Arg(torch.zeros(7, dtype=torch.int8), "wrong shape")
        out = judge(call(getattr(win, kind), **{k: a.value for k, a in args.items()}), args)
        if all(a.bad is None for a in args.values()):
            finish(out, args["async_op"])
            sw = args["self_weight"].value
            assert_matches(win.tensor, expected if sw is None else scaled(expected, sw))
        return
    if kind == "get":
        args = {
            "src_weights": draw(st.one_of(good(st.none()), rank_dict_arg("src_weights"))),
            "require_mutex": draw(bool_arg()),
            "async_op": draw(bool_arg()),
        }
        out = judge(call(win.get, **{k: a.value for k, a in args.items()}), args)
        if all(a.bad is None for a in args.values()):
            finish(out, args["async_op"])
            assert_matches(win.tensor, expected)
        return
    args = {
        "reset": draw(bool_arg()),
        "clone": draw(bool_arg()),
        "require_mutex": draw(bool_arg()),
    }
    if draw(st.booleans()):
        args["self_weight"] = draw(weight_arg())
        args["src_weights"] = draw(rank_dict_arg("src_weights"))
    out = judge(call(win.update, **{k: a.value for k, a in args.items()}), args)
    if all(a.bad is None for a in args.values()):
        sw = args["self_weight"].value if "self_weight" in args else 1.0
        want = scaled(expected, sw)
        assert_matches(out, want)
        if args["clone"].value:
            assert out is not win.tensor
            assert_matches(win.tensor, expected)
        else:
            assert out is win.tensor


OPTIMIZERS = [AdaptWithCombine, AdaptThenCombine, GradientAllreduce, WindowPut, PushSum]


def case_optimizer(draw):
    cls = draw(st.sampled_from(OPTIMIZERS))
    model = torch.nn.Linear(3, 2)
    args = {
        "num_steps_per_communication": draw(mostly(good(st.integers(1, 5)), bad_int(1), 5)),
        "fusion_threshold_bytes": draw(
            mostly(good(st.sampled_from([None, 0, 8, 2**20])), bad_int(0, none_ok=True), 5)
        ),
    }
    if cls is not GradientAllreduce:
        args["topology"] = draw(topology_arg())
        args["communication"] = draw(
            mostly(
                good(st.sampled_from([None, "neighbor_allreduce"])),
                bad(st.sampled_from(["", "allreduce ", "ring", 3]), "unknown"),
                6,
            )
        )
        if args["topology"].value is None:
            del args["topology"]  # GradientAllreduce-style default: the default topology
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    made = judge(call(cls, opt, model, **{k: a.value for k, a in args.items()}), args)
    if made is None:
        return
    try:
        assert made.num_steps_per_communication == args["num_steps_per_communication"].value
        # Before backward: overlapped adapt-then-combine steps during backward.
        before = [p.detach().clone() for p in model.parameters()]
        loss = model(torch.ones(4, 3)).pow(2).sum()
        loss.backward()
        made.step()
        grads = [p.grad for p in model.parameters()]
        made.synchronize()
        # A world of one: communication changes nothing, so this is SGD's step.
        for p, b, g in zip(model.parameters(), before, grads, strict=True):
            torch.testing.assert_close(p.detach(), b - 0.1 * g)
    finally:
        if hasattr(made, "free"):
            made.free()


CASES = {
    "allreduce": case_allreduce,
    "broadcast": case_broadcast,
    "allgather": case_allgather,
    "alltoall": case_alltoall,
    "barrier": case_barrier,
    "neighbor_allreduce": case_neighbor_allreduce,
    "neighbor_allgather": case_neighbor_allgather,
    "window": case_window,
    "optimizer": case_optimizer,
}


def _fuzz_world_of_one(examples):
    counts = dict.fromkeys(CASES, 0)
    spent = dict.fromkeys(CASES, 0.0)

    @settings(FUZZ, max_examples=examples)
    @given(st.sampled_from(sorted(CASES)), st.data())
    def one(name, data):
        counts[name] += 1
        start = time.perf_counter()
        CASES[name](data.draw)
        # Nothing was left unmatched or half done.
        assert torch.equal(gossamer.allreduce(torch.ones(2)), torch.ones(2))
        spent[name] += time.perf_counter() - start

    begin = time.perf_counter()
    one()
    return counts, {k: round(v, 2) for k, v in spent.items()}, time.perf_counter() - begin


def test_fuzz_api_world_of_one():
    ((counts, spent, total),) = run_distributed(
        _fuzz_world_of_one, 1, args=(EXAMPLES,), timeout=240
    )
    print(f"fuzz, world of one: {total:.1f} s; seconds per kind of call: {spent}")
    assert sum(counts.values()) >= 1000, counts
    assert all(counts.values()), counts
    print(f"fuzz, world of one: {sum(counts.values())} calls", counts)
