"""Bagua's communication primitives on 4 ranks: results, in-place twins, groups, errors."""

import pytest
import torch

import gossamer.bagua as bagua
from gossamer.errors import PeerError
from gossamer.testing import RankError, run_distributed

N = 4


def _primitives():
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    out = {}
    x = torch.arange(4.0) + 10 * r  # rank r: [10r, 10r+1, 10r+2, 10r+3]

    recv = torch.zeros(4)
    bagua.allreduce(x, recv)
    out["allreduce_sum"] = recv.clone()
    bagua.allreduce(x, recv, op=bagua.ReduceOp.AVG)
    out["allreduce_avg"] = recv.clone()
    t = x.clone()
    bagua.allreduce_inplace(t, op=bagua.ReduceOp.MAX)
    out["allreduce_max"] = t
    bits = torch.tensor([1 << r, 3])
    bagua.allreduce_inplace(bits, op=bagua.ReduceOp.BOR)
    out["allreduce_bor"] = bits

    t = x.clone()
    bagua.broadcast(t, src=2)
    out["broadcast"] = t
    out["broadcast_object"] = bagua.broadcast_object({"rank": r}, src=1)

    recv = torch.zeros(4)
    bagua.reduce(x, recv, dst=3, op=bagua.ReduceOp.MIN)
    out["reduce"] = recv.clone()

    recv = torch.zeros(4 * n)
    bagua.allgather(x, recv)
    out["allgather"] = recv.clone()
    t = torch.zeros(4 * n)
    t[4 * r : 4 * r + 4] = x
    bagua.allgather_inplace(t)
    out["allgather_inplace"] = t

    recv = torch.zeros(4 * n)
    bagua.gather(x, recv, dst=0)
    out["gather"] = recv.clone()

    send = torch.arange(2.0 * n) if r == 1 else torch.zeros(2 * n)
    recv = torch.zeros(2)
    bagua.scatter(send, recv, src=1)
    out["scatter"] = recv.clone()

    recv = torch.zeros(1)
    bagua.reduce_scatter(x, recv)
    out["reduce_scatter"] = recv.clone()
    t = x.clone()
    bagua.reduce_scatter_inplace(t)
    out["reduce_scatter_inplace"] = t[r].clone()

    recv = torch.zeros(4)
    bagua.alltoall(x, recv)
    out["alltoall"] = recv.clone()

    # rank r sends j+1 elements to rank j, starting at offset j
    counts = [j + 1 for j in range(n)]
    displs = list(range(n))
    recv_counts = [r + 1] * n
    recv = torch.zeros(n * (r + 1))
    send = torch.arange(2.0 * n) + 100 * r
    bagua.alltoall_v(send, counts, displs, recv, recv_counts, [i * (r + 1) for i in range(n)])
    out["alltoall_v"] = recv

    # point to point: 0 -> 1, then 1 -> 0
    if r == 0:
        bagua.send(x, dst=1)
    elif r == 1:
        got = torch.zeros(4)
        bagua.recv(got, src=0)
        out["recv"] = got
    bagua.barrier()

    # a sub-group of the even ranks; odd ranks are not members and return at once
    group = bagua.new_group([0, 2])
    t = x.clone()
    bagua.allreduce_inplace(t, comm=group.get_global_communicator())
    out["group"] = t
    return out


def test_primitives_match_their_definitions():
    got = run_distributed(_primitives, N)
    xs = [torch.arange(4.0) + 10 * r for r in range(N)]
    total = sum(xs)
    for r, res in enumerate(got):
        torch.testing.assert_close(res["allreduce_sum"], total)
        torch.testing.assert_close(res["allreduce_avg"], total / N)
        torch.testing.assert_close(res["allreduce_max"], xs[-1])
        assert res["allreduce_bor"].tolist() == [15, 3]
        torch.testing.assert_close(res["broadcast"], xs[2])
        assert res["broadcast_object"] == {"rank": 1}
        torch.testing.assert_close(res["allgather"], torch.cat(xs))
        torch.testing.assert_close(res["allgather_inplace"], torch.cat(xs))
        torch.testing.assert_close(res["scatter"], torch.arange(2.0 * N)[2 * r : 2 * r + 2])
        torch.testing.assert_close(res["reduce_scatter"], total[r : r + 1])
        torch.testing.assert_close(res["reduce_scatter_inplace"], total[r])
        torch.testing.assert_close(res["alltoall"], torch.stack([x[r] for x in xs]))
        expected_v = torch.cat([(torch.arange(2.0 * N) + 100 * i)[r : r + r + 1] for i in range(N)])
        torch.testing.assert_close(res["alltoall_v"], expected_v)
        in_group = r % 2 == 0
        torch.testing.assert_close(res["group"], xs[0] + xs[2] if in_group else xs[r])
    torch.testing.assert_close(got[3]["reduce"], xs[0])
    torch.testing.assert_close(got[0]["gather"], torch.cat(xs))
    torch.testing.assert_close(got[1]["recv"], xs[0])


def _bad_arguments():
    bagua.init_process_group()
    errors = []
    for call in (
        lambda: bagua.allreduce(torch.ones(2), torch.zeros(3)),
        lambda: bagua.allreduce_inplace(torch.ones(2), op=bagua.ReduceOp.BAND),
        lambda: bagua.allreduce_inplace(torch.ones(2, dtype=torch.int64), op=bagua.ReduceOp.AVG),
        lambda: bagua.allreduce_inplace(torch.ones(2), op=42),
        lambda: bagua.alltoall(torch.ones(3), torch.ones(3)),
        lambda: bagua.send(torch.ones(1), dst=bagua.get_rank()),
        lambda: bagua.new_group([0, 7]),
    ):
        try:
            call()
            errors.append(None)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    return errors


def test_bad_arguments_raise_before_communicating():
    errors = run_distributed(_bad_arguments, 2)[0]
    assert "recv_tensor must have 2 elements; got 3" in errors[0]
    assert "op 'band' needs an integer or bool tensor" in errors[1]
    assert "op 'average' needs a floating tensor" in errors[2]
    assert "op must be a ReduceOp" in errors[3]
    assert "multiple of the group size 2" in errors[4]
    assert "dst must be another rank" in errors[5]
    assert "ranks must be in [0, 2); got [7]" in errors[6]


def _mismatch():
    bagua.init_process_group()
    r = bagua.get_rank()
    t = torch.zeros(4 if r != 1 else 8)
    bagua.alltoall_inplace(t)


def test_a_mismatched_call_raises_on_every_rank():
    # (last: a failed call replaces the pool of ranks)
    with pytest.raises(RankError) as info:
        run_distributed(_mismatch, 2)
    text = str(info.value)
    assert text.count(PeerError.__name__) >= 2 and "rank 1 called alltoall of float32[8]" in text
