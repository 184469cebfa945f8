"""Fuzz the API across 2 to 4 ranks: generated calls, one distributed job per world size.

Every rank draws the same cases from one seed (``random.Random``), so the ranks agree on
what to call; each builds its own arguments from the case and its rank, and checks its own
result against a reference computed from every rank's inputs (which it can rebuild): the
full weight matrix for neighbour and window operations. All draws are made for every rank
alike, so the ranks' generators stay in step. A failure names the case, its index and the
seed, which replay it.

Cases (:data:`CASES_PER_WORLD` per world size, worlds 2, 3 and 4):

- valid calls of the collectives, neighbour operations (static topologies, random weight
  matrices, explicit weights over some in-neighbours, dynamic weights on random digraphs,
  destinations as a list or a mapping, the graph check, ``async_op``) and windows (put,
  accumulate, get, update; random digraphs, some destinations only, ``self_weight`` on
  put, ``zero_init``), in every dtype each takes;
- one rank passing a bad argument: it raises TypeError/ValueError naming the argument, and
  every rank whose call depends on it raises ``PeerArgumentError`` naming that rank within
  :data:`PROMPT_S`; the next case then checks that nothing was left unmatched;
- every rank passing the same bad neighbour arguments: every rank raises the same
  TypeError/ValueError naming the argument.

World-of-one fuzzing (1000+ calls with hypothesis) is in ``test_fuzz_world_of_one.py``.
"""

import random
import time

import numpy as np
import pytest
import torch

import gossamer
from gossamer import topology as T
from gossamer.errors import PeerArgumentError
from gossamer.testing import run_distributed
from gossamer.topology import Topology
from gossamer.transport import DTYPES

CASES_PER_WORLD = {2: 90, 3: 75, 4: 55}
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
    if want.dtype in (torch.float16, torch.bfloat16):
        torch.testing.assert_close(got.double(), want.double(), rtol=3e-2, atol=3e-2, msg=what)
    elif want.dtype.is_floating_point or want.dtype.is_complex:
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


def finish(result):
    return result.wait() if isinstance(result, gossamer.Handle) else result


def shape_of(rng, first=None):
    """A small shape (0 to 2 dims of 1..3); ``first`` fixes dim 0."""
    rest = tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2)))
    return rest if first is None else (first, *rest)


def digraph(rng, n):
    """Random edges ``(i, j)``, i sends to j, without self-loops."""
    return [(i, j) for i in range(n) for j in range(n) if i != j and rng.random() < 0.5]


def weight_matrix(rng, n):
    """A random topology: some edges, random weights (self weights included)."""
    w = np.array([[rng.uniform(0.05, 1.5) if rng.random() < 0.5 else 0.0 for _ in range(n)]
                  for _ in range(n)]).round(3)  # fmt: skip
    return Topology(w)


def topologies(rng, n):
    """Ring, exponential-2, fully connected or a random weight matrix (drawn every time)."""
    random_one = weight_matrix(rng, n)
    return rng.choice([T.ring(n), T.exponential_two(n), T.fully_connected(n), random_one])


# --------------------------------------------------------------------------- valid cases
def allreduce_case(rng, i, r, n):
    dtype = rng.choice(SUMMABLE)
    average = dtype in AVERAGING and rng.random() < 0.5
    shape = tuple(rng.randint(0, 3) for _ in range(rng.randint(0, 2)))
    asynchronous = rng.random() < 0.3
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    got = finish(gossamer.allreduce(xs[r], average=average, async_op=asynchronous))
    total = sum(wide(x) for x in xs)
    want = total != 0 if dtype == torch.bool else from_wide(total / n if average else total, dtype)
    close(got, want, f"allreduce {dtype} average={average}")


def broadcast_case(rng, i, r, n):
    dtype, root = rng.choice(list(DTYPES)), rng.randrange(n)
    shape, asynchronous = (rng.randint(0, 3), 2), rng.random() < 0.3
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    close(finish(gossamer.broadcast(xs[r], root=root, async_op=asynchronous)), xs[root], "bcast")


