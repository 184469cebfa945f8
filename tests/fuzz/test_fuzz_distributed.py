"""Fuzz the operations and windows across 2 to 4 ranks, against references from all ranks' data.

Hypothesis draws each case in the test process, so every rank gets the very same case
(``args`` of ``run_distributed``); a rank builds its own tensor from the case's seed and its
rank. Valid cases must give, on every rank, what the reference computes from the full
weight matrix; invalid cases are invalid on every rank in the same way (a defect on some
ranks only would leave the others waiting) and must raise the same TypeError or ValueError,
naming the argument, on every rank.
"""

import itertools

import numpy as np
import torch
from fuzz_cases import FUZZ
from hypothesis import given, settings
from hypothesis import strategies as st

import gossamer
from gossamer.testing import run_distributed
from gossamer.topology import Topology

WORLDS = st.integers(2, 4)
FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# int16 found gloo's "Invalid scalar type" in the collectives (fixed: payloads as raw bytes).
COLLECTIVE_DTYPES = (*FLOATS, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)
EXCHANGE_DTYPES = (*COLLECTIVE_DTYPES, torch.bool)

# Examples per run of each fuzzer; test_examples_per_run checks that they add up.
EXAMPLES_PER_RUN = {
    "neighbor_allreduce_dynamic": 60,
    "neighbor_allreduce_static": 40,
    "neighbor_allgather": 30,
    "collectives": 30,
    "windows": 30,
    "rejected_everywhere": 40,
    "rejected_on_one_rank": 30,
}


def value(seed, rank, shape, dtype):
    """Rank ``rank``'s tensor of a case: the same on every process that asks."""
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    return torch.randint(0, 50, shape, generator=gen).to(dtype)


def close(got, expected):
    assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
    if expected.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(got.double(), expected.double(), rtol=3e-2, atol=3e-2)
    elif expected.dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    elif expected.is_floating_point():
        torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-9)
    else:
        assert torch.equal(got, expected), (got, expected)


def shapes():
    return st.lists(st.integers(1, 3), min_size=0, max_size=2)


@st.composite
def digraphs(draw, n):
    """A random set of edges ``(i, j)``, ``i`` sends to ``j``, without self-loops."""
    pairs = [(i, j) for i, j in itertools.product(range(n), repeat=2) if i != j]
    return sorted(p for p in pairs if draw(st.booleans()))


WEIGHTS = st.floats(-1, 2, allow_subnormal=False).map(lambda w: round(w, 3))


def on_ranks(fn, case, n):
    return run_distributed(fn, n, args=(case,), timeout=30)


# ---------------------------------------------------------------------- rank side
def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as err:
        is_value_or_type = isinstance(err, TypeError | ValueError)
        # PeerArgumentError's rank: the rank that rejected its arguments.
        return ("error", type(err).__name__, is_value_or_type, str(err), getattr(err, "rank", None))


def _neighbor_allreduce(case):
    me = gossamer.rank()
    x = value(case["seed"], me, case["shape"], case["dtype"])
    kwargs = dict(case["kwargs"][me])
    tensor = kwargs.pop("tensor", x)
    return _outcome(lambda: _wait(gossamer.neighbor_allreduce(tensor, **kwargs)))


def _wait(result):
    return result.wait() if isinstance(result, gossamer.Handle) else result


# ---------------------------------------------------------------------- neighbour allreduce
@st.composite
def dynamic_cases(draw):
    n = draw(WORLDS)
    edges = draw(digraphs(n))
    # The check is a collective: every rank must ask for it, or none (else they hang).
    check = draw(st.booleans())
    kwargs = []
    for me in range(n):
        sources = [i for i, j in edges if j == me]
        dests = [j for i, j in edges if i == me]
        as_list = draw(st.booleans())
        kwargs.append(
            {
                "self_weight": draw(WEIGHTS),
                "src_weights": {s: draw(WEIGHTS) for s in sources},
                "dst_weights": list(dests) if as_list else {d: draw(WEIGHTS) for d in dests},
                "check_topology": check,
                "async_op": draw(st.booleans()),
            }
        )
    return {
        "n": n,
        "seed": draw(st.integers(0, 1000)),
        "shape": draw(shapes()),
        "dtype": draw(st.sampled_from(FLOATS)),
        "kwargs": kwargs,
    }


