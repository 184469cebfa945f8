import time

import numpy as np
import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.errors import WindowError
from gossamer.testing import run_distributed
from oracle import assert_all_close, data, mix

F64 = torch.float64


def _put_then_update(zero_init, weighted):
    r = gossamer.rank()
    x = data(r, dtype=F64)
    with gossamer.Window.create(x, zero_init=zero_init) as win:
        initial = win.buffers()
        gossamer.barrier()  # nobody puts before everyone has read its initial buffers
        out = {d: 0.5 + 0.25 * d for d in win.out_neighbors} if weighted else None
        win.put(dst_weights=out, self_weight=0.5 if weighted else None)
        gossamer.barrier()
        bufs, versions = win.buffers(), win.versions()
        after_put = x.clone()
        y = win.update(clone=True)
        assert torch.equal(x, after_put), "clone must not touch the registered tensor"
        assert win.versions() == dict.fromkeys(win.in_neighbors, 0)
        z = win.update()
        assert z is x
        gossamer.barrier()
    return initial, bufs, versions, after_put, y


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("zero_init", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
def test_put_then_update(world_size, zero_init, weighted):
    got = run_distributed(_put_then_update, world_size, args=(zero_init, weighted))
    graph = topo.exponential_two(world_size)
    xs = [data(r, dtype=F64) for r in range(world_size)]
    for r, (initial, bufs, versions, after_put, _y) in enumerate(got):
        srcs = graph.in_neighbors(r)
        for s in srcs:
            expected = torch.zeros_like(xs[r]) if zero_init else xs[r]
            assert torch.equal(initial[s], expected)
            w = 0.5 + 0.25 * r if weighted else 1.0
            torch.testing.assert_close(bufs[s], xs[s] * w)
        assert versions == dict.fromkeys(srcs, 1)
        torch.testing.assert_close(after_put, xs[r] * (0.5 if weighted else 1.0))
    if not weighted:  # uniform update = one gossip step of the full weight matrix
        assert_all_close([g[4] for g in got], mix(graph.weights, xs), F64)


def _accumulate_twice():
    r = gossamer.rank()
    x = data(r, dtype=F64)
    with gossamer.Window.create(x) as win:
        win.accumulate(dst_weights=dict.fromkeys(win.out_neighbors, 2.0))
        win.accumulate(async_op=True).wait()
        gossamer.barrier()
        bufs, versions = win.buffers(), win.versions()
        gossamer.barrier()
    return bufs, versions


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_accumulate_adds_and_keeps_versions(world_size):
    graph = topo.exponential_two(world_size)
    for r, (bufs, versions) in enumerate(run_distributed(_accumulate_twice, world_size)):
        for s in graph.in_neighbors(r):
            # buffers start as a copy of this rank's own tensor
            torch.testing.assert_close(bufs[s], data(r, dtype=F64) + 3 * data(s, dtype=F64))
        assert versions == dict.fromkeys(graph.in_neighbors(r), 0)


def _get(weighted):
    r = gossamer.rank()
    x = data(r, dtype=F64)
    with gossamer.Window.create(x, zero_init=True) as win:
        gossamer.barrier()
        weights = {s: 1.0 + s for s in win.in_neighbors} if weighted else None
        handle = win.get(src_weights=weights, async_op=True)
        handle.wait()
        assert handle.is_completed()
        bufs, versions = win.buffers(), win.versions()
        gossamer.barrier()
    return bufs, versions


@pytest.mark.parametrize("world_size", [2, 3, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_get_fetches_current_tensors(world_size, weighted):
    graph = topo.exponential_two(world_size)
    for r, (bufs, versions) in enumerate(run_distributed(_get, world_size, args=(weighted,))):
        for s in graph.in_neighbors(r):
            w = 1.0 + s if weighted else 1.0
            torch.testing.assert_close(bufs[s], w * data(s, dtype=F64))
        assert versions == dict.fromkeys(graph.in_neighbors(r), 1)


def _weighted_update_reset():
    r = gossamer.rank()
    x = data(r, dtype=F64)
    with gossamer.Window.create(x) as win:
        win.put()
        gossamer.barrier()
        srcs = win.in_neighbors
        weights = {s: 0.1 * (i + 1) for i, s in enumerate(srcs)}
        y = win.update(self_weight=0.4, src_weights=weights, reset=True)
        left = win.buffers()
        gossamer.barrier()
    return y, weights, left


@pytest.mark.parametrize("world_size", [2, 4])
def test_weighted_update_and_reset(world_size):
    got = run_distributed(_weighted_update_reset, world_size)
    W = np.zeros((world_size, world_size))
    for r, (_, weights, left) in enumerate(got):
        W[r, r] = 0.4
        for s, w in weights.items():
            W[s, r] = w
            assert torch.count_nonzero(left[s]) == 0
    xs = [data(r, dtype=F64) for r in range(world_size)]
    assert_all_close([g[0] for g in got], mix(W, xs), F64)


def _collect_twice():
    x = torch.full((3,), float(gossamer.rank()), dtype=F64)
    with gossamer.Window.create(x, zero_init=True) as win:
        win.accumulate()
        gossamer.barrier()
        first = win.update_then_collect().clone()
        second = win.update_then_collect().clone()
        gossamer.barrier()
    return first, second


def test_update_then_collect_is_idempotent():
    graph = topo.exponential_two(4)
    for r, (first, second) in enumerate(run_distributed(_collect_twice, 4)):
        expected = float(r + sum(graph.in_neighbors(r)))
        assert torch.equal(first, torch.full((3,), expected, dtype=F64))
        assert torch.equal(second, first)


def _associated_p():
    n = gossamer.size()
    gossamer.set_topology(topo.ring(n))
    x = torch.ones(2, dtype=F64)
    try:
        with gossamer.Window.create(x, zero_init=True, push_sum=True) as win:
            if gossamer.rank() == 0:
                win.accumulate(self_weight=0.5, dst_weights=dict.fromkeys(win.out_neighbors, 0.5))
            gossamer.barrier()
            win.update_then_collect()
            p = win.p
            gossamer.barrier()
    finally:
        gossamer.set_topology(topo.exponential_two(n))
    return p


@pytest.mark.parametrize("world_size", [3, 4])
def test_push_sum_weight_follows_accumulate_and_collect(world_size):
    got = run_distributed(_associated_p, world_size)
    expected = [1.0] * world_size
    expected[0], expected[1], expected[-1] = 0.5, 1.5, 1.5
    assert got == expected


def _no_lost_updates(k):
    n, r = gossamer.size(), gossamer.rank()
    gossamer.set_topology(topo.fully_connected(n))
    x = torch.zeros(4, dtype=F64)
    try:
        with gossamer.Window.create(x, zero_init=True) as win:
            gossamer.barrier()
            if r == 0:  # the owner keeps collecting while the others accumulate
                for _ in range(k):
                    win.update_then_collect(require_mutex=True)
            else:
                one = torch.ones(4, dtype=F64)
                for _ in range(k):
                    win.accumulate(one, dst_weights={0: 1.0}, require_mutex=True)
            gossamer.barrier()
            total = win.update_then_collect().clone() if r == 0 else None
            gossamer.barrier()
    finally:
        gossamer.set_topology(topo.exponential_two(n))
    return total


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_no_lost_updates_under_the_mutex(world_size):
    k = 40
    total = run_distributed(_no_lost_updates, world_size, args=(k,))[0]
    assert torch.equal(total, torch.full((4,), float(k * (world_size - 1)), dtype=F64))


def _mutex_excludes():
    n, r = gossamer.size(), gossamer.rank()
    gossamer.set_topology(topo.fully_connected(n))
    try:
        with gossamer.Window.create(torch.zeros(1)) as win:
            gossamer.barrier()
            if r == 0:
                with win.mutex(for_self=True):  # rank 0's own slots of every other rank
                    gossamer.barrier()
                    time.sleep(0.5)
                    released = time.time()
                acquired = None
            else:
                gossamer.barrier()
                with win.mutex():  # includes this rank's slot at rank 0
                    acquired = time.time()
                released = None
            stamps = gossamer.allgather(
                torch.tensor([released or 0.0, acquired or 0.0], dtype=F64).reshape(1, 2)
            )
            gossamer.barrier()
    finally:
        gossamer.set_topology(topo.exponential_two(n))
    return stamps


@pytest.mark.parametrize("world_size", [2, 4])
def test_mutex_holder_excludes_the_others(world_size):
    stamps = run_distributed(_mutex_excludes, world_size)[0]
    released = stamps[0, 0].item()
    assert all(stamps[r, 1].item() >= released for r in range(1, world_size))


def _with_collectives():
    r = gossamer.rank()
    a = torch.full((5,), float(r), dtype=F64)
    b = torch.full((2, 2), 10.0 + r, dtype=torch.float32)
    with (
        gossamer.Window.create(a, zero_init=True, name="a") as wa,
        gossamer.Window.create(b, zero_init=True, name="b") as wb,
    ):
        assert gossamer.live_windows() == ["a", "b"]
        handles = []
        sums = []
        for _ in range(5):
            handles.append(wa.put(async_op=True))
            sums.append(gossamer.allreduce(torch.ones(1), average=False).item())
            handles.append(wb.accumulate(async_op=True))
        for h in handles:
            h.wait()
        gossamer.barrier()
        result = wa.buffers(), wb.buffers(), sums
        gossamer.barrier()
    assert gossamer.live_windows() == []
    return result


def test_two_windows_while_collectives_run():
    n = 4
    graph = topo.exponential_two(n)
    for r, (bufs_a, bufs_b, sums) in enumerate(run_distributed(_with_collectives, n)):
        assert sums == [float(n)] * 5
        for s in graph.in_neighbors(r):
            assert torch.equal(bufs_a[s], torch.full((5,), float(s), dtype=F64))
            assert torch.equal(bufs_b[s], torch.full((2, 2), 5 * (10.0 + s)))


def _default_names_avoid_given_ones():
    x = torch.ones(3)
    probe = gossamer.Window.create(x)
    w = int(probe.name.removeprefix("window"))  # the next ones get ids w + 1, w + 2, ...
    probe.free()
    given = [gossamer.Window.create(x, name=f"window{w + 2 + k}") for k in range(4)]
    default = gossamer.Window.create(x)  # id w + 5: "window{w + 5}" is given
    names = gossamer.live_windows()
    for window in [*given, default]:
        window.free()
    return default.name, names, gossamer.live_windows()


def test_a_default_window_name_never_takes_a_given_one():
    for name, names, left in run_distributed(_default_names_avoid_given_ones, 2):
        assert len(set(names)) == 5 and name in names and left == []


def _push_sum_consensus(iters):
    n, r = gossamer.size(), gossamer.rank()
    # directed, not doubly stochastic: a ring i -> i+1, plus rank 0 -> everyone
    A = np.zeros((n, n))
    for i in range(n):
        A[i, (i + 1) % n] = 1
        A[0, i] = 1 if i else 0
    graph = topo.uniform_weights(A)
    x = data(r, shape=(6,), dtype=F64)
    with gossamer.Window.create(x, zero_init=True, push_sum=True, topology=graph) as win:
        share = 1.0 / (len(win.out_neighbors) + 1)
        gossamer.barrier()
        for _ in range(iters):
            win.accumulate(self_weight=share, dst_weights=dict.fromkeys(win.out_neighbors, share))
            time.sleep(0.001 * r)  # ranks run at different speeds
            win.update_then_collect()
        gossamer.barrier()  # every push has landed: collect the mass still in the buffers
        win.update_then_collect()
        estimate = (x / win.p).clone()
        gossamer.barrier()
    return estimate


@pytest.mark.parametrize("world_size", [3, 4])
def test_asynchronous_push_sum_reaches_the_exact_mean(world_size):
    got = run_distributed(_push_sum_consensus, world_size, args=(150,), timeout=120)
    mean = sum(data(r, shape=(6,), dtype=F64) for r in range(world_size)) / world_size
    for estimate in got:
        torch.testing.assert_close(estimate, mean, rtol=0, atol=1e-6)


def _errors():
    r, n = gossamer.rank(), gossamer.size()
    x = torch.zeros(3)
    win = gossamer.Window.create(x, name="err")
    not_out = [d for d in range(n) if d != r and d not in win.out_neighbors]
    not_in = [s for s in range(n) if s != r and s not in win.in_neighbors]
    cases = [
        (ValueError, "already exists", lambda: gossamer.Window.create(x, name="err")),
        (TypeError, "torch.Tensor", lambda: gossamer.Window.create([0.0, 1.0])),
        (TypeError, "dense", lambda: gossamer.Window.create(torch.zeros(2).to_sparse())),
        (ValueError, "must match the window", lambda: win.put(torch.zeros(4))),
        (ValueError, "given together", lambda: win.update(self_weight=0.5)),
        (gossamer.TopologyError, "windows exist", lambda: gossamer.set_topology(topo.ring(n))),
        (ValueError, "must not contain this rank", lambda: win.mutex(ranks=[r])),
        (TypeError, "Window.p must be a real number; got 'abc'", lambda: setattr(win, "p", "abc")),
        (ValueError, "Window.p must be finite; got nan", lambda: setattr(win, "p", float("nan"))),
    ]
    if not_out:
        cases.append((ValueError, "out-neighbours", lambda: win.put(dst_weights={not_out[0]: 1.0})))
    if not_in:
        cases.append((ValueError, "in-neighbours", lambda: win.get(src_weights={not_in[0]: 1.0})))
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    assert win.p == 1.0  # the refused values left it as it was
    win.free()
    for call in (win.put, win.get, win.update, win.free, lambda: win.p):
        with pytest.raises(WindowError, match="freed"):
            call()
    gossamer.set_topology(topo.ring(n))  # allowed again
    gossamer.set_topology(topo.exponential_two(n))
    return True


@pytest.mark.parametrize("world_size", [1, 4])
def test_bad_input_and_freed_windows(world_size):
    assert all(run_distributed(_errors, world_size))


def _free_against_a_barrier():
    win = gossamer.Window.create(torch.zeros(3), name="mismatched")
    start = time.monotonic()
    with pytest.raises(gossamer.PeerError, match=r"rank 0 called window_free .* barrier"):
        win.free() if gossamer.rank() == 0 else gossamer.barrier()
    seconds = time.monotonic() - start
    win.free()  # the refused free left the window whole: freed now on every rank alike
    assert gossamer.live_windows() == []
    return seconds


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_free_against_another_collective_raises_at_once(world_size):
    # It was a bare barrier: it met the others' barrier, or waited for the deadline.
    assert all(s < 10 for s in run_distributed(_free_against_a_barrier, world_size))


def _load_slots_checks():
    win = gossamer.Window.create(torch.zeros(3), name="slots")
    src = win.in_neighbors[0]
    before = win.buffers()
    cases = [
        (
            TypeError,
            r"buffers\[\d+\] must be a torch.float32 tensor; got torch.int64",
            {src: torch.ones(3, dtype=torch.int64)},
            None,
        ),
        (TypeError, "got list", {src: [1.0, 2.0, 3.0]}, None),
        (ValueError, "has shape", {src: torch.ones(4)}, None),
        (
            ValueError,
            "p_buffers keys must be in-neighbours",
            {src: torch.ones(3)},
            {gossamer.rank(): 2.0},
        ),
        (TypeError, r"p_buffers\[\d+\] must be a real number", {src: torch.ones(3)}, {src: "2"}),
    ]
    for exc, words, buffers, weights in cases:
        with pytest.raises(exc, match=words):
            win.load_slots(buffers, weights)
        assert all(torch.equal(before[s], b) for s, b in win.buffers().items())  # nothing loaded
    win.load_slots({src: torch.full((3,), 2.0)}, {src: 0.5})
    assert torch.equal(win.buffers()[src], torch.full((3,), 2.0)) and win.p_buffers()[src] == 0.5
    win.free()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_slots_refuses_other_dtypes_and_changes_nothing_on_error(world_size):
    assert all(run_distributed(_load_slots_checks, world_size))


def _mismatched_create():
    last = gossamer.rank() == gossamer.size() - 1
    for kwargs, words in (
        ({"push_sum": last}, r"rank 0 called window_create \(push_sum=False, elastic=False\)"),
        ({"elastic": last}, "elastic=True"),
    ):
        with pytest.raises(gossamer.PeerError, match=words):
            gossamer.Window.create(torch.zeros(2), name="mismatch", **kwargs)
    with pytest.raises(gossamer.PeerError, match=r"float32\[3\]"):
        gossamer.Window.create(torch.zeros(3 if last else 2), name="mismatch")
    win = gossamer.Window.create(torch.zeros(2), name="mismatch", push_sum=True)  # usable after
    win.free()
    return True


@pytest.mark.parametrize("world_size", [2, 3])
def test_ranks_that_create_a_window_differently_are_named(world_size):
    assert all(run_distributed(_mismatched_create, world_size))