def allgather_case(rng, i, r, n):
    dtype, asynchronous = rng.choice(list(DTYPES)), rng.random() < 0.3
    dims = [rng.randint(0, 3) for _ in range(n)]
    rest = shape_of(rng)
    xs = [value(dtype, (dims[s], *rest), 100 * i + s) for s in range(n)]
    close(finish(gossamer.allgather(xs[r], async_op=asynchronous)), torch.cat(xs), "allgather")


def alltoall_case(rng, i, r, n):
    dtype, k = rng.choice(list(DTYPES)), rng.randint(1, 2)
    xs = [value(dtype, (n * k, 3), 100 * i + s) for s in range(n)]
    want = torch.cat([xs[s][r * k : (r + 1) * k] for s in range(n)])
    close(gossamer.alltoall(xs[r]), want, "alltoall")


def _dynamic_plan(rng, n):
    """Random sends, each copy scaled per destination, weights for every source."""
    sends = [rng.sample([d for d in range(n) if d != s], rng.randint(0, n - 1)) for s in range(n)]
    as_list = [rng.random() < 0.3 for _ in range(n)]  # a list means weight 1.0
    dst_w = [{d: rng.uniform(-1, 2) for d in sends[s]} for s in range(n)]
    src_w = [{s: rng.uniform(-1, 2) for s in range(n) if t in sends[s]} for t in range(n)]
    sw = [rng.uniform(-1, 2) for _ in range(n)]
    dsts = [list(dst_w[s]) if as_list[s] else dst_w[s] for s in range(n)]
    scale = [{d: 1.0 if as_list[s] else w for d, w in dst_w[s].items()} for s in range(n)]
    return sw, src_w, dsts, scale


def neighbor_allreduce_case(rng, i, r, n):
    dtype, shape = rng.choice(AVERAGING), shape_of(rng)
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    mode = rng.choice(["static", "weighted", "dynamic", "dynamic"])
    # The graph check is a collective: every rank asks for it, or none.
    options = {"check_topology": rng.random() < 0.3, "async_op": rng.random() < 0.3}
    if mode == "dynamic":
        sw, src_w, dsts, scale = _dynamic_plan(rng, n)
        got = gossamer.neighbor_allreduce(
            xs[r], self_weight=sw[r], src_weights=src_w[r], dst_weights=dsts[r], **options
        )
        want = sw[r] * wide(xs[r]) + sum(w * scale[s][r] * wide(xs[s]) for s, w in src_w[r].items())
    else:
        graph = topologies(rng, n)
        W = graph.weights
        # Explicit weights over some of the in-neighbours (drawn for every rank alike).
        src_w = [
            {s: rng.uniform(0, 1) for s in graph.in_neighbors(t) if rng.random() < 0.7}
            for t in range(n)
        ]
        sw = [rng.uniform(0, 1) for _ in range(n)]
        if mode == "static":
            got = gossamer.neighbor_allreduce(xs[r], topology=graph, **options)
            want = sum(W[s, r] * wide(xs[s]) for s in range(n) if W[s, r])
            if not W[:, r].any():
                want = 0 * wide(xs[r])
        else:
            got = gossamer.neighbor_allreduce(
                xs[r], self_weight=sw[r], src_weights=src_w[r], topology=graph, **options
            )
            want = sw[r] * wide(xs[r]) + sum(w * wide(xs[s]) for s, w in src_w[r].items())
    close(finish(got), from_wide(want, dtype), f"neighbor_allreduce {mode} {dtype}")


def neighbor_allgather_case(rng, i, r, n):
    dtype = rng.choice(list(DTYPES))
    dims, rest = [rng.randint(0, 2) for _ in range(n)], shape_of(rng)
    xs = [value(dtype, (dims[s], *rest), 100 * i + s) for s in range(n)]
    options = {"check_topology": rng.random() < 0.3, "async_op": rng.random() < 0.3}
    if rng.random() < 0.5:
        graph = topologies(rng, n)
        got = gossamer.neighbor_allgather(xs[r], topology=graph, **options)
        srcs = list(graph.in_neighbors(r))
    else:  # dynamic: explicit ranks on a random digraph, sources in any order
        edges = digraph(rng, n)
        sources = [[i for i, j in edges if j == t] for t in range(n)]
        for s in sources:
            rng.shuffle(s)
        dsts = [j for i, j in edges if i == r]
        got = gossamer.neighbor_allgather(xs[r], src_ranks=sources[r], dst_ranks=dsts, **options)
        srcs = sources[r]
    want = torch.cat([xs[s] for s in srcs]) if srcs else xs[r].new_empty((0, *rest))
    close(finish(got), want, "neighbor_allgather")


