"""bf.win_* by name: create/free, put/get/accumulate/update, versions, mutex, push-sum p."""

import time
from functools import partial

import networkx as nx
import pytest
import torch

import gossamer.bluefog as bf
import oracle
from gossamer.testing import run_distributed
from oracle import assert_close

F64 = torch.float64
# float64, so that every reference holds to 1e-12
data = partial(oracle.data, shape=(3, 4), dtype=F64)


def _put_and_update(weighted):
    bf.init()
    r = bf.rank()
    bf.set_topology(bf.MeshGrid2DGraph(bf.size()), is_weighted=weighted)
    x = data(r)
    out = {}
    try:
        assert bf.win_create(x, "x")
        assert bf.win_create(torch.zeros(2, dtype=torch.int64), "counts", zero_init=True)
        out["names"] = bf.get_current_created_window_names()
        out["versions0"] = bf.get_win_version("x")
        bf.barrier()  # nobody puts before everyone has created
        assert bf.win_put(x, "x", dst_weights={d: 1.0 + d for d in bf.out_neighbor_ranks()})
        bf.barrier()
        out["versions1"] = bf.get_win_version("x")
        # clone: the registered tensor is left alone
        out["clone"] = bf.win_update("x", clone=True)
        default = bf.win_update("x")
        assert default is x
        out["default"] = default.clone()
        out["versions2"] = bf.get_win_version("x")
        out["weighted"] = bf.win_update(
            "x", self_weight=0.5, neighbor_weights={s: 0.25 for s in bf.in_neighbor_ranks()}
        ).clone()
        out["collect"] = bf.win_update_then_collect("x").clone()
        out["collect_again"] = bf.win_update_then_collect("x").clone()  # buffers are zero now
        bf.barrier()
    finally:
        assert bf.win_free()
        bf.set_topology()
    out["names_after"] = bf.get_current_created_window_names()
    return out


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("weighted", [False, True])
def test_put_then_update(world_size, weighted):
    n = world_size
    W = nx.to_numpy_array(bf.MeshGrid2DGraph(n))
    xs = [data(r) for r in range(n)]
    for r, out in enumerate(run_distributed(_put_and_update, n, args=(weighted,))):
        srcs = [s for s in range(n) if s != r and W[s, r]]
        assert out["names"] == ["counts", "x"] and out["names_after"] == []
        assert out["versions0"] == dict.fromkeys(srcs, 0)
        assert out["versions1"] == dict.fromkeys(srcs, 1)
        assert out["versions2"] == dict.fromkeys(srcs, 0)
        bufs = {s: (1.0 + r) * xs[s] for s in srcs}  # the senders scaled by 1 + dst
        if weighted:
            expected = W[r, r] * xs[r] + sum(W[s, r] * bufs[s] for s in srcs)
            assert_close(out["clone"], expected)
        else:  # sum, then divide, bit for bit
            expected = xs[r].clone()
            for s in srcs:
                expected += bufs[s]
            assert torch.equal(out["clone"], expected / (len(srcs) + 1))
        assert_close(out["default"], out["clone"])
        weighted_step = 0.5 * out["default"] + 0.25 * sum(bufs.values())
        assert_close(out["weighted"], weighted_step)
        assert_close(out["collect"], weighted_step + sum(bufs.values()))
        assert_close(out["collect_again"], out["collect"])


