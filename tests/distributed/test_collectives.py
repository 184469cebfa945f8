import pytest
import torch

import gossamer
from gossamer.errors import PeerError
from gossamer.testing import run_distributed
from oracle import assert_all_close, data

SIZES = [1, 2, 3, 4]
FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64, torch.int8, torch.uint8]


def _allreduce(dtype, average, inplace):
    x = data(gossamer.rank(), dtype=dtype)
    before = x.clone()
    fn = gossamer.allreduce_ if inplace else gossamer.allreduce
    y = fn(x, average=average)
    if inplace:
        assert y is x
    else:
        assert torch.equal(x, before), "input modified"
    return y


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("inplace", [False, True])
def test_allreduce_average(world_size, dtype, inplace):
    got = run_distributed(_allreduce, world_size, args=(dtype, True, inplace))
    mean = sum(data(r, dtype=dtype).double() for r in range(world_size)) / world_size
    assert_all_close(got, [mean] * world_size, dtype)


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, *INTS])
def test_allreduce_sum(world_size, dtype):
    got = run_distributed(_allreduce, world_size, args=(dtype, False, False))
    total = sum(
        data(r, dtype=dtype).to(torch.int64 if not dtype.is_floating_point else torch.float64)
        for r in range(world_size)
    )
    if dtype in (torch.int8, torch.uint8):
        total = total.to(dtype)  # wraps around like the dtype does
    for y in got:
        assert y.dtype == dtype
        torch.testing.assert_close(y.to(total.dtype), total)


def _async_allreduce():
    x = torch.full((4,), float(gossamer.rank()))
    handle = gossamer.allreduce(x, average=False, async_op=True)
    fut = handle.get_future()
    y = handle.wait()
    assert handle.is_completed()
    assert torch.equal(fut.wait(), y)
    return y


@pytest.mark.parametrize("world_size", [2, 3])
def test_allreduce_async_handle(world_size):
    expected = float(sum(range(world_size)))
    for y in run_distributed(_async_allreduce, world_size):
        assert torch.equal(y, torch.full((4,), expected))


def _broadcast(root, dtype, inplace):
    x = data(gossamer.rank(), dtype=dtype)
    fn = gossamer.broadcast_ if inplace else gossamer.broadcast
    y = fn(x, root=root)
    assert (y is x) == inplace
    return y


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.uint8, torch.bool])
def test_broadcast_from_every_root(world_size, dtype):
    for root in range(world_size):
        for inplace in (False, True):
            got = run_distributed(_broadcast, world_size, args=(root, dtype, inplace))
            assert all(torch.equal(y, data(root, dtype=dtype)) for y in got)


def _allgather(dtype):
    r = gossamer.rank()
    return gossamer.allgather(data(r, shape=(r + 1, 2), dtype=dtype))


@pytest.mark.parametrize("world_size", SIZES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.int32, torch.float16])
def test_allgather_with_different_first_dims(world_size, dtype):
    expected = torch.cat([data(r, shape=(r + 1, 2), dtype=dtype) for r in range(world_size)])
    for y in run_distributed(_allgather, world_size, args=(dtype,)):
        assert torch.equal(y, expected)


def _barrier():
    gossamer.barrier()
    gossamer.barrier(async_op=True).wait()
    return True


@pytest.mark.parametrize("world_size", SIZES)
def test_barrier(world_size):
    assert run_distributed(_barrier, world_size) == [True] * world_size


def _mismatched(op):
    r = gossamer.rank()
    shape = (3,) if r != 1 else (4,)
    x = torch.zeros(shape)
    with pytest.raises(PeerError) as info:
        if op == "allreduce":
            gossamer.allreduce(x)
        elif op == "broadcast":
            gossamer.broadcast(x, root=0)
        else:
            gossamer.allgather(torch.zeros((2, *shape)))
    message = str(info.value)
    assert "float32[3]" in message or "float32[2, 3]" in message
    assert "float32[4]" in message or "float32[2, 4]" in message
    assert "rank 1" in message
    # the group still works afterwards
    return gossamer.allreduce(torch.ones(1), average=False).item()


@pytest.mark.parametrize("op", ["allreduce", "broadcast", "allgather"])
@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatched_shapes_raise_on_every_rank(op, world_size):
    assert run_distributed(_mismatched, world_size, args=(op,)) == [world_size] * world_size


def _mismatched_dtype_and_root():
    r = gossamer.rank()
    with pytest.raises(PeerError, match="float64"):
        gossamer.allreduce(torch.zeros(2, dtype=torch.float64 if r == 0 else torch.float32))
    with pytest.raises(PeerError, match="root"):
        gossamer.broadcast(torch.zeros(2), root=r)
    with pytest.raises(PeerError, match="mismatched call"):
        gossamer.allreduce(torch.zeros(2), average=r == 0)
    return True


def test_mismatched_dtype_root_and_average_raise():
    assert run_distributed(_mismatched_dtype_and_root, 2) == [True, True]


def _different_operations():
    with pytest.raises(PeerError) as info:
        if gossamer.rank() == 0:
            gossamer.allreduce(torch.zeros(3))
        else:
            gossamer.broadcast(torch.zeros(3), root=0)
    return str(info.value)


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_peers_other_operation_is_described_by_what_its_aux_means(world_size):
    # Every rank names both calls in words, also the one it did not make itself.
    for message in run_distributed(_different_operations, world_size):
        assert "rank 0 called allreduce (op average) of float32[3]" in message
        assert "rank 1 called broadcast (root 0) of float32[3]" in message
        assert "aux" not in message


def _bad_arguments():
    x = torch.zeros(3)
    cases = [
        (TypeError, "tensor must be a torch.Tensor", lambda: gossamer.allreduce([1.0])),
        (
            TypeError,
            "int64 is not supported",
            lambda: gossamer.allreduce(torch.zeros(3, dtype=torch.int64), average=True),
        ),
        (TypeError, "average must be a bool", lambda: gossamer.allreduce(x, average=1)),
        (ValueError, "root must be a rank", lambda: gossamer.broadcast(x, root=5)),
        (TypeError, "root must be an int", lambda: gossamer.broadcast(x, root=0.0)),
        (ValueError, "at least one dimension", lambda: gossamer.allgather(torch.tensor(1.0))),
        (TypeError, "group must be", lambda: gossamer.allreduce(x, group="world")),
    ]
    for exc, words, call in cases:
        with pytest.raises(exc, match=words):
            call()
    return True


@pytest.mark.parametrize("world_size", [1, 2])
def test_bad_arguments_are_rejected(world_size):
    assert all(run_distributed(_bad_arguments, world_size))


def test_calls_before_init_raise():
    with pytest.raises(gossamer.NotInitializedError):
        gossamer.allreduce(torch.zeros(1))
    with pytest.raises(gossamer.NotInitializedError):
        gossamer.neighbor_allreduce(torch.zeros(1))
