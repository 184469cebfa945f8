"""Bugs a fuzzer found: each case failed before its fix.

- flags (``async_op``, ``zero_init``, ``reset``, ``clone``, ``require_mutex``, ...) that are
  not bools were accepted silently;
- integer windows crashed in ``Window.update`` and in weighted puts;
- ``Window.update`` with no in-neighbours dropped the topology's self weight;
- dynamic neighbour calls ignored a wrong ``topology=``;
- an optimizer's error named ``threshold_bytes`` (not its ``fusion_threshold_bytes``);
- ``communication=""`` was taken for the default.
"""

import re

import numpy as np
import pytest
import torch

import gossamer
from gossamer import topology as topo
from gossamer.errors import TopologyError
from gossamer.optim import AdaptThenCombine, AdaptWithCombine, GradientAllreduce
from gossamer.testing import run_distributed

NOT_BOOLS = [1, 0, None, "yes", 1.0, np.bool_(True)]


def _flag_calls(value):
    """``{description: (call, argument name)}`` for every flag of every public call."""
    x = torch.ones(2)
    win = gossamer.Window.create(torch.ones(2), name="flags")
    calls = {
        "allreduce async_op": (lambda: gossamer.allreduce(x, async_op=value), "async_op"),
        "allreduce average": (lambda: gossamer.allreduce(x, average=value), "average"),
        "allreduce_ async_op": (lambda: gossamer.allreduce_(x, async_op=value), "async_op"),
        "broadcast async_op": (lambda: gossamer.broadcast(x, root=0, async_op=value), "async_op"),
        "allgather async_op": (lambda: gossamer.allgather(x, async_op=value), "async_op"),
        "alltoall async_op": (lambda: gossamer.alltoall(x, async_op=value), "async_op"),
        "barrier async_op": (lambda: gossamer.barrier(async_op=value), "async_op"),
        "reduce_scatter async_op": (
            lambda: gossamer.reduce_scatter(x, async_op=value),
            "async_op",
        ),
        "alltoall_v async_op": (
            lambda: gossamer.alltoall_v(x, send_counts=[2], async_op=value),
            "async_op",
        ),
        "reduce async_op": (lambda: gossamer.reduce(x, root=0, async_op=value), "async_op"),
        "gather async_op": (lambda: gossamer.gather(x, root=0, async_op=value), "async_op"),
        "scatter async_op": (lambda: gossamer.scatter(x, root=0, async_op=value), "async_op"),
        "neighbor_allreduce async_op": (
            lambda: gossamer.neighbor_allreduce(x, async_op=value),
            "async_op",
        ),
        "neighbor_allreduce check_topology": (
            lambda: gossamer.neighbor_allreduce(x, check_topology=value),
            "check_topology",
        ),
        "neighbor_allgather async_op": (
            lambda: gossamer.neighbor_allgather(x, async_op=value),
            "async_op",
        ),
        "neighbor_allgather check_topology": (
            lambda: gossamer.neighbor_allgather(x, check_topology=value),
            "check_topology",
        ),
        "Window.create zero_init": (
            lambda: gossamer.Window.create(torch.ones(2), zero_init=value),
            "zero_init",
        ),
        "Window.create push_sum": (
            lambda: gossamer.Window.create(torch.ones(2), push_sum=value),
            "push_sum",
        ),
        "put async_op": (lambda: win.put(async_op=value), "async_op"),
        "put require_mutex": (lambda: win.put(require_mutex=value), "require_mutex"),
        "accumulate async_op": (lambda: win.accumulate(async_op=value), "async_op"),
        "accumulate require_mutex": (
            lambda: win.accumulate(require_mutex=value),
            "require_mutex",
        ),
        "get async_op": (lambda: win.get(async_op=value), "async_op"),
        "get require_mutex": (lambda: win.get(require_mutex=value), "require_mutex"),
        "update reset": (lambda: win.update(reset=value), "reset"),
        "update clone": (lambda: win.update(clone=value), "clone"),
        "update require_mutex": (lambda: win.update(require_mutex=value), "require_mutex"),
        "update_then_collect require_mutex": (
            lambda: win.update_then_collect(require_mutex=value),
            "require_mutex",
        ),
    }
    return win, calls