def _window_topology(rng, n):
    """One of the fixed graphs, or a random digraph with weight 0.5 per edge."""
    w = np.eye(n)
    for i, j in digraph(rng, n):
        w[i, j] = 0.5
    return rng.choice([T.ring(n), T.exponential_two(n), T.fully_connected(n), Topology(w)])


def _added(start, sent):
    """``start + sent`` in their dtype, as accumulate adds (bool: a logical or)."""
    if start.dtype == torch.bool:
        return start | sent
    if start.dtype.is_floating_point or start.dtype.is_complex:
        return start + sent
    return (start.to(torch.int64) + sent.to(torch.int64)).to(start.dtype)  # small: no wrap


def window_case(rng, i, r, n):
    weighted = rng.random() < 0.5
    dtype = rng.choice(WEIGHTED_WINDOW if weighted else list(DTYPES))
    graph = _window_topology(rng, n)
    shape, zero_init = shape_of(rng), rng.random() < 0.5
    xs = [value(dtype, shape, 100 * i + s) for s in range(n)]
    kind = rng.choice(["put", "accumulate", "get"])
    # Weighted: some destinations only, each with its weight, and a self weight after.
    dst_w = [
        {d: rng.choice([0.5, 1.0, 1.5]) for d in graph.out_neighbors(s) if rng.random() < 0.8}
        for s in range(n)
    ]
    put_sw = [rng.choice([None, 1.0, 0.5]) for _ in range(n)]
    # get: rank t fetches each in-neighbour s's tensor, scaled by t's own weight for s.
    get_w = [{s: rng.choice([0.5, 1.0, 1.5]) for s in graph.in_neighbors(t)} for t in range(n)]
    sws = [rng.uniform(0, 1) for _ in range(n)]
    srcs = [{s: rng.uniform(0, 1) for s in graph.in_neighbors(t) if rng.random() < 0.7}
            for t in range(n)]  # fmt: skip
    with gossamer.Window.create(xs[r].clone(), topology=graph, zero_init=zero_init) as win:
        gossamer.barrier()
        if kind == "get":
            win.get(src_weights=get_w[r]) if weighted else win.get()
        else:
            op = getattr(win, kind)
            op(dst_weights=dst_w[r], self_weight=put_sw[r]) if weighted else op()
        gossamer.barrier()
        bufs = win.buffers()
        for s in graph.in_neighbors(r):
            start = torch.zeros_like(xs[r]) if zero_init else xs[r]
            if kind == "get":
                w = get_w[r][s] if weighted else 1.0
            else:
                w = (dst_w[s].get(r) if weighted else 1.0) if r in graph.out_neighbors(s) else None
            if w is None:
                close(bufs[s], start, f"window {kind} {dtype}: slot of {s} untouched")
                continue
            sent = from_wide(wide(xs[s]) * w, dtype) if w != 1.0 else xs[s]
            if kind == "accumulate":
                sent = _added(start, sent)
            close(bufs[s], sent, f"window {kind} {dtype} from {s}")
        if weighted:
            x = xs[r]
            if kind != "get" and put_sw[r] is not None:
                x = from_wide(wide(x) * put_sw[r], dtype)
            close(win.tensor, x, f"window {kind} self_weight {dtype}")
            sw, src = sws[r], srcs[r]
            got = win.update(self_weight=sw, src_weights=src)
            want = sw * wide(x) + sum(w * wide(bufs[s]) for s, w in src.items())
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
    """``(call, names of the bad argument)`` on rank ``r``; only rank ``bad`` passes it."""
    x = torch.ones(n, 2)
    is_bad = r == bad
    if kind == "allreduce":
        return lambda: gossamer.allreduce(x, average="yes" if is_bad else True), ("average",)
    if kind == "broadcast":
        return lambda: gossamer.broadcast(x, root=n if is_bad else 0), ("root",)
    if kind == "allgather":
        return lambda: gossamer.allgather(x[0, 0] if is_bad else x), ("tensor",)
    if kind == "alltoall":
        return lambda: gossamer.alltoall(x[:1] if is_bad else x), ("tensor",)
    if kind == "local_allreduce":  # one machine: the local group is the world
        return lambda: gossamer.local_allreduce(x, async_op=1 if is_bad else False), ("async_op",)
    if kind == "barrier":
        return lambda: gossamer.barrier(async_op=1 if is_bad else False), ("async_op",)
    if kind == "neighbor_allreduce":
        graph = T.fully_connected(n)
        return lambda: gossamer.neighbor_allreduce(
            x, topology=graph, async_op=None if is_bad else False
        ), ("async_op",)
    return lambda: gossamer.Window.create(torch.ones(2), zero_init=1 if is_bad else False), (
        "zero_init",
    )


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