def reference_dynamic(case):
    n, kw = case["n"], case["kwargs"]
    xs = [value(case["seed"], r, case["shape"], case["dtype"]).double() for r in range(n)]
    out = []
    for me in range(n):
        y = kw[me]["self_weight"] * xs[me]
        for src, w in kw[me]["src_weights"].items():
            dst = kw[src]["dst_weights"]
            scale = dst[me] if isinstance(dst, dict) else 1.0
            y = y + w * scale * xs[src]
        out.append(y.to(case["dtype"]))
    return out


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["neighbor_allreduce_dynamic"])
@given(case=dynamic_cases())
def test_neighbor_allreduce_dynamic_weights(case):
    results = on_ranks(_neighbor_allreduce, case, case["n"])
    for (status, *got), expected in zip(results, reference_dynamic(case), strict=True):
        assert status == "ok", got
        close(got[0], expected)


@st.composite
def static_cases(draw):
    n = draw(WORLDS)
    mask = np.array(draw(st.lists(st.booleans(), min_size=n * n, max_size=n * n))).reshape(n, n)
    weights = np.array(draw(st.lists(st.floats(0.05, 1.5), min_size=n * n, max_size=n * n)))
    w = np.where(mask, weights.reshape(n, n), 0.0).round(3)
    topology = Topology(w)
    kwargs = []
    for me in range(n):
        options = {"topology": topology, "async_op": draw(st.booleans())}
        if draw(st.booleans()):  # explicit weights over some of the in-neighbours
            chosen = [s for s in topology.in_neighbors(me) if draw(st.booleans())]
            options["self_weight"] = draw(WEIGHTS)
            options["src_weights"] = {s: draw(WEIGHTS) for s in chosen}
        kwargs.append(options)
    return {
        "n": n,
        "seed": draw(st.integers(0, 1000)),
        "shape": draw(shapes()),
        "dtype": draw(st.sampled_from(FLOATS)),
        "kwargs": kwargs,
        "weights": w,
    }


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["neighbor_allreduce_static"])
@given(case=static_cases())
def test_neighbor_allreduce_static_topology(case):
    n, w = case["n"], case["weights"]
    xs = [value(case["seed"], r, case["shape"], case["dtype"]).double() for r in range(n)]
    results = on_ranks(_neighbor_allreduce, case, n)
    for me, (status, *got) in enumerate(results):
        assert status == "ok", got
        kw = case["kwargs"][me]
        if "self_weight" in kw:
            combine = {me: kw["self_weight"], **kw["src_weights"]}
        else:  # column me of W: what me applies to each source, itself included
            combine = {i: w[i, me] for i in range(n) if w[i, me] or i == me}
        expected = sum(c * xs[i] for i, c in combine.items())
        close(got[0], expected.to(case["dtype"]))


# ---------------------------------------------------------------------- neighbour allgather
def _neighbor_allgather(case):
    me = gossamer.rank()
    shape = [case["first"][me], *case["shape"]]
    x = value(case["seed"], me, shape, case["dtype"])
    return _outcome(lambda: _wait(gossamer.neighbor_allgather(x, **case["kwargs"][me])))