def _flags_rejected():
    failures = []
    for value in NOT_BOOLS:
        win, calls = _flag_calls(value)
        for what, (fn, name) in calls.items():
            try:
                fn()
            except TypeError as err:
                if name not in str(err) or repr(value) not in str(err):
                    failures.append(f"{what}={value!r}: message {err}")
            else:
                failures.append(f"{what}={value!r} was accepted")
        win.free()
    # Nothing was left half done: the next calls work.
    assert torch.equal(gossamer.allreduce(torch.ones(2)), torch.ones(2))
    return failures


def test_non_bool_flags_are_type_errors():
    assert run_distributed(_flags_rejected, 1) == [[]]


def _int_windows(dtype):
    r, n = gossamer.rank(), gossamer.size()
    x = torch.tensor([10 * (r + 1), -7 * (r + 1), 3], dtype=dtype)
    with gossamer.Window.create(x.clone(), name="ints") as win:
        gossamer.barrier()
        win.put(dst_weights=dict.fromkeys(win.out_neighbors, 0.5), self_weight=0.25)
        gossamer.barrier()
        after_put = win.tensor.clone()
        bufs = win.buffers()
        uniform = win.update(clone=True)
        weighted = win.update(
            self_weight=0.5, src_weights=dict.fromkeys(win.in_neighbors, 0.25), clone=True
        )
        gossamer.barrier()
    return after_put, bufs, uniform, weighted, n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_integer_window_weighted_put_and_update(dtype):
    """Weights apply in float64, rounded to the nearest integer (halves to even)."""
    got = run_distributed(_int_windows, 2, args=(dtype,))

    def x(r):
        return np.array([10 * (r + 1), -7 * (r + 1), 3], dtype=np.float64)

    for r, (after_put, bufs, uniform, weighted, _) in enumerate(got):
        s = 1 - r
        mine = np.round(0.25 * x(r))
        assert after_put.dtype == dtype
        np.testing.assert_array_equal(after_put.numpy(), mine)
        np.testing.assert_array_equal(bufs[s].numpy(), np.round(0.5 * x(s)))
        # ring of 2: uniform weights 1/2
        np.testing.assert_array_equal(uniform.numpy(), np.round((mine + np.round(0.5 * x(s))) / 2))
        np.testing.assert_array_equal(
            weighted.numpy(), np.round(0.5 * mine + 0.25 * np.round(0.5 * x(s)))
        )


def _no_in_neighbours():
    r = gossamer.rank()
    # Column 0 has no edge into rank 0: it keeps half of its own value and nothing else.
    graph = topo.Topology([[0.5, 0.5], [0.0, 1.0]])
    x = torch.tensor([4.0, -2.0]) * (r + 1)
    with gossamer.Window.create(x.clone(), topology=graph) as win:
        gossamer.barrier()
        win.put()
        gossamer.barrier()
        out = win.update(clone=True)
        gossamer.barrier()
    return out


def test_update_without_in_neighbours_keeps_self_weight():
    got = run_distributed(_no_in_neighbours, 2)
    torch.testing.assert_close(got[0], 0.5 * torch.tensor([4.0, -2.0]))
    torch.testing.assert_close(
        got[1], 1.0 * torch.tensor([8.0, -4.0]) + 0.5 * torch.tensor([4.0, -2.0])
    )


def _dynamic_wrong_topology():
    x = torch.ones(2)
    errors = []
    for fn in (
        lambda t: gossamer.neighbor_allreduce(
            x, self_weight=1.0, src_weights={}, dst_weights=[], topology=t
        ),
        lambda t: gossamer.neighbor_allgather(x, src_ranks=[], dst_ranks=[], topology=t),
    ):
        for bad, kind in ((topo.ring(3), TopologyError), ("ring", TypeError)):
            try:
                fn(bad)
            except kind as err:
                errors.append("topology" in str(err))
            else:
                errors.append(False)
    return errors


def test_dynamic_neighbour_calls_check_topology():
    assert run_distributed(_dynamic_wrong_topology, 1) == [[True] * 4]