# Defects one rank's dynamic neighbour call can have while every rank asks for the graph
# check (an allgather): the bad rank takes part in it with its reason, so every other rank
# raises PeerArgumentError at once and the group stays usable. Value: words that name it.
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


def _with_defect(defect, options, me, n):
    """``options`` of a dynamic neighbor_allreduce with ``defect`` on rank ``me``."""
    options = dict(options)
    if defect == "self_weight alone":
        return {"self_weight": 0.5, "check_topology": True}
    if defect == "src_weights key out of range":
        options["src_weights"] = {**options["src_weights"], n: 0.5}
    elif defect == "src_weights holds this rank":
        options["src_weights"] = {**options["src_weights"], me: 0.5}
    elif defect == "dst_weights holds this rank":
        options["dst_weights"] = [me]
    elif defect == "weight not finite":
        options["src_weights"] = {**options["src_weights"], (me + 1) % n: float("nan")}
    elif defect == "integer tensor":
        options["tensor"] = torch.ones(2, dtype=torch.int64)
    elif defect == "topology of another size":
        options["topology"] = Topology(np.eye(n + 1))
    else:
        options["async_op"] = "no"
    return options


def neighbor_defect_call(rng, r, n, bad):
    """A dynamic neighbor_allreduce with the graph check; rank ``bad`` has a defect."""
    defect = rng.choice(sorted(ONE_RANK_DEFECTS))
    sw, src_w, dsts, _ = _dynamic_plan(rng, n)
    options = {"self_weight": sw[r], "src_weights": src_w[r], "dst_weights": dsts[r]}
    options["check_topology"] = True
    if r == bad:
        options = _with_defect(defect, options, r, n)
    tensor = options.pop("tensor", torch.ones(2))
    return lambda: gossamer.neighbor_allreduce(tensor, **options), ONE_RANK_DEFECTS[defect]


def rejection_case(rng, i, r, n):
    kind, bad = rng.choice([*REJECTED, "neighbor defect"]), rng.randrange(n)
    if kind == "neighbor defect":
        fn, names = neighbor_defect_call(rng, r, n, bad)
    else:
        fn, names = rejected_call(kind, r, n, bad)
    start = time.monotonic()
    try:
        out = fn()
    except (TypeError, ValueError) as err:
        assert r == bad and any(w in str(err) for w in names), (kind, err)
    except PeerArgumentError as err:
        took = time.monotonic() - start
        assert r != bad and f"rank {bad}" in str(err), (kind, err)
        assert err.rank == bad, (kind, err.rank, err)
        assert took < PROMPT_S, (
            f"{kind}: rank {r} learned of rank {bad}'s rejection after {took:.1f} s"
        )
    else:
        if hasattr(out, "free"):
            out.free()
        raise AssertionError(f"{kind}: rank {r} finished although rank {bad} rejected its call")


