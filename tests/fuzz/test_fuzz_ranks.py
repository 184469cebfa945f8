"""Fuzz the communication API across ranks: generated calls, one distributed job per world size.

Every rank draws the same cases from one seed (``random.Random``), so the ranks agree on
what to call; each builds its own arguments from the case and its rank, and checks its own
result against a reference computed from every rank's inputs (which it can rebuild). A
share of the cases has one rank (drawn too) pass a bad argument: it must raise
TypeError/ValueError naming the argument, and every rank whose call depends on it must raise
``PeerArgumentError`` naming that rank, within :data:`PROMPT_S`; the next case then checks
that nothing was left unmatched.
"""

import random
import time

import pytest
import torch

import gossamer
from gossamer import topology as T
from gossamer.errors import PeerArgumentError
from gossamer.testing import run_distributed
from gossamer.transport import DTYPES

CASES_PER_WORLD = 110
PROMPT_S = 2.0
FLOATS = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
AVERAGING = [*FLOATS, torch.complex64, torch.complex128]
SUMMABLE = [*AVERAGING, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool]
WEIGHTED_WINDOW = [torch.float32, torch.float64, torch.bfloat16, torch.int32, torch.int64]


def value(dtype, shape, seed):
    """Small values (0..4) every dtype holds, so sums over 4 ranks compare exactly."""
    g = torch.Generator().manual_seed(seed)
    v = torch.randint(0, 5, shape, generator=g, dtype=torch.int64)
    return v > 2 if dtype == torch.bool else v.to(dtype)


def close(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got, want)
    if want.dtype.is_floating_point or want.dtype.is_complex:
        torch.testing.assert_close(got, want, msg=what)
    else:
        assert torch.equal(got, want), (what, got, want)


def from_wide(wide, dtype):
    """A float64/complex128 reference in ``dtype`` (integers rounded half to even)."""
    if dtype.is_floating_point or dtype.is_complex:
        return wide.to(dtype)
    if dtype == torch.bool:
        return wide != 0
    return wide.round().to(dtype)


def wide(x):
    return x.to(torch.complex128 if x.dtype.is_complex else torch.float64)


def topologies(n):
    return [T.ring(n), T.exponential_two(n), T.fully_connected(n)]


# --------------------------------------------------------------------------- valid cases
def allreduce_case(rng, i, r, n):
    dtype = rng.choice(SUMMABLE)
    average = dtype in AVERAGING and rng.random() < 0.5
    shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    got = gossamer.allreduce(xs[r], average=average)
    total = sum(wide(x) for x in xs)
    want = total != 0 if dtype == torch.bool else from_wide(total / n if average else total, dtype)
    close(got, want, f"allreduce {dtype} average={average}")


def broadcast_case(rng, i, r, n):
    dtype, root = rng.choice(list(DTYPES)), rng.randrange(n)
    shape = (rng.randint(0, 3), 2)
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    close(gossamer.broadcast(xs[r], root=root), xs[root], "broadcast")


def allgather_case(rng, i, r, n):
    dtype = rng.choice(list(DTYPES))
    dims = [rng.randint(0, 3) for _ in range(n)]
    xs = [value(dtype, (dims[s], 2), 100 * i + s) for s in range(n)]
    close(gossamer.allgather(xs[r]), torch.cat(xs), "allgather")


def alltoall_case(rng, i, r, n):
    dtype, k = rng.choice(list(DTYPES)), rng.randint(1, 2)
    xs = [value(dtype, (n * k, 3), 100 * i + s) for s in range(n)]
    want = torch.cat([xs[s][r * k : (r + 1) * k] for s in range(n)])
    close(gossamer.alltoall(xs[r]), want, "alltoall")


def neighbor_allreduce_case(rng, i, r, n):
    dtype = rng.choice(AVERAGING)
    xs = [value(dtype, (2, 3), 100 * i + s) for s in range(n)]
    mode = rng.choice(["static", "weighted", "dynamic"])
    if mode == "dynamic":
        # Every rank sends to a random set of others, each copy scaled by its own weight.
        sends = [
            rng.sample([d for d in range(n) if d != s], rng.randint(0, n - 1)) for s in range(n)
        ]
        dst_w = [{d: rng.uniform(0.5, 1.5) for d in sends[s]} for s in range(n)]
        src_w = [{s: rng.uniform(0, 1) for s in range(n) if t in sends[s]} for t in range(n)]
        sw = [rng.uniform(0, 1) for _ in range(n)]
        got = gossamer.neighbor_allreduce(
            xs[r], self_weight=sw[r], src_weights=src_w[r], dst_weights=dst_w[r]
        )
        want = sw[r] * wide(xs[r]) + sum(w * dst_w[s][r] * wide(xs[s]) for s, w in src_w[r].items())
    else:
        graph = rng.choice(topologies(n))
        W = graph.weights
        if mode == "static":
            got = gossamer.neighbor_allreduce(xs[r], topology=graph)
            want = sum(W[s, r] * wide(xs[s]) for s in range(n) if W[s, r])
        else:
            src_w = [{s: rng.uniform(0, 1) for s in graph.in_neighbors(t)} for t in range(n)]
            sw = [rng.uniform(0, 1) for _ in range(n)]
            got = gossamer.neighbor_allreduce(
                xs[r], self_weight=sw[r], src_weights=src_w[r], topology=graph
            )
            want = sw[r] * wide(xs[r]) + sum(w * wide(xs[s]) for s, w in src_w[r].items())
    close(got, from_wide(want, dtype), f"neighbor_allreduce {mode} {dtype}")


