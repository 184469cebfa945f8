"""reduce, gather, scatter, reduce_scatter, alltoall_v, send/recv and allreduce's ``op``.

Each result is compared with the definition computed in one process from every rank's
input (``oracle.data``); mismatched calls raise on every rank.
"""

import logging

import pytest
import torch

import gossamer
from gossamer.errors import PeerError
from gossamer.testing import RankError, run_distributed
from oracle import data

REDUCTIONS = {
    "sum": lambda xs: sum(xs),
    "average": lambda xs: sum(xs) / len(xs),
    "product": lambda xs: torch.stack(xs).prod(0),
    "min": lambda xs: torch.stack(xs).min(0).values,
    "max": lambda xs: torch.stack(xs).max(0).values,
    "band": lambda xs: _fold(xs, torch.bitwise_and),
    "bor": lambda xs: _fold(xs, torch.bitwise_or),
    "bxor": lambda xs: _fold(xs, torch.bitwise_xor),
}
BITWISE = ("band", "bor", "bxor")


def _fold(xs, fn):
    out = xs[0]
    for x in xs[1:]:
        out = fn(out, x)
    return out


def _input(rank, op, n, dtype=None):
    if dtype is None:
        dtype = torch.int64 if op in BITWISE else torch.float64
    x = data(rank, shape=(2 * n, 3), dtype=dtype)
    return x.clamp(-3, 3) if op == "product" else x  # keep products exact and small


def _everything():
    r, n = gossamer.rank(), gossamer.size()
    out = {}
    for op in REDUCTIONS:
        x = _input(r, op, n)
        out[("allreduce", op)] = gossamer.allreduce(x, op=op)
        out[("reduce", op)] = gossamer.reduce(x, root=n - 1, op=op)
        out[("reduce_scatter", op)] = gossamer.reduce_scatter(x, op=op)
    half = data(r, shape=(n, 4), dtype=torch.float16)
    out["reduce_scatter_half"] = gossamer.reduce_scatter(half, op="average")
    out["reduce_bool"] = gossamer.reduce(torch.tensor([r == 0, True]), root=0, op="min")
    x = data(r, shape=(2, 3), dtype=torch.int16)
    out["gather"] = gossamer.gather(x, root=0)
    root = min(1, n - 1)  # only root's values count
    out["scatter"] = gossamer.scatter(data(7, shape=(2 * n, 3)) * (r == root), root=root)
    # rank r sends k + r rows to rank k (of its n*r + n(n-1)/2 rows), bfloat16 rows of 2
    counts = [k + r for k in range(n)]
    v = data(r, shape=(sum(counts), 2), dtype=torch.bfloat16)
    out["alltoall_v"] = gossamer.alltoall_v(v, send_counts=counts)
    # the same with displacements: block k starts at row 2k (overlapping blocks are allowed)
    rows = data(r, shape=(2 * n + 1, 1))
    out["alltoall_v_displs"] = gossamer.alltoall_v(
        rows, send_counts=[1] * n, send_displs=[2 * k for k in range(n)], recv_counts=[1] * n
    )
    if n > 1:  # a ring of point-to-point messages, even ranks first
        msg = data(r, shape=(4,), dtype=torch.complex64)
        right, left = (r + 1) % n, (r - 1) % n
        if r % 2 == 0:
            assert gossamer.send(msg, dst=right) is None
            out["recv"] = gossamer.recv(torch.empty_like(msg), src=left)
        else:
            out["recv"] = gossamer.recv(torch.empty_like(msg), src=left, async_op=True).wait()
            gossamer.send(msg, dst=right)
    return out


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_every_operation_matches_its_definition(world_size):
    n = world_size
    got = run_distributed(_everything, n)
    for op, fn in REDUCTIONS.items():
        xs = [_input(r, op, n) for r in range(n)]
        want = fn(xs)
        rtol = 1e-12 if want.is_floating_point() else 0
        for r in range(n):
            torch.testing.assert_close(got[r][("allreduce", op)], want, rtol=rtol, atol=rtol)
            reduced = got[r][("reduce", op)]
            if r == n - 1:
                torch.testing.assert_close(reduced, want, rtol=rtol, atol=rtol)
            else:
                assert reduced is None
            block = want[r * 2 : (r + 1) * 2]
            torch.testing.assert_close(got[r][("reduce_scatter", op)], block, rtol=rtol, atol=rtol)
    halves = [data(r, shape=(n, 4), dtype=torch.float16).float() for r in range(n)]
    mean = (sum(halves) / n).half()
    for r in range(n):
        assert got[r]["reduce_scatter_half"].dtype == torch.float16
        torch.testing.assert_close(got[r]["reduce_scatter_half"], mean[r : r + 1])
        # gather: rank 0 only, int16 bytes in rank order
        if r == 0:
            expected = torch.cat([data(s, shape=(2, 3), dtype=torch.int16) for s in range(n)])
            assert torch.equal(got[0]["gather"], expected)
            assert got[0]["reduce_bool"].tolist() == [n == 1, True]
        else:
            assert got[r]["gather"] is None and got[r]["reduce_bool"] is None
        assert torch.equal(got[r]["scatter"], data(7, shape=(2 * n, 3))[2 * r : 2 * r + 2])
        # alltoall_v: from every rank s, its block for r (rows sum(k + s, k < r) onwards)
        blocks = []
        for s in range(n):
            counts = [k + s for k in range(n)]
            v = data(s, shape=(sum(counts), 2), dtype=torch.bfloat16)
            start = sum(counts[:r])
            blocks.append(v[start : start + counts[r]])
        assert torch.equal(got[r]["alltoall_v"], torch.cat(blocks))
        rows = [data(s, shape=(2 * n + 1, 1))[2 * r : 2 * r + 1] for s in range(n)]
        assert torch.equal(got[r]["alltoall_v_displs"], torch.cat(rows))
        if n > 1:
            left = (r - 1) % n
            assert torch.equal(got[r]["recv"], data(left, shape=(4,), dtype=torch.complex64))


