"""Bagua's helpers that its examples and tests use: groups by name, membership, torch
groups patched with ``bagua_patch``, ``alltoall_v`` as Bagua's example calls it,
``utils`` and the differentiable ``data_parallel.functional.all_reduce``."""

import pytest
import torch
import torch.distributed as dist

import gossamer.bagua as bagua
from gossamer.bagua import communication as comm
from gossamer.bagua import utils
from gossamer.bagua.data_parallel import functional
from gossamer.testing import run_distributed


def test_the_default_group_needs_init():
    with pytest.raises(RuntimeError, match="init_process_group"):
        comm._get_default_group()


def _groups():
    bagua.init_process_group()
    r, n = bagua.get_rank(), bagua.get_world_size()
    out = {"default_ranks": comm._get_default_group().ranks}
    world = comm.get_communicator(comm._get_default_group().group_name, "global")
    out["world_is_default"] = world is comm._get_default_group().get_global_communicator()
    even = bagua.new_group([0, 2])
    by_name = comm.get_communicator(even.group_name, "global")
    out["even_by_name"] = by_name is even.get_global_communicator()
    out["not_in_even"] = comm._rank_not_in_group(even)
    out["not_in_none"] = comm._rank_not_in_group(None)
    out["not_in_world_comm"] = comm._rank_not_in_comm(world)
    nobody = bagua.new_group([])
    t = torch.full((2,), float(r))
    bagua.allreduce_inplace(t, comm=nobody.get_global_communicator())
    intra = nobody.get_intra_node_communicator()
    out["nobody"] = (comm._rank_not_in_group(nobody), t, intra is comm.CommMember.NON_COMM_MEMBER)

    pair = dist.new_group([0, 1])  # torch gives rank 2 and up NON_GROUP_MEMBER
    out["pair_outsider"] = comm._rank_not_in_group(bagua.from_torch_group(pair))
    if r < 2:
        out["patch_returns_group"] = pair.bagua_patch() is pair
        out["patched_once"] = pair.bagua_patch().bagua_pg is pair.bagua_pg
        t = torch.full((2,), float(r + 1))
        bagua.allreduce_inplace(t, comm=pair.bagua_get_global_communicator())
        out["pair_sum"] = t
    for call in (
        lambda: comm.get_communicator(even.group_name, "middle"),
        lambda: comm.get_communicator("no such group", "global"),
    ):
        with pytest.raises((KeyError, ValueError)) as info:
            call()
        out.setdefault("errors", []).append(str(info.value))
    with pytest.raises(RuntimeError, match="bagua_patch"):
        _ = dist.new_group(list(range(n))).bagua_pg
    return out


@pytest.mark.parametrize("n", [3, 4])
def test_groups_by_name_and_membership(n):
    got = run_distributed(_groups, n)
    for r, res in enumerate(got):
        assert res["default_ranks"] == list(range(n)) and res["world_is_default"]
        assert res["not_in_even"] == (r not in (0, 2))
        assert res["even_by_name"]
        assert not res["not_in_none"] and not res["not_in_world_comm"]
        outsider, t, intra = res["nobody"]
        assert outsider and intra
        torch.testing.assert_close(t, torch.full((2,), float(r)))  # untouched
        assert res["pair_outsider"] == (r >= 2)
        if r < 2:
            assert res["patch_returns_group"] and res["patched_once"]
            torch.testing.assert_close(res["pair_sum"], torch.full((2,), 3.0))
        assert (
            "comm_name must be one of ['global', 'inter', 'intra']; got 'middle'"
            in (res["errors"][0])
        )
        assert "no Bagua process group is named 'no such group'" in res["errors"][1]


def _alltoall_v_as_baguas_example():
    """Bagua's examples/communication_primitives: displacements with an end entry."""
    bagua.init_process_group()
    n = bagua.get_world_size()
    send = torch.arange(2.0 * n) + 100 * bagua.get_rank()
    reference = torch.zeros(2 * n)
    dist.all_to_all_single(reference, send, [2] * n, [2] * n)
    recv = torch.zeros(2 * n)
    displs = [2 * i for i in range(n + 1)]
    bagua.alltoall_v(send, [2] * n, displs, recv, [2] * n, displs)
    inplace = send.clone()
    bagua.alltoall_v_inplace(inplace, [2] * n, displs)
    with pytest.raises(ValueError, match=r"send_displs must have \d+ or \d+ entries"):
        bagua.alltoall_v(send, [2] * n, [0], recv, [2] * n, displs)
    return reference, recv, inplace


@pytest.mark.parametrize("n", [2, 3])
def test_alltoall_v_takes_an_end_displacement(n):
    for reference, recv, inplace in run_distributed(_alltoall_v_as_baguas_example, n):
        assert torch.equal(recv, reference) and torch.equal(inplace, reference)