@st.composite
def allgather_cases(draw):
    n = draw(WORLDS)
    edges = draw(digraphs(n))
    check = draw(st.booleans())  # a collective: the same on every rank
    kwargs = []
    for me in range(n):
        sources = draw(st.permutations([i for i, j in edges if j == me]))
        dests = [j for i, j in edges if i == me]
        kwargs.append({"src_ranks": sources, "dst_ranks": dests, "check_topology": check})
    return {
        "n": n,
        "seed": draw(st.integers(0, 1000)),
        "first": draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        "shape": draw(shapes()),
        "dtype": draw(st.sampled_from(EXCHANGE_DTYPES)),
        "kwargs": kwargs,
    }


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["neighbor_allgather"])
@given(case=allgather_cases())
def test_neighbor_allgather_dynamic_ranks(case):
    n = case["n"]
    xs = [
        value(case["seed"], r, [case["first"][r], *case["shape"]], case["dtype"]) for r in range(n)
    ]
    for me, (status, *got) in enumerate(on_ranks(_neighbor_allgather, case, n)):
        assert status == "ok", got
        sources = case["kwargs"][me]["src_ranks"]
        empty = xs[me].new_empty((0, *case["shape"]))
        close(got[0], torch.cat([xs[s] for s in sources]) if sources else empty)


# ---------------------------------------------------------------------- collectives
def _collective(case):
    me = gossamer.rank()
    op = case["op"]
    first = case["first"][me] if op == "allgather" else 1
    x = value(case["seed"], me, [first, *case["shape"]], case["dtype"])
    kwargs = case["kwargs"]
    return _outcome(lambda: _wait(getattr(gossamer, op)(x, **kwargs)))


@st.composite
def collective_cases(draw):
    n = draw(WORLDS)
    op = draw(st.sampled_from(["allreduce", "broadcast", "allgather"]))
    dtype = draw(st.sampled_from(EXCHANGE_DTYPES))
    kwargs = {"async_op": draw(st.booleans())}
    if op == "allreduce":
        kwargs["average"] = dtype.is_floating_point and draw(st.booleans())
    elif op == "broadcast":
        kwargs["root"] = draw(st.integers(0, n - 1))
    return {
        "n": n,
        "op": op,
        "seed": draw(st.integers(0, 1000)),
        "first": draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)),
        "shape": draw(shapes()),
        "dtype": dtype,
        "kwargs": kwargs,
    }


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["collectives"])
@given(case=collective_cases())
def test_collectives(case):
    n, op, dtype = case["n"], case["op"], case["dtype"]
    first = case["first"] if op == "allgather" else [1] * n
    xs = [value(case["seed"], r, [first[r], *case["shape"]], dtype) for r in range(n)]
    if op == "allreduce":
        total = sum(x.double() for x in xs)
        expected = (total / n if case["kwargs"]["average"] else total).to(dtype)
        if dtype == torch.bool:
            expected = torch.stack(xs).any(dim=0)  # a sum of bools is a logical or
        elif not dtype.is_floating_point:
            expected = sum(x.to(torch.int64) for x in xs).to(dtype)  # wraps as the ints do
    elif op == "broadcast":
        expected = xs[case["kwargs"]["root"]]
    else:
        expected = torch.cat(xs)
    for status, *got in on_ranks(_collective, case, n):
        assert status == "ok", got
        close(got[0], expected)


# ---------------------------------------------------------------------- windows
def _window(case):
    me = gossamer.rank()
    x = value(case["seed"], me, case["shape"], case["dtype"])
    plan = case["ranks"][me]
    with gossamer.Window.create(x, zero_init=case["zero_init"], topology=case["topology"]) as win:
        write = win.accumulate if case["accumulate"] else win.put
        write(dst_weights=plan["dst_weights"], self_weight=plan["put_self_weight"])
        gossamer.barrier()  # every write has landed (a completed put is visible)
        out = win.update(self_weight=plan["self_weight"], src_weights=plan["src_weights"])
        gossamer.barrier()  # nobody frees while a peer still writes
        return out.clone()