# Defects every rank's neighbor_allreduce has alike: every rank raises the same error.
# Value: the words one of which the message must hold.
EVERY_RANK_DEFECTS = {
    "self_weight alone": ("self_weight",),
    "dst_weights without src_weights": ("dst_weights",),
    "src_weights key out of range": ("src_weights",),
    "src_weights holds this rank": ("src_weights",),
    "dst_weights holds this rank": ("dst_weights",),
    "integer tensor": ("tensor",),
    "check_topology not a bool": ("check_topology",),
    "topology of another size": ("topology",),
    "async_op not a bool": ("async_op",),
    # The graph check finds that sends and receives differ: the message names the ranks.
    "sends and receives differ": ("sends and receives",),
}


def everywhere_case(rng, i, r, n):
    defect = rng.choice(sorted(EVERY_RANK_DEFECTS))
    edges, other = digraph(rng, n), digraph(rng, n)
    if other == edges:  # receives must differ from sends somewhere
        other = edges[1:] if edges else [(0, 1)]
    options = {"self_weight": 0.5, "src_weights": {}}
    if defect == "self_weight alone":
        options = {"self_weight": 0.5}
    elif defect == "dst_weights without src_weights":
        options = {"dst_weights": {}}
    elif defect == "src_weights key out of range":
        options.update(src_weights={rng.choice([n, n + 3, -1]): 0.5}, dst_weights={})
    elif defect == "src_weights holds this rank":
        options["src_weights"] = {r: 0.5}
    elif defect == "dst_weights holds this rank":
        options["dst_weights"] = [r] if rng.random() < 0.5 else {r: 1.0}
    elif defect == "integer tensor":
        options["tensor"] = torch.ones(2, dtype=rng.choice([torch.int32, torch.int64]))
    elif defect == "check_topology not a bool":
        options["check_topology"] = rng.choice([1, "yes", None])
    elif defect == "topology of another size":
        options = {"topology": Topology(np.eye(rng.choice([1, n + 1])))}
    elif defect == "async_op not a bool":
        options["async_op"] = rng.choice([1, "no"])
    else:  # every rank receives per ``other`` but sends per ``edges``
        options["src_weights"] = {s: 0.5 for s, t in other if t == r}
        options["dst_weights"] = [t for s, t in edges if s == r]
        options["check_topology"] = True
    tensor = options.pop("tensor", torch.ones(2))
    with pytest.raises((TypeError, ValueError)) as info:
        gossamer.neighbor_allreduce(tensor, **options)
    message = str(info.value)
    assert not isinstance(info.value, PeerArgumentError), (defect, message)
    assert any(word in message for word in EVERY_RANK_DEFECTS[defect]), (defect, message)
    return f"{defect}: {type(info.value).__name__}"  # compared across ranks


def _fuzz(seed, count):
    r, n = gossamer.rank(), gossamer.size()
    rng = random.Random(seed)
    done, errors = {}, []
    for i in range(count):
        roll = rng.random()
        if roll < 0.15:
            case = rejection_case
        elif roll < 0.22:
            case = everywhere_case
        else:
            case = rng.choice(VALID)
        try:
            error = case(rng, i, r, n)
        except BaseException as err:
            raise AssertionError(f"case {i} ({case.__name__}, seed {seed}) on rank {r}") from err
        done[case.__name__] = done.get(case.__name__, 0) + 1
        if error is not None:
            errors.append((i, error))
    return done, errors


@pytest.mark.parametrize("world_size", sorted(CASES_PER_WORLD))
def test_fuzz_api_across_ranks(world_size):
    count = CASES_PER_WORLD[world_size]
    got = run_distributed(_fuzz, world_size, args=(world_size, count), timeout=240)
    # Every rank ran the same cases, and every rank raised the same error class alike.
    assert all(g == got[0] for g in got), got
    done, _ = got[0]
    assert sum(done.values()) == count and len(done) == len(VALID) + 2, done


def test_cases_per_run():
    # The bar: at least 200 generated calls across 2 to 4 ranks per CI run.
    assert sum(CASES_PER_WORLD.values()) >= 200