def _functional():
    bagua.init_process_group()
    r = bagua.get_rank()
    x = torch.tensor([1.0, -2.0], requires_grad=True)
    y = functional.all_reduce(x * (r + 1))
    (y * (r + 10)).sum().backward()
    top = functional.all_reduce(torch.tensor([float(r)]), op=dist.ReduceOp.MAX)
    with pytest.raises(ValueError, match=r"op must be torch\.distributed\.ReduceOp\.SUM or MAX"):
        functional.all_reduce(x, op=dist.ReduceOp.PRODUCT)

    a, b = torch.full((2,), float(r)), torch.full((1, 3), 2.0 * r)
    utils.apply_flattened_call([a, b], dist.all_reduce)
    return y.detach(), x.grad, top, a, b


@pytest.mark.parametrize("n", [2, 3])
def test_functional_all_reduce_and_flattened_calls(n):
    scale = sum(range(1, n + 1))  # sum of (s + 1)
    weights = sum(range(10, 10 + n))  # sum of (s + 10)
    mean = sum(range(n)) / n
    for r, (y, grad, top, a, b) in enumerate(run_distributed(_functional, n)):
        torch.testing.assert_close(y, torch.tensor([1.0, -2.0]) * scale)
        # dL/dx_r = (r + 1) * sum_s (s + 10): the gradient is all-reduced on the way back
        torch.testing.assert_close(grad, torch.full((2,), float((r + 1) * weights)))
        assert top.item() == n - 1
        torch.testing.assert_close(a, torch.full((2,), mean))
        torch.testing.assert_close(b, torch.full((1, 3), 2.0 * mean))


def test_utils_flatten_in_one_process():
    a, b = torch.arange(3.0), torch.ones(2, 2)
    flat = utils.flatten([a, b])
    assert flat.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0]
    back = utils.unflatten(flat, [a, b])
    assert torch.equal(back[0], a) and torch.equal(back[1], b)
    assert utils.check_contiguous(list(flat.split([3, 4])))
    assert not utils.check_contiguous([a, b])
    got = utils.get_flattened_tensor([a, torch.ones(2, dtype=torch.float64)])
    assert got.dtype == torch.float32 and got.tolist() == [0.0, 1.0, 2.0, 1.0, 1.0]
    assert utils.get_flattened_tensor([]) is None
    assert utils.to_bagua_datatype(torch.float16) == "f16"
    with pytest.raises(ValueError, match=r"unsupported data type torch\.int8"):
        utils.to_bagua_datatype(torch.int8)

    calls = []
    ints, floats = torch.ones(2, dtype=torch.int64), torch.ones(3)
    utils.apply_flattened_call_all([floats, ints], lambda flat: calls.append(flat.dtype))
    assert calls == [torch.float32, torch.int64]
    utils.apply_flattened_call([floats], torch.Tensor.mul_, extra_args=[3.0])
    assert floats.tolist() == [3.0, 3.0, 3.0]


def _refusals():
    bagua.init_process_group()
    r = bagua.get_rank()
    out = {}
    for key, ranks in (("str", "01"), ("float", [0.7, 1.2]), ("twice", [0, 0])):
        with pytest.raises((TypeError, ValueError)) as info:
            bagua.new_group(ranks)
        out[key] = str(info.value)
    # one rank's bad ranks: the others raise at once, naming it
    with pytest.raises(Exception) as info:
        bagua.new_group([0, 5] if r == 2 else [0, 1])
    out["one_bad"] = (type(info.value).__name__, str(info.value))
    with pytest.raises(Exception) as info:  # the same length, other members
        bagua.new_group([0, 1] if r == 0 else [0, 2])
    out["differ"] = (type(info.value).__name__, str(info.value))
    # communicators of a group are made by its members alone: rank 0 asks for none
    pair = bagua.from_torch_group(dist.new_group([1, 2]))
    if r != 0:
        intra = pair.get_intra_node_communicator()
        t = torch.full((1,), float(r))
        bagua.allreduce_inplace(t, comm=intra)
        out["intra_sum"] = t.item()
    out["after"] = bagua.new_group([0, 1, 2]).ranks  # every rank still in step
    recv = torch.zeros(3)
    with pytest.raises(ValueError) as info:
        bagua.alltoall_v(torch.ones(3), [1, 1, 1], [0, 1, 2], recv, [1, 1, 1], [0, 1, 5])
    out["landing"] = str(info.value)
    with pytest.raises(TypeError) as info:
        functional.all_reduce(torch.ones(1), group="world")
    out["group_name"] = str(info.value)
    return out


def test_refused_arguments_name_themselves_and_keep_ranks_in_step():
    for r, res in enumerate(run_distributed(_refusals, 3)):
        assert "ranks must be a list of ints or None; got '01'" in res["str"]
        assert "ranks must be a list of ints or None; got [0.7, 1.2]" in res["float"]
        assert "ranks must not repeat a rank; got [0, 0]" in res["twice"]
        kind, text = res["one_bad"]
        if r == 2:
            assert kind == "ValueError" and "ranks must be in [0, 3); got [5]" in text
        else:
            assert kind == "PeerArgumentError" and "rank 2" in text
        kind, text = res["differ"]
        assert kind == "PeerError" and "ranks checksum" in text
        if r != 0:
            assert res["intra_sum"] == 3.0
        assert res["after"] == [0, 1, 2]
        assert "recv_displs[2] = 5 with recv_counts[2] = 1 falls outside" in res["landing"]
        assert res["group_name"].startswith("group must be a communicator")