def _optimizer_arguments():
    model = torch.nn.Linear(2, 1)
    messages = []
    for cls in (AdaptWithCombine, AdaptThenCombine, GradientAllreduce):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for bad in (-1, 1.5, "8MB", True):
            try:
                cls(opt, model, fusion_threshold_bytes=bad)
            except ValueError as err:
                messages.append("fusion_threshold_bytes" in str(err) and repr(bad) in str(err))
            else:
                messages.append(False)
    for cls in (AdaptWithCombine, AdaptThenCombine):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            cls(opt, model, communication="")
        except ValueError as err:
            messages.append("communication" in str(err) and "''" in str(err))
        else:
            messages.append(False)
    return messages


def test_optimizer_arguments_are_named():
    (messages,) = run_distributed(_optimizer_arguments, 1)
    assert messages and all(messages), messages


def _audit_cases():
    """Found by the session-28 audit: what each mismatch says, complex product, graphs."""
    r = gossamer.rank()
    x = torch.ones(4)
    out = {}
    for name, call in {
        "allreduce": lambda: gossamer.allreduce(x, op="sum" if r == 0 else "max"),
        "reduce": lambda: gossamer.reduce(x, root=min(r, 1)),
        "gather": lambda: gossamer.gather(x, root=min(r, 1)),
        "kinds": lambda: (
            gossamer.allreduce(x) if r == 0 else gossamer.broadcast(x, root=gossamer.size() - 1)
        ),
        "reduce_scatter": lambda: gossamer.reduce_scatter(
            torch.ones(gossamer.size()), op="sum" if r == 0 else "product"
        ),
    }.items():
        with pytest.raises(gossamer.PeerError) as err:
            call()
        out[name] = str(err.value)
    z = torch.ones(2, dtype=torch.complex64)
    for call in (
        lambda: gossamer.allreduce(z, op="product"),
        lambda: gossamer.reduce(z, root=0, op="product"),
    ):
        with pytest.raises(TypeError, match="op 'product' is not supported for complex"):
            call()
    # Communication is not differentiable: no result carries a graph back to the input.
    leaf = torch.full((2,), float(r), requires_grad=True)
    results = [
        gossamer.allreduce(leaf),
        gossamer.broadcast(leaf, root=0),
        gossamer.neighbor_allreduce(leaf),
        gossamer.allreduce(leaf, async_op=True).wait(),
    ]
    out["graphs"] = [t.requires_grad or t.grad_fn is not None for t in results]
    same = gossamer.allreduce_(leaf * 1)  # a non-leaf, reduced in place: returned itself
    out["in_place"] = same.grad_fn is not None and torch.equal(same.detach(), results[0])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_mismatches_name_what_differs_and_results_carry_no_graph(world_size):
    for r, out in enumerate(run_distributed(_audit_cases, world_size)):
        called = "rank 0 called {0}, but rank 1 called {1}"
        assert (
            called.format("allreduce (op sum) of float32[4]", "allreduce (op max)")
            in (out["allreduce"])
        )
        assert (
            called.format("reduce (root 0, op sum) of float32[4]", "reduce (root 1, op sum)")
            in (out["reduce"])
        )
        assert "gather (root 0)" in out["gather"] and "gather (root 1)" in out["gather"]
        assert "(op product)" in out["reduce_scatter"]
        # each header explained by its own operation, whichever rank reads it
        kinds = out["kinds"]
        assert "allreduce" in kinds and "broadcast" in kinds
        assert "allreduce (root" not in kinds and "broadcast (op" not in kinds, kinds
        assert out["graphs"] == [False] * 4, r
        assert out["in_place"]


# Session 29's wrong-argument audit: each case failed before its fix.
def _schedule_misuse():
    model = torch.nn.Linear(2, 1)
    errors = {}
    for name, schedule in {
        "ran out": iter([topo.Step((), (), 1.0, {}, {})] * 2),
        "not steps": iter([3, 4]),
    }.items():
        opt = AdaptThenCombine(
            torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=schedule
        )
        try:
            for _ in range(3):
                opt.zero_grad()
                model(torch.ones(1, 2)).sum().backward()
                opt.step()
        except Exception as err:
            errors[name] = f"{type(err).__name__}: {err}"
        opt.close()
    return errors