@st.composite
def window_cases(draw):
    n = draw(WORLDS)
    edges = draw(digraphs(n))
    w = np.eye(n)
    for i, j in edges:
        w[i, j] = 0.5
    topology = Topology(w)
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.int32, torch.int64]))
    ranks = []
    for me in range(n):
        outs = [d for d in topology.out_neighbors(me) if draw(st.booleans())]
        ins = [s for s in topology.in_neighbors(me) if draw(st.booleans())]
        ranks.append(
            {
                "dst_weights": {d: draw(st.sampled_from([0.5, 1.0, 2.0, 0.25])) for d in outs},
                "put_self_weight": draw(st.sampled_from([None, 1.0, 0.5])),
                "self_weight": draw(st.sampled_from([1.0, 0.5, 0.0])),
                "src_weights": {s: draw(st.sampled_from([1.0, 0.5, 0.25])) for s in ins},
            }
        )
    return {
        "n": n,
        "seed": draw(st.integers(0, 1000)),
        "shape": draw(shapes()),
        "dtype": dtype,
        "topology": topology,
        "zero_init": draw(st.booleans()),
        "accumulate": draw(st.booleans()),
        "ranks": ranks,
    }


def _in_dtype(value, dtype):
    """A float64 result in ``dtype``: integers and bool rounded half to even, as windows do."""
    exact = dtype.is_floating_point or dtype.is_complex
    return value.to(dtype) if exact else value.round().to(dtype)


def _scaled(x, w):
    """``x * w`` in the window's dtype."""
    return x if w == 1.0 else _in_dtype(x.double() * w, x.dtype)


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["windows"])
@given(case=window_cases())
def test_window_put_and_update(case):
    n, ranks = case["n"], case["ranks"]
    xs = [value(case["seed"], r, case["shape"], case["dtype"]) for r in range(n)]
    results = on_ranks(_window, case, n)
    for me in range(n):
        start = torch.zeros_like(xs[me]) if case["zero_init"] else xs[me].clone()
        buffers = {s: start.clone() for s in case["topology"].in_neighbors(me)}
        for s in buffers:
            sent = ranks[s]["dst_weights"].get(me)
            if sent is not None:
                arrived = _scaled(xs[s], sent)
                buffers[s] = buffers[s] + arrived if case["accumulate"] else arrived
        put_sw = ranks[me]["put_self_weight"]
        x = xs[me] if put_sw is None else _scaled(xs[me], put_sw)
        plan = ranks[me]
        total = plan["self_weight"] * x.double()
        for s, w in plan["src_weights"].items():
            total = total + w * buffers[s].double()
        close(results[me], _in_dtype(total, case["dtype"]))


# ---------------------------------------------------------------------- rejected everywhere
DEFECTS = {
    # defect: the words one of which the message must hold
    "self_weight alone": ("self_weight",),
    "dst_weights without src_weights": ("dst_weights",),
    "src_weights key out of range": ("src_weights",),
    "src_weights holds this rank": ("src_weights",),
    "dst_weights holds this rank": ("dst_weights",),
    "integer tensor": ("tensor",),
    "check_topology not a bool": ("check_topology",),
    "topology of another size": ("topology",),
    "async_op not a bool": ("async_op",),
    # A collective check: every rank learns that sends and receives differ. The message
    # names the ranks, not the arguments (src_weights / dst_weights).
    "sends and receives differ": ("sends and receives",),
}


