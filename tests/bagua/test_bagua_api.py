"""The facade's names and signatures are Bagua's (BaguaSys/bagua at 3e480d29)."""

import inspect
import re

import pytest
import torch

import gossamer.bagua as bagua
from gossamer.bagua import communication, env
from gossamer.bagua.algorithms import (
    Algorithm,
    AlgorithmImpl,
    GlobalAlgorithmRegistry,
    async_model_average,
    bytegrad,
    decentralized,
    gradient_allreduce,
    q_adam,
)
from gossamer.bagua.bucket import BaguaBucket
from gossamer.bagua.data_parallel import DistributedDataParallel
from gossamer.bagua.distributed import BaguaModule
from gossamer.bagua.tensor import BaguaTensor

R = inspect.Parameter.empty  # a required parameter
SUM = bagua.ReduceOp.SUM
GA = gradient_allreduce.GradientAllReduceAlgorithm

# name -> Bagua's parameters (name, default), read from Bagua's source
BAGUA = {
    "init_process_group": [
        ("store", None),
        ("rank", -1),
        ("world_size", -1),
        ("local_world_size", -1),
    ],
    "is_initialized": [],
    "new_group": [("ranks", None), ("stream", None)],
    "from_torch_group": [("group", R), ("stream", None)],
    "get_communicator": [("group_name", R), ("comm_name", R)],
    "send": [("tensor", R), ("dst", R), ("comm", None)],
    "recv": [("tensor", R), ("src", R), ("comm", None)],
    "broadcast": [("tensor", R), ("src", 0), ("comm", None)],
    "broadcast_object": [("obj", R), ("src", 0), ("comm", None)],
    "broadcast_coalesced": [("tensors", R), ("src", 0), ("comm", None)],
    "reduce": [("send_tensor", R), ("recv_tensor", R), ("dst", R), ("op", SUM), ("comm", None)],
    "reduce_inplace": [("tensor", R), ("dst", R), ("op", SUM), ("comm", None)],
    "allreduce": [("send_tensor", R), ("recv_tensor", R), ("op", SUM), ("comm", None)],
    "allreduce_inplace": [("tensor", R), ("op", SUM), ("comm", None)],
    "allreduce_coalesced_inplace": [("tensors", R), ("op", SUM), ("comm", None)],
    "allgather": [("send_tensor", R), ("recv_tensor", R), ("comm", None)],
    "allgather_inplace": [("tensor", R), ("comm", None)],
    "gather": [("send_tensor", R), ("recv_tensor", R), ("dst", R), ("comm", None)],
    "gather_inplace": [("tensor", R), ("count", R), ("dst", R), ("comm", None)],
    "scatter": [("send_tensor", R), ("recv_tensor", R), ("src", R), ("comm", None)],
    "scatter_inplace": [("tensor", R), ("count", R), ("src", R), ("comm", None)],
    "reduce_scatter": [("send_tensor", R), ("recv_tensor", R), ("op", SUM), ("comm", None)],
    "reduce_scatter_inplace": [("tensor", R), ("op", SUM), ("comm", None)],
    "alltoall": [("send_tensor", R), ("recv_tensor", R), ("comm", None)],
    "alltoall_inplace": [("tensor", R), ("comm", None)],
    "alltoall_v": [
        ("send_tensor", R),
        ("send_counts", R),
        ("send_displs", R),
        ("recv_tensor", R),
        ("recv_counts", R),
        ("recv_displs", R),
        ("comm", None),
    ],
    "alltoall_v_inplace": [("tensor", R), ("counts", R), ("displs", R), ("comm", None)],
    "get_backend": [("model_name", R)],
    "barrier": [("comm", None)],
    "BaguaProcessGroup": [("ranks", R), ("stream", R), ("group_name", R)],
}
ENV = ["get_rank", "get_world_size", "get_local_rank", "get_local_size"]
# bagua.torch_api's top-level names (contrib, checkpoint and moe are not ported)
TOP = [
    "get_backend", "init_process_group", "send", "recv", "allgather", "allgather_inplace",
    "allreduce", "allreduce_inplace", "alltoall", "alltoall_inplace", "alltoall_v",
    "alltoall_v_inplace", "barrier", "broadcast", "gather", "gather_inplace", "reduce",
    "reduce_inplace", "reduce_scatter", "reduce_scatter_inplace", "scatter", "scatter_inplace",
    "ReduceOp", "BaguaModule", "BaguaTensor", *ENV, "communication", "algorithms",
    "data_parallel",
]  # fmt: skip
DDP = [
    ("module", R), ("device_ids", None), ("output_device", None), ("dim", 0),
    ("broadcast_buffers", True), ("process_group", None), ("bucket_cap_mb", 25),
    ("find_unused_parameters", False), ("check_reduction", False),
    ("gradient_as_bucket_view", True), ("optimizers", []), ("algorithm", GA()),
]  # fmt: skip
CLASSES = [
    (GA, [("hierarchical", False), ("average", True)]),
    (bytegrad.ByteGradAlgorithm, [("hierarchical", True), ("average", True)]),
    (
        decentralized.DecentralizedAlgorithm,
        [("hierarchical", True), ("peer_selection_mode", "all"), ("communication_interval", 1)],
    ),
    (
        decentralized.LowPrecisionDecentralizedAlgorithm,
        [("hierarchical", True), ("communication_interval", 1)],
    ),
    (q_adam.QAdamAlgorithm, [("q_adam_optimizer", R), ("hierarchical", True)]),
    (
        q_adam.QAdamOptimizer,
        [
            ("params", R),
            ("lr", 0.001),
            ("warmup_steps", 100),
            ("betas", (0.9, 0.999)),
            ("eps", 1e-08),
            ("weight_decay", 0.0),
        ],
    ),
    (
        async_model_average.AsyncModelAverageAlgorithm,
        [("peer_selection_mode", "all"), ("sync_interval_ms", 500), ("warmup_steps", 0)],
    ),
    (BaguaBucket, [("tensors", R), ("name", R), ("flatten", R), ("alignment", 1)]),
]
METHODS = [
    (
        BaguaModule.with_bagua,
        [("optimizers", R), ("algorithm", R), ("process_group", None), ("do_flatten", True)],
    ),
    (AlgorithmImpl.tensors_to_buckets, [("tensors", R), ("do_flatten", R)]),
    (AlgorithmImpl.init_operations, [("bagua_ddp", R), ("bucket", R)]),
    (async_model_average.AsyncModelAverageAlgorithmImpl.abort, [("bagua_ddp", R)]),
    (async_model_average.AsyncModelAverageAlgorithmImpl.resume, [("bagua_ddp", R)]),
    (BaguaBucket.append_python_op, [("python_function", R), ("group", None)]),
    (
        BaguaBucket.append_centralized_synchronous_op,
        [
            ("hierarchical", False),
            ("average", True),
            ("scattergather", False),
            ("compression", None),
            ("group", None),
        ],
    ),
    (
        BaguaBucket.append_decentralized_synchronous_op,
        [
            ("peer_weight", R),
            ("hierarchical", True),
            ("peer_selection_mode", "all"),
            ("group", None),
        ],
    ),
    (
        BaguaBucket.append_low_precision_decentralized_synchronous_op,
        [
            ("weight", R),
            ("left_peer_weight", R),
            ("right_peer_weight", R),
            ("hierarchical", True),
            ("compression", "MinMaxUInt8"),
            ("group", None),
        ],
    ),
    (
        BaguaBucket.append_asynchronous_model_average_op,
        [("peer_selection_mode", R), ("group", None)],
    ),
    (
        BaguaTensor.ensure_bagua_tensor,
        [("name", None), ("module_name", None), ("getter_closure", None), ("setter_closure", None)],
    ),
    (BaguaTensor.bagua_set_storage, [("storage", R), ("storage_offset", 0)]),
    (
        type(GlobalAlgorithmRegistry).register,
        [("name", R), ("algorithm", R), ("description", None)],
    ),
]
HOOKS = [
    "need_reset", "init_tensors", "tensors_to_buckets", "init_forward_pre_hook",
    "init_backward_hook", "init_post_backward_hook", "init_post_optimizer_step_hook",
    "init_operations",
]  # fmt: skip
TENSOR_METHODS = [
    "is_bagua_tensor", "ensure_bagua_tensor", "to_bagua_tensor", "bagua_getter_closure",
    "bagua_setter_closure", "bagua_backend_tensor", "bagua_ensure_grad",
    "bagua_mark_communication_ready", "bagua_mark_communication_ready_without_synchronization",
    "bagua_set_storage",
]  # fmt: skip


