"""Staging through host memory, checked on CPU: every GPU test's rank code, forced staged.

Without a GPU, :mod:`gossamer.transport.staging` never engages. Here every tensor that is
not a staging copy is treated as a device tensor, so each public operation, exchange and
reduction stages it (host copy in, result out, in-place results copied back, async
handles mapped), and the rank functions of ``test_gpu_gloo`` run with ``cuda:0`` replaced
by the CPU. This checks the staging path and the GPU tests' own code on every CI run; the
GPU run (``pytest -m gpu``) checks the device copies.
"""

from __future__ import annotations

import pytest
import test_gpu_gloo as gpu  # tests/distributed is on sys.path under pytest
import torch

import gossamer.transport as transport
from gossamer.testing import run_distributed
from gossamer.transport import staging


def _forced(name: str, *args):
    """Run ``gpu.<name>(*args)`` with every non-staging tensor staged; also count copies."""
    copies = [0]
    to_host = staging.to_host

    def forced_to_host(tensor):
        copies[0] += 1
        host = to_host(tensor)
        host.staging_copy = True  # not staged again
        return host

    def forced_needs(tensor, group=None, *, over_gloo=False):
        return isinstance(tensor, torch.Tensor) and not getattr(tensor, "staging_copy", False)

    saved_gpu = gpu.GPU
    patched = [(staging, "needs_staging", forced_needs), (staging, "to_host", forced_to_host)]
    patched += [(transport, "needs_staging", forced_needs), (transport, "to_host", forced_to_host)]
    originals = [(mod, attr, getattr(mod, attr)) for mod, attr, _ in patched]
    for mod, attr, value in patched:
        setattr(mod, attr, value)
    gpu.GPU = torch.device("cpu")
    try:
        return getattr(gpu, name)(*args), copies[0]
    finally:
        gpu.GPU = saved_gpu
        for mod, attr, value in originals:
            setattr(mod, attr, value)


@pytest.mark.parametrize(
    ("name", "args"),
    [
        ("_collectives", ()),
        ("_in_place_and_p2p", ()),
        ("_windows_both", ()),
        ("_compressed_both", ("topk:0.1",)),
        ("_compressed_both", ("randomk:0.1",)),
        ("_train_both", ("atc",)),
        ("_train_both", ("awc_choco",)),
    ],
)
def test_gpu_rank_code_runs_staged_on_cpu(name, args):
    results = run_distributed(_forced, 2, args=(name, *args), timeout=120)
    for _, copies in results:
        assert copies > 0 or name == "_windows_both"  # windows keep host buffers themselves


def test_staged_in_place_and_async_results_reach_the_callers_tensor():
    results = run_distributed(_forced, 2, args=("_in_place_and_p2p",), timeout=60)
    for (averaged, broadcast, _), copies in results:
        assert torch.allclose(averaged, (gpu._x(0) + gpu._x(1)) / 2)
        assert torch.equal(broadcast, gpu._x(0))
        assert copies >= 3  # allreduce_, broadcast_, send or recv
    assert torch.equal(results[1][0][2], gpu._x(0))
