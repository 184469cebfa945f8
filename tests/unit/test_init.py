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
    with pytest.raises(NotInitializedError, match=r"call gossamer.init\(\) first"):
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