@st.composite
def rejected_cases(draw):
    n = draw(WORLDS)
    defect = draw(st.sampled_from(sorted(DEFECTS)))
    kwargs = []
    if defect == "sends and receives differ":
        sends = draw(digraphs(n))
        recvs = draw(digraphs(n).filter(lambda e: e != sends))
    for me in range(n):
        options = {"self_weight": 0.5, "src_weights": {}}
        if defect == "self_weight alone":
            options = {"self_weight": 0.5}
        elif defect == "dst_weights without src_weights":
            options = {"dst_weights": {}}
        elif defect == "src_weights key out of range":
            options["src_weights"] = {draw(st.sampled_from([n, n + 3, -1])): 0.5}
            options["dst_weights"] = {}
        elif defect == "src_weights holds this rank":
            options["src_weights"] = {me: 0.5}
        elif defect == "dst_weights holds this rank":
            options["dst_weights"] = draw(st.sampled_from([[me], {me: 1.0}]))
        elif defect == "integer tensor":
            options["tensor"] = torch.ones(
                2, dtype=draw(st.sampled_from([torch.int32, torch.int64]))
            )
        elif defect == "check_topology not a bool":
            options["check_topology"] = draw(st.sampled_from([1, "yes", None]))
        elif defect == "topology of another size":
            options = {"topology": Topology(np.eye(draw(st.sampled_from([1, n + 1]))))}
        elif defect == "async_op not a bool":
            options["async_op"] = draw(st.sampled_from([1, "no"]))
        else:
            options["src_weights"] = {i: 0.5 for i, j in recvs if j == me}
            options["dst_weights"] = [j for i, j in sends if i == me]
            options["check_topology"] = True
        kwargs.append(options)
    case = {"n": n, "seed": 0, "shape": [2], "dtype": torch.float32, "kwargs": kwargs}
    return {**case, "defect": defect}


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["rejected_everywhere"])
@given(case=rejected_cases())
def test_rejected_on_every_rank_alike(case):
    results = on_ranks(_neighbor_allreduce, case, case["n"])
    assert len({tuple(r[:2]) for r in results}) == 1, results  # one error class everywhere
    for status, name, is_value_or_type, message, _ in results:
        assert status == "error" and is_value_or_type, (name, message)
        assert any(word in message for word in DEFECTS[case["defect"]]), message


# Defects a single rank can have while every rank asks for the graph check, which is an
# allgather: the bad rank takes its part in it, carrying its reason, so every other rank
# raises PeerArgumentError at once (no deadline) and the group stays usable.
ONE_RANK_DEFECTS = {
    "self_weight alone": ("self_weight", "src_weights"),
    "src_weights key out of range": ("src_weights",),
    "src_weights holds this rank": ("src_weights",),
    "dst_weights holds this rank": ("dst_weights",),
    "weight not finite": ("src_weights",),
    "integer tensor": ("tensor",),
    "topology of another size": ("topology",),
    "async_op not a bool": ("async_op",),
}


@st.composite
def one_bad_rank_cases(draw):
    case = draw(dynamic_cases())
    n, bad = case["n"], draw(st.integers(0, case["n"] - 1))
    defect = draw(st.sampled_from(sorted(ONE_RANK_DEFECTS)))
    kwargs = [dict(k, check_topology=True, async_op=False) for k in case["kwargs"]]
    options = kwargs[bad]
    if defect == "self_weight alone":
        options = {"self_weight": 0.5, "check_topology": True}
    elif defect == "src_weights key out of range":
        options["src_weights"] = {**options["src_weights"], n: 0.5}
    elif defect == "src_weights holds this rank":
        options["src_weights"] = {**options["src_weights"], bad: 0.5}
    elif defect == "dst_weights holds this rank":
        options["dst_weights"] = [bad]
    elif defect == "weight not finite":
        options["src_weights"] = {**options["src_weights"], (bad + 1) % n: float("nan")}
    elif defect == "integer tensor":
        options["tensor"] = torch.ones(case["shape"], dtype=torch.int64)
    elif defect == "topology of another size":
        options["topology"] = Topology(np.eye(n + 1))
    else:
        options["async_op"] = "no"
    kwargs[bad] = options
    return {**case, "kwargs": kwargs, "bad": bad, "defect": defect}


@settings(FUZZ, max_examples=EXAMPLES_PER_RUN["rejected_on_one_rank"])
@given(case=one_bad_rank_cases())
def test_rejected_on_one_rank_reaches_every_rank(case):
    results = on_ranks(_neighbor_allreduce, case, case["n"])
    for rank, (status, name, is_value_or_type, message, culprit) in enumerate(results):
        assert status == "error", (rank, name, message)
        if rank == case["bad"]:
            assert is_value_or_type, (name, message)
            assert any(w in message for w in ONE_RANK_DEFECTS[case["defect"]]), message
        else:
            assert name == "PeerArgumentError" and culprit == case["bad"], (name, message)


def test_examples_per_run():
    assert sum(EXAMPLES_PER_RUN.values()) >= 200