def _mismatched(case):
    r, n = gossamer.rank(), gossamer.size()
    x = torch.zeros(2 * n)
    if case == "reduce op":
        gossamer.reduce(x, root=0, op="max" if r == 1 else "min")
    elif case == "gather root":
        gossamer.gather(x, root=r % 2)
    elif case == "alltoall_v counts":
        # rank 1 expects 2 rows from everyone, but each sends 1
        recv = [2] * n if r == 1 else [1] * n
        gossamer.alltoall_v(x[:n], send_counts=[1] * n, recv_counts=recv)
    elif case == "recv dtype":
        if r == 0:
            gossamer.send(x, dst=1)
        elif r == 1:
            gossamer.recv(x.double(), src=0)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("reduce op", "rank 1 called reduce"),
        ("gather root", "rank 1 called gather"),
        ("alltoall_v counts", "0->1: 1 sent, 2 expected"),
        ("recv dtype", "rank 0 called point_to_point of float32[4]"),
    ],
)
def test_mismatched_calls_raise(case, words):
    with pytest.raises(RankError) as info:
        run_distributed(_mismatched, 2, args=(case,))
    text = str(info.value)
    assert PeerError.__name__ in text and words in text


def _bad_arguments():
    x = torch.zeros(4)
    cases = [
        (ValueError, "op must be one of", lambda: gossamer.reduce(x, root=0, op="mean")),
        (
            TypeError,
            "'average' needs a floating",
            lambda: gossamer.allreduce(x.long(), op="average"),
        ),
        (TypeError, "'bxor' needs an integer", lambda: gossamer.reduce_scatter(x, op="bxor")),
        (ValueError, "root must be a rank", lambda: gossamer.gather(x, root=9)),
        (ValueError, "multiple of the group size", lambda: gossamer.scatter(x[:3], root=0)),
        (
            ValueError,
            "send_counts must add up",
            lambda: gossamer.alltoall_v(x, send_counts=[1] * gossamer.size()),
        ),
        (ValueError, "dst must be another rank", lambda: gossamer.send(x, dst=gossamer.rank())),
        (TypeError, "src must be an int", lambda: gossamer.recv(x, src="left")),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    return True


def test_bad_arguments_raise_naming_them():
    assert all(run_distributed(_bad_arguments, 2))


def _to_self():
    logged = []
    handler = logging.Handler(level=logging.WARNING)
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("gossamer").addHandler(handler)
    try:
        for call in (gossamer.send, gossamer.recv):
            peer = {"dst" if call is gossamer.send else "src": gossamer.rank()}
            with pytest.raises(ValueError, match="must be another rank"):
                call(torch.zeros(2), **peer)
        gossamer.barrier()  # after the parts the rejections queued, if any
    finally:
        logging.getLogger("gossamer").removeHandler(handler)
    return logged


def test_a_send_to_this_rank_tells_no_peer():
    # It used to tell "the peer" (itself) through a connection gloo does not have, logging
    # a raw gloo traceback after the ValueError.
    assert run_distributed(_to_self, 2) == [[], []]