def _same_default(ours, theirs):
    if isinstance(theirs, Algorithm):
        return type(ours) is type(theirs)
    return ours == theirs and type(ours) is type(theirs)


def _check(fn, expected, skip_self=False):
    params = list(inspect.signature(fn).parameters.values())
    if skip_self:
        params = params[1:]
    names = [p.name for p in params[: len(expected)]]
    assert names == [n for n, _ in expected], f"{fn}: {names}"
    for p, (name, default) in zip(params, expected, strict=False):
        assert p.kind in (p.POSITIONAL_OR_KEYWORD, p.POSITIONAL_ONLY), (fn, name)
        assert _same_default(p.default, default), f"{fn}: {name}={p.default!r}, Bagua {default!r}"
    for extra in params[len(expected) :]:  # beyond Bagua: keyword-only with defaults
        assert extra.kind is extra.KEYWORD_ONLY and extra.default is not R, (fn, extra)


@pytest.mark.parametrize("name", sorted(BAGUA))
def test_communication_signatures_are_baguas(name):
    fn = getattr(communication, name)
    _check(fn.__init__ if inspect.isclass(fn) else fn, BAGUA[name], skip_self=inspect.isclass(fn))


def test_top_level_names():
    for name in TOP:
        assert hasattr(bagua, name), name
    for name in BAGUA:
        assert hasattr(communication, name), name
    for name in ENV:
        _check(getattr(env, name), [])
    assert {op.name: int(op) for op in bagua.ReduceOp} == {
        "SUM": 0, "PRODUCT": 1, "MIN": 2, "MAX": 3, "BOR": 7, "BAND": 8, "BXOR": 9, "AVG": 10
    }  # fmt: skip


