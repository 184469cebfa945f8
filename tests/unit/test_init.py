import subprocess
import sys

import pytest

import gossamer
from gossamer import context
from gossamer.errors import NotInitializedError


@pytest.mark.parametrize(
    "fn",
    [
        gossamer.rank,
        gossamer.size,
        gossamer.local_rank,
        gossamer.local_size,
        gossamer.machine_rank,
        gossamer.machine_size,
        gossamer.is_homogeneous,
    ],
)
def test_calls_before_init_raise_a_clear_error(fn):
    assert not gossamer.is_initialized()
    with pytest.raises(
        NotInitializedError, match=r"call gossamer.init\(\) first .*init_process_group"
    ):
        fn()


def test_without_a_launcher_the_world_has_size_one():
    code = (
        "import gossamer; gossamer.init(); gossamer.init(); "
        "print(gossamer.rank(), gossamer.size(), gossamer.local_size(), "
        "gossamer.machine_size(), gossamer.is_homogeneous()); gossamer.shutdown(); "
        "gossamer.shutdown(); print(gossamer.is_initialized())"
    )
    env = {"PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    ).stdout.split()
    assert out == ["0", "1", "1", "1", "True", "False"]


@pytest.mark.parametrize(
    ("kwargs", "exc", "word"),
    [
        ({"backend": "mpi"}, ValueError, "backend"),
        ({"backend": 3}, TypeError, "backend"),
        ({"timeout": 0}, ValueError, "timeout"),
        ({"timeout": -1.0}, ValueError, "timeout"),
        ({"timeout": True}, ValueError, "timeout"),
    ],
)
def test_init_rejects_bad_arguments(kwargs, exc, word):
    with pytest.raises(exc, match=word):
        gossamer.init(**kwargs)
    assert not gossamer.is_initialized()


def test_nccl_without_cuda_is_refused():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ValueError, match="nccl"):
        context._resolve_backend("nccl")
    assert context._resolve_backend("auto") == "gloo"


@pytest.mark.parametrize(
    ("machine_of", "devices", "shared"),
    [
        # 2 ranks, 1 visible GPU: both on cuda:0.
        ((0, 0), ["cuda:0 (GPU-a)", "cuda:0 (GPU-a)"], "ranks [0, 1] of machine 0 would share"),
        # 4 ranks, 2 GPUs (local_rank % 2): ranks 0 and 2 share cuda:0.
        ((0, 0, 0, 0), ["cuda:0", "cuda:1", "cuda:0", "cuda:1"], "ranks [0, 2] of machine 0"),
        # 2 machines, the second has one GPU for its two ranks.
        ((0, 0, 1, 1), ["cuda:0", "cuda:1", "cuda:0", "cuda:0"], "ranks [2, 3] of machine 1"),
        # One GPU per rank: fine.
        ((0, 0), ["cuda:0", "cuda:1"], None),
        # The same index on two machines is two GPUs.
        ((0, 1), ["cuda:0", "cuda:0"], None),
        # CUDA_VISIBLE_DEVICES per rank: both see "cuda:0", but different GPUs.
        ((0, 0), ["cuda:0 (GPU-a)", "cuda:0 (GPU-b)"], None),
    ],
)
def test_nccl_refuses_ranks_sharing_a_gpu(machine_of, devices, shared):
    error = context.shared_device_error(machine_of, devices)
    if shared is None:
        assert error is None
    else:
        assert shared in error
        assert devices[int(shared.split("[")[1].split(",")[0])] in error  # names the device
        assert "backend='gloo'" in error  # says what to do
