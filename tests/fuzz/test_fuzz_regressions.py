"""The fuzzers' findings in the operations, windows and optimizers, one example each.

Each function runs on the ranks of ``run_distributed`` and returns nothing; a failing check
raises there. The examples are the ones the fuzzers shrank to (``test_fuzz_*.py``).
"""

import pytest
import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer import topology as T
from gossamer.errors import TopologyError
from gossamer.testing import run_distributed
from gossamer.topology import Topology


def _raises(exc, words, fn, *args, **kwargs):
    with pytest.raises(exc) as info:
        fn(*args, **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


# ---------------------------------------------------------------------- world of one
def allreduce_blames_a_bad_average_not_the_tensor():
    # It said "tensor dtype torch.int64 is not supported": average picked the dtypes first.
    _raises(
        TypeError, ["average"], gossamer.allreduce, torch.ones(2, dtype=torch.int64), average="yes"
    )


def async_op_must_be_a_bool():
    # A truthy "no" returned a Handle instead of the tensor.
    _raises(TypeError, ["async_op"], gossamer.allreduce, torch.ones(2), async_op="no")
    _raises(TypeError, ["async_op"], gossamer.neighbor_allreduce, torch.ones(2), async_op=1)
    with gossamer.Window.create(torch.ones(2)) as window:
        _raises(TypeError, ["async_op"], window.put, async_op=None)
        _raises(TypeError, ["require_mutex"], window.get, require_mutex=0)
        _raises(TypeError, ["clone"], window.update, clone=1)


def dynamic_neighbour_ops_check_the_topology_they_do_not_use():
    # Dynamic mode ignored topology=, so a wrong one passed unnoticed.
    ring2 = T.ring(2)
    _raises(
        TopologyError, ["topology"], gossamer.neighbor_allreduce, torch.ones(2),
        self_weight=1.0, src_weights={}, dst_weights={}, topology=ring2,
    )  # fmt: skip
    _raises(
        TypeError, ["topology"], gossamer.neighbor_allgather, torch.ones(2),
        src_ranks=[], dst_ranks=[], topology="ring",
    )  # fmt: skip
    _raises(
        TypeError, ["check_topology"], gossamer.neighbor_allgather, torch.ones(2), check_topology=1
    )


def window_flags_must_be_bools():
    _raises(TypeError, ["zero_init"], gossamer.Window.create, torch.ones(1), zero_init=None)
    _raises(TypeError, ["push_sum"], gossamer.Window.create, torch.ones(1), push_sum=1)
    assert gossamer.live_windows() == []


def integer_windows_update_and_scale():
    x = torch.tensor([44, -7], dtype=torch.int32)
    with gossamer.Window.create(x) as window:
        # The uniform update divided an int tensor in place: RuntimeError.
        assert torch.equal(window.update(), torch.tensor([44, -7], dtype=torch.int32))
        # put's self_weight multiplied an int tensor by a float in place: RuntimeError.
        window.put(self_weight=0.5)
        assert torch.equal(x, torch.tensor([22, -4], dtype=torch.int32))  # -3.5: half to even


def window_update_keeps_a_self_weight_without_in_neighbours():
    # With no in-neighbours the update took the uniform path and returned x, not 0.5 x.
    x = torch.ones(3)
    with gossamer.Window.create(x, topology=Topology([[0.5]])) as window:
        assert torch.equal(window.update(), torch.full((3,), 0.5))


def optimizer_arguments_are_checked_at_construction():
    model = nn.Linear(2, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    # The message said "threshold_bytes", which the caller never wrote.
    _raises(
        ValueError, ["fusion_threshold_bytes"], optim.AdaptThenCombine, sgd, model,
        fusion_threshold_bytes="1",
    )  # fmt: skip
    # "" fell back to the default communication.
    _raises(ValueError, ["communication"], optim.AdaptWithCombine, sgd, model, communication="")
    # A topology of another size raised only at the first communication (never in a world
    # of one).
    _raises(TopologyError, ["topology"], optim.AdaptThenCombine, sgd, model, topology=T.ring(2))


@pytest.mark.parametrize(
    "check",
    [
        allreduce_blames_a_bad_average_not_the_tensor,
        async_op_must_be_a_bool,
        dynamic_neighbour_ops_check_the_topology_they_do_not_use,
        window_flags_must_be_bools,
        integer_windows_update_and_scale,
        window_update_keeps_a_self_weight_without_in_neighbours,
        optimizer_arguments_are_checked_at_construction,
    ],
    ids=lambda fn: fn.__name__,
)
def test_world_of_one(check):
    run_distributed(check, 1)