@pytest.mark.parametrize(("cls", "expected"), CLASSES, ids=[c.__name__ for c, _ in CLASSES])
def test_algorithm_signatures_are_baguas(cls, expected):
    _check(cls.__init__, expected, skip_self=True)


@pytest.mark.parametrize(("fn", "expected"), METHODS, ids=[m.__qualname__ for m, _ in METHODS])
def test_method_signatures_are_baguas(fn, expected):
    _check(fn, expected, skip_self=True)


def test_ddp_wrapper_signature_is_baguas():
    _check(DistributedDataParallel, DDP)


def test_import_patches_module_and_tensor_and_registers_the_algorithms():
    for name in ("with_bagua", "bagua_algorithm", "bagua_optimizers", "bagua_buckets"):
        assert hasattr(torch.nn.Module, name)
    for name in TENSOR_METHODS:
        assert callable(getattr(torch.Tensor, name)), name
    for name in HOOKS:
        assert callable(getattr(AlgorithmImpl, name)), name
    assert GlobalAlgorithmRegistry.available_algorithms() == [
        "gradient_allreduce", "bytegrad", "decentralized", "low_precision_decentralized",
        "qadam", "async",
    ]  # fmt: skip
    assert GlobalAlgorithmRegistry.get("qadam") is q_adam.QAdamAlgorithm
    with pytest.raises(KeyError, match="Available names: async, bytegrad"):
        GlobalAlgorithmRegistry.get("nope")
    with pytest.raises(ValueError, match="already present"):
        GlobalAlgorithmRegistry.register("bytegrad", bytegrad.ByteGradAlgorithm)
    # an unwrapped module has no bagua_algorithm (AttributeError keeps hasattr working)
    assert not hasattr(torch.nn.Linear(1, 1), "bagua_algorithm")


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="peer_selection_mode"):
        decentralized.DecentralizedAlgorithm(peer_selection_mode="ring")
    with pytest.raises(ValueError, match="communication_interval"):
        decentralized.DecentralizedAlgorithm(communication_interval=0)
    with pytest.raises(ValueError, match=r"compression='topk:2': ratio must be in \(0, 1\]"):
        decentralized.LowPrecisionDecentralizedAlgorithm(compression="topk:2")
    with pytest.raises(TypeError, match="hierarchical"):
        GA(hierarchical="yes")
    with pytest.raises(ValueError, match="sync_interval_ms"):
        async_model_average.AsyncModelAverageAlgorithm(sync_interval_ms=-1)
    with pytest.raises(ValueError, match="warmup_steps"):
        q_adam.QAdamOptimizer(torch.nn.Linear(1, 1).parameters(), warmup_steps=0)
    for kwargs, error, words in (
        ({"warmup_steps": 2.5}, TypeError, "warmup_steps must be an int; got 2.5"),
        ({"lr": "x"}, TypeError, "lr must be a number; got 'x'"),
        ({"betas": 0.9}, TypeError, "betas must be a pair of numbers; got 0.9"),
        ({"weight_decay": -1}, ValueError, "Invalid weight_decay value: -1"),
    ):
        with pytest.raises(error, match=re.escape(words)):
            q_adam.QAdamOptimizer(torch.nn.Linear(1, 1).parameters(), **kwargs)
    with pytest.raises(TypeError, match="QAdamOptimizer"):
        q_adam.QAdamAlgorithm(torch.optim.Adam(torch.nn.Linear(1, 1).parameters()))
    with pytest.raises(ValueError, match="setter_closure"):
        torch.zeros(1).ensure_bagua_tensor("t", setter_closure=lambda p, t: None)