def test_a_schedule_that_runs_out_or_is_not_of_steps_is_named():
    """A bare StopIteration ended a caller's loop (``map``, a generator) silently."""
    errors = run_distributed(_schedule_misuse, 1)[0]
    assert errors["ran out"] == (
        "ValueError: schedule ran out after 2 steps; pass an endless one (e.g. "
        "itertools.cycle, or a generator of gossamer.topology)"
    )
    assert errors["not steps"].startswith("TypeError: schedule must yield gossamer.topology.Step")
    assert "is 3" in errors["not steps"]


def _bad_root():
    from gossamer.optim import broadcast_optimizer_state

    sgd = torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1)
    errors = []
    for root in (True, 5, None, np.float32(0.5)):
        try:
            broadcast_optimizer_state(sgd, root_rank=root)
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    return errors


def test_broadcast_optimizer_state_checks_its_root():
    errors = run_distributed(_bad_root, 2)[0]
    assert errors == [
        "TypeError: root_rank must be an int rank; got True",
        "ValueError: root_rank must be a rank in [0, 2); got 5",
        "TypeError: root_rank must be an int rank; got None",
        "TypeError: root_rank must be an int rank; got np.float32(0.5)",
    ]


def test_pure_calls_refuse_what_they_used_to_take():
    from gossamer.communicators import NonlinearGossip
    from gossamer.compression import qat_qconfig

    step = topo.Step((1,), (1,), 0.5, {1: 0.5}, {1: 1.0})
    for dead, kind in [("1", TypeError), (1, TypeError), ([True], TypeError), ((1.0,), TypeError)]:
        with pytest.raises(kind, match="dead"):
            topo.drop_dead(step, dead)
    with pytest.raises(ValueError, match=r"dead entries must be >= 0; got -1"):
        topo.drop_dead(step, [-1])
    assert topo.drop_dead(step, [9]) == step  # a rank the step does not name
    for value in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="step_size must be a number"):
            NonlinearGossip(step_size=value)
    for flag in ("False", None, 0.0):
        with pytest.raises(TypeError, match="per_channel must be a bool"):
            qat_qconfig(per_channel=flag)
    from gossamer.models import MLP, SmallCNN, SmallResNet

    for build, named in [
        (lambda: MLP(3, 4, 2, depth=-3), "depth must be an int >= 0; got -3"),
        (lambda: MLP(True, 4, 2), "inputs must be an int >= 1; got True"),
        (lambda: MLP(3, 4.0, 2), "hidden must be an int >= 1; got 4.0"),
        (lambda: SmallCNN(channels=-1), "channels must be an int >= 1; got -1"),
        (lambda: SmallResNet(blocks=0), "blocks must be an int >= 1; got 0"),
    ]:
        with pytest.raises(ValueError, match=re.escape(named)):
            build()
    assert len(MLP(3, 4, 2, depth=0)) == 2  # Flatten and one Linear: depth 0 is allowed


def _window_misuse():
    win = gossamer.Window.create(torch.ones(2), name="misuse")
    errors = []
    calls = [
        lambda: win.mutex(3),
        lambda: win.mutex("1"),
        lambda: win.mutex([1 - gossamer.rank()] * 2),  # waited for itself for ever
        lambda: win.load_compression_state(None),
        lambda: win.load_compression_state({"bogus": {}}),
    ]
    for call in calls:
        try:
            with call():
                pass
        except (TypeError, ValueError) as err:
            errors.append(f"{type(err).__name__}: {err}")
    win.load_compression_state({"steps": {}})  # what compression_state() writes still loads
    win.free()
    return errors


def test_window_mutex_and_compression_state_refuse_what_would_hang_or_be_ignored():
    errors = run_distributed(_window_misuse, 2, timeout=60)[1]
    assert errors == [
        "TypeError: Window.mutex: ranks must be a list of ranks; got 3",
        "TypeError: Window.mutex: ranks must be a list of ranks; got '1'",
        "ValueError: Window.mutex: ranks must not repeat a rank; got [0, 0]",
        "TypeError: saved must be a compression_state() mapping; got None",
        "ValueError: saved has keys compression_state() does not write: ['bogus']",
    ]