def neighbor_allgather_case(rng, i, r, n):
    dtype, graph = rng.choice(list(DTYPES)), rng.choice(topologies(n))
    dims = [rng.randint(0, 2) for _ in range(n)]
    xs = [value(dtype, (dims[s], 2), 100 * i + s) for s in range(n)]
    got = gossamer.neighbor_allgather(xs[r], topology=graph)
    srcs = graph.in_neighbors(r)
    want = torch.cat([xs[s] for s in srcs]) if srcs else xs[r].new_empty((0, 2))
    close(got, want, "neighbor_allgather")


def window_case(rng, i, r, n):
    weighted = rng.random() < 0.5
    dtype = rng.choice(WEIGHTED_WINDOW if weighted else list(DTYPES))
    graph = rng.choice(topologies(n))
    xs = [value(dtype, (3,), 100 * i + s) for s in range(n)]
    outs = [graph.out_neighbors(s) for s in range(n)]
    dst_w = [{d: rng.choice([0.5, 1.0, 1.5]) for d in outs[s]} for s in range(n)]
    kind = rng.choice(["put", "accumulate", "get"])
    # get: rank t fetches each in-neighbour s's tensor, scaled by t's own weight for s.
    get_w = [{s: rng.choice([0.5, 1.0, 1.5]) for s in graph.in_neighbors(t)} for t in range(n)]
    # Drawn for every rank alike, so every rank's generator stays at the same position.
    sws = [rng.uniform(0, 1) for _ in range(n)]
    srcs = [{s: rng.uniform(0, 1) for s in graph.in_neighbors(t)} for t in range(n)]
    with gossamer.Window.create(xs[r].clone(), topology=graph, zero_init=True) as win:
        gossamer.barrier()
        if kind == "get":
            win.get(src_weights=get_w[r]) if weighted else win.get()
        else:
            op = getattr(win, kind)
            op(dst_weights=dst_w[r]) if weighted else op()
        gossamer.barrier()
        bufs = win.buffers()
        for s in graph.in_neighbors(r):
            w = get_w[r][s] if kind == "get" else dst_w[s][r]
            sent = from_wide(wide(xs[s]) * w, dtype) if weighted else xs[s]
            close(bufs[s], sent, f"window {kind} {dtype} from {s}")
        if weighted:
            sw, src = sws[r], srcs[r]
            got = win.update(self_weight=sw, src_weights=src)
            want = sw * wide(xs[r]) + sum(w * wide(bufs[s]) for s, w in src.items())
            close(got, from_wide(want, dtype), f"window update {dtype}")
        gossamer.barrier()


VALID = [
    allreduce_case,
    broadcast_case,
    allgather_case,
    alltoall_case,
    neighbor_allreduce_case,
    neighbor_allgather_case,
    window_case,
]


# --------------------------------------------------------------------------- rejections
def rejected_call(kind, r, n, bad):
    """``(call, name of the bad argument)`` on rank ``r``; only rank ``bad`` passes it."""
    x = torch.ones(n, 2)
    is_bad = r == bad
    if kind == "allreduce":
        return lambda: gossamer.allreduce(x, average="yes" if is_bad else True), "average"
    if kind == "broadcast":
        return lambda: gossamer.broadcast(x, root=n if is_bad else 0), "root"
    if kind == "allgather":
        return lambda: gossamer.allgather(x[0, 0] if is_bad else x), "tensor"
    if kind == "alltoall":
        return lambda: gossamer.alltoall(x[:1] if is_bad else x), "tensor"
    if kind == "local_allreduce":  # one machine: the local group is the world
        return lambda: gossamer.local_allreduce(x, async_op=1 if is_bad else False), "async_op"
    if kind == "barrier":
        return lambda: gossamer.barrier(async_op=1 if is_bad else False), "async_op"
    if kind == "neighbor_allreduce":
        graph = T.fully_connected(n)
        return lambda: gossamer.neighbor_allreduce(
            x, topology=graph, async_op=None if is_bad else False
        ), "async_op"
    return lambda: gossamer.Window.create(
        torch.ones(2), zero_init=1 if is_bad else False
    ), "zero_init"


REJECTED = [
    "allreduce",
    "broadcast",
    "allgather",
    "alltoall",
    "barrier",
    "local_allreduce",
    "neighbor_allreduce",
    "window",
]


def rejection_case(rng, i, r, n):
    kind, bad = rng.choice(REJECTED), rng.randrange(n)
    fn, name = rejected_call(kind, r, n, bad)
    start = time.monotonic()
    try:
        out = fn()
    except (TypeError, ValueError) as err:
        assert r == bad and name in str(err), (kind, err)
    except PeerArgumentError as err:
        took = time.monotonic() - start
        assert r != bad and f"rank {bad}" in str(err), (kind, err)
        assert took < PROMPT_S, (
            f"{kind}: rank {r} learned of rank {bad}'s rejection after {took:.1f} s"
        )
    else:
        if hasattr(out, "free"):
            out.free()
        raise AssertionError(f"{kind}: rank {r} finished although rank {bad} rejected its call")


def _fuzz_ranks(seed, count):
    r, n = gossamer.rank(), gossamer.size()
    rng = random.Random(seed)
    done = {}
    for i in range(count):
        case = rejection_case if rng.random() < 0.2 else rng.choice(VALID)
        try:
            case(rng, i, r, n)
        except BaseException as err:
            raise AssertionError(f"case {i} ({case.__name__}, seed {seed}) on rank {r}") from err
        done[case.__name__] = done.get(case.__name__, 0) + 1
    return done


@pytest.mark.parametrize("world_size", [2, 3])
def test_fuzz_api_across_ranks(world_size):
    got = run_distributed(_fuzz_ranks, world_size, args=(world_size, CASES_PER_WORLD), timeout=180)
    assert all(g == got[0] for g in got)
    assert sum(got[0].values()) == CASES_PER_WORLD and len(got[0]) == len(VALID) + 1, got[0]