def _get_accumulate_handles():
    bf.init()
    r, n = bf.rank(), bf.size()
    x = data(r)
    out = {}
    try:
        assert bf.win_create(x, "x", zero_init=True)
        assert not bf.win_create(x, "x"), "a second window of the same name"
        bf.barrier()
        handle = bf.win_get_nonblocking("x", src_weights={s: 2.0 for s in bf.in_neighbor_ranks()})
        assert bf.win_wait(handle) and not bf.win_wait(handle)
        out["get_versions"] = bf.get_win_version("x")
        out["got"] = bf.win_update(
            "x",
            self_weight=0.0,
            neighbor_weights={s: 1.0 for s in bf.in_neighbor_ranks()},
            reset=True,
            clone=True,
        )
        bf.barrier()
        handle = bf.win_accumulate_nonblocking(x, "x", self_weight=0.5)
        while not bf.win_poll(handle):
            time.sleep(0.001)
        assert bf.win_wait(handle)
        assert bf.neighbor_win_accumulate(x, "x", dst_weights={bf.out_neighbor_ranks()[0]: 1.0})
        out["scaled"] = x.clone()  # self_weight scales the registered tensor in place
        bf.barrier()
        out["acc_versions"] = bf.get_win_version("x")
        out["acc"] = bf.win_update(
            "x",
            self_weight=0.0,
            neighbor_weights={s: 1.0 for s in bf.in_neighbor_ranks()},
            clone=True,
        )
        errors = {}
        for name, call in {
            "unknown_window": lambda: bf.win_put(x, "nope"),
            "self_alone": lambda: bf.win_update("x", self_weight=0.5),
            "list_weights": lambda: bf.win_update("x", 0.5, [0]),
            "not_in_neighbor": lambda: bf.win_update("x", 0.5, {r: 0.5}),
            "bad_dst": lambda: bf.win_put(x, "x", dst_weights={(r + n // 2 + 1) % n: 1.0}),
            "unknown_poll": lambda: bf.win_poll(10**9),
        }.items():
            try:
                call()
            except ValueError as err:
                errors[name] = str(err)
        out["errors"] = errors
        out["unknown_wait"] = bf.win_wait(10**9)
        bf.barrier()
    finally:
        out["free_unknown"] = bf.win_free("nope")
        assert bf.win_free("x")
    return out


def test_get_accumulate_and_handles():
    n = 4
    W = nx.to_numpy_array(bf.ExponentialGraph(n))
    xs = [data(r) for r in range(n)]
    for r, out in enumerate(run_distributed(_get_accumulate_handles, n)):
        srcs = [s for s in range(n) if s != r and W[s, r]]
        assert out["get_versions"] == dict.fromkeys(srcs, 1)
        assert_close(out["got"], 2.0 * sum(xs[s] for s in srcs))
        assert_close(out["scaled"], 0.5 * xs[r])
        assert out["acc_versions"] == dict.fromkeys(srcs, 0)  # accumulate keeps versions

        # reset zeroed the buffers; every source then added x_s, and 0.5 x_s more at its
        # first out-neighbour
        def first_out(s):
            return min(j for j in range(n) if j != s and W[s, j])

        expected = sum(xs[s] * (1.5 if first_out(s) == r else 1.0) for s in srcs)
        assert_close(out["acc"], expected)
        assert set(out["errors"]) == {
            "unknown_window",
            "self_alone",
            "list_weights",
            "not_in_neighbor",
            "bad_dst",
            "unknown_poll",
        }
        assert "no window named 'nope'" in out["errors"]["unknown_window"]
        assert out["unknown_wait"] is False
        assert out["free_unknown"] is False


def _associated_p():
    bf.init()
    r, n = bf.rank(), bf.size()
    bf.set_topology(bf.RingGraph(n))
    x = torch.ones(3, dtype=F64)
    out = {}
    try:
        assert bf.win_create(x, "before")  # made before the switch: it applies too
        bf.turn_on_win_ops_with_associated_p()
        assert bf.win_create(torch.ones(3, dtype=F64), "after", zero_init=True)
        bf.barrier()
        if r == 0:
            bf.win_accumulate(
                x, "before", self_weight=0.5, dst_weights={1: 0.5, n - 1: 0.5}, require_mutex=True
            )
        bf.barrier()
        bf.win_update_then_collect("before")
        out["p"] = bf.win_associated_p("before")
        bf.win_update("after", self_weight=0.5, neighbor_weights={})
        out["p_after"] = bf.win_associated_p("after")
        bf.barrier()
        bf.turn_off_win_ops_with_associated_p()
        bf.win_update("before", self_weight=0.5, neighbor_weights={})
        out["p_off"] = bf.win_associated_p("before")
        bf.barrier()
    finally:
        bf.turn_off_win_ops_with_associated_p()
        bf.win_free()
        bf.set_topology()
    return out


def test_associated_p_follows_accumulate_and_collect():
    got = run_distributed(_associated_p, 4)
    assert [out["p"] for out in got] == [0.5, 1.5, 1.0, 1.5]
    assert [out["p_after"] for out in got] == [0.5] * 4
    assert [out["p_off"] for out in got] == [out["p"] for out in got]


def _mutex():
    bf.init()
    r = bf.rank()
    bf.set_topology(bf.FullyConnectedGraph(bf.size()))
    waited = 0.0
    try:
        assert bf.win_create(torch.zeros(2, dtype=F64), "m")
        if r == 0:
            with bf.win_mutex("m", for_self=True):
                bf.barrier()
                time.sleep(0.5)
        else:
            bf.barrier()
            start = time.monotonic()
            with bf.win_mutex("m", ranks=[0]):
                waited = time.monotonic() - start
        bf.barrier()
    finally:
        bf.win_free()
        bf.set_topology()
    return waited


def test_mutex_holder_excludes_the_others():
    waited = run_distributed(_mutex, 3)
    assert all(0.4 < w < 5 for w in waited[1:]), waited


def _half_weights():
    bf.init()
    x = torch.ones(3)
    assert bf.win_create(x, "half")
    with pytest.raises(ValueError, match=r"self_weight and neighbor_weights must be given toge"):
        bf.win_update("half", self_weight=0.5)  # BlueFog's name for the weights, not gossamer's
    assert bf.win_free("half")
    return True


def test_update_names_neighbor_weights_when_half_the_weights_are_given():
    assert run_distributed(_half_weights, 2) == [True, True]
