"""CUDA tensors over gloo: every path staged through host memory (``-m gpu``; needs CUDA).

Two gloo ranks share one GPU (``cuda:0``). Each test runs an operation on CUDA tensors and
the same operation on the same values in host memory, on the same ranks, and checks that
the results agree bit for bit (float64, so no reduction order can differ) and come back
on the caller's device. The CPU operations themselves are checked against references in
the other distributed tests. Run with ``PYTHONPATH=src pytest -m gpu``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gossamer
from gossamer import communicators, optim
from gossamer.testing import run_distributed
from gossamer.windows import Window

pytestmark = pytest.mark.gpu

GPU = torch.device("cuda", 0)


def _x(rank: int, shape=(5, 3)) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 + rank)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _on_both(fn):
    """``fn(x)`` on a CUDA copy and on the host tensor ``x``: (cuda result, host result)."""
    x = _x(gossamer.rank())
    on_gpu = fn(x.to(GPU))
    on_host = fn(x)
    return on_gpu, on_host


def _same(on_gpu, on_host, name: str) -> None:
    assert on_gpu.device == GPU, (name, on_gpu.device)
    assert torch.equal(on_gpu.cpu(), on_host), (name, on_gpu, on_host)


def _collectives():
    me = gossamer.rank()
    checks = {
        "allreduce": lambda x: gossamer.allreduce(x),
        "allreduce_sum": lambda x: gossamer.allreduce(x, average=False),
        "allreduce_async": lambda x: gossamer.allreduce(x, async_op=True).wait(),
        "broadcast": lambda x: gossamer.broadcast(x, root=1),
        # allgather with a first dim that differs between the ranks.
        "allgather": lambda x: gossamer.allgather(x[: me + 2]),
        "alltoall": lambda x: gossamer.alltoall(x[:4]),
        "neighbor_allreduce": lambda x: gossamer.neighbor_allreduce(x),
        "neighbor_allreduce_weights": lambda x: gossamer.neighbor_allreduce(
            x, self_weight=0.25, src_weights={1 - me: 0.75}, dst_weights=[1 - me]
        ),
        "neighbor_allreduce_async": lambda x: gossamer.neighbor_allreduce(x, async_op=True).wait(),
        "neighbor_allgather": lambda x: gossamer.neighbor_allgather(x),
        "pair_gossip": lambda x: gossamer.pair_gossip(x, 1 - me),
        "reduce_scatter": lambda x: gossamer.reduce_scatter(x[:4]),
        "alltoall_v": lambda x: gossamer.alltoall_v(x, send_counts=[2, 3]),
        "scatter": lambda x: gossamer.scatter(x[:4], root=0),
        "local_allreduce": lambda x: gossamer.local_allreduce(x),
    }
    out = {}
    for name, fn in checks.items():
        out[name] = _on_both(fn)
    # Rooted results exist on the root only.
    on_gpu, on_host = _on_both(lambda x: gossamer.reduce(x, root=1))
    out["reduce"] = (on_gpu, on_host) if me == 1 else None
    on_gpu, on_host = _on_both(lambda x: gossamer.gather(x, root=0))
    out["gather"] = (on_gpu, on_host) if me == 0 else None
    for name, pair in out.items():
        if pair is not None:
            _same(*pair, name)
    return {k: None if v is None else v[1] for k, v in out.items()}


def test_collectives_and_neighbour_ops_on_cuda_match_the_cpu_run():
    results = run_distributed(_collectives, 2, timeout=120)
    # The host run itself is right: e.g. allreduce averages.
    expect = (_x(0) + _x(1)) / 2
    for r in results:
        assert torch.allclose(r["allreduce"], expect)
        assert torch.allclose(r["broadcast"], _x(1))


def _in_place_and_p2p():
    me = gossamer.rank()
    x = _x(me).to(GPU)
    before = x.data_ptr()
    assert gossamer.allreduce_(x) is x
    assert x.data_ptr() == before and x.device == GPU
    averaged = x.cpu()
    y = _x(me).to(GPU)
    handle = gossamer.broadcast_(y, root=0, async_op=True)
    assert handle.wait() is y
    # send/recv: rank 0 sends its CUDA tensor, rank 1 receives into a CUDA result.
    got = None
    if me == 0:
        gossamer.send(_x(0).to(GPU), dst=1)
    else:
        got = gossamer.recv(torch.empty(5, 3, dtype=torch.float64, device=GPU), src=0)
        assert got.device == GPU
        got = got.cpu()
    return averaged, y.cpu(), got


def test_in_place_ops_write_into_the_cuda_tensor_and_p2p_works():
    results = run_distributed(_in_place_and_p2p, 2, timeout=120)
    for averaged, broadcast, _ in results:
        assert torch.allclose(averaged, (_x(0) + _x(1)) / 2)
        assert torch.equal(broadcast, _x(0))
    assert torch.equal(results[1][2], _x(0))


def _window(device: torch.device) -> torch.Tensor:
    me = gossamer.rank()
    x = _x(me).to(device)
    with Window.create(x, zero_init=True) as win:
        win.put()
        win.accumulate(self_weight=0.5)
        gossamer.barrier()
        win.update()
        gossamer.barrier()  # else a get may read the peer's tensor while its update writes it
        win.get()
        out = win.update(self_weight=0.5, src_weights={1 - me: 0.5}, clone=True)
    assert x.device == device and out.device == device
    return torch.stack([x.cpu(), out.cpu()])


def _windows_both():
    return _window(GPU), _window(torch.device("cpu"))


def test_window_put_accumulate_get_update_on_cuda_match_the_cpu_run():
    for on_gpu, on_host in run_distributed(_windows_both, 2, timeout=120):
        assert torch.equal(on_gpu, on_host)


def _compressed(spec: str, device: torch.device) -> torch.Tensor:
    comm = communicators.CompressedAllreduce(spec, error_feedback=False)
    x = _x(gossamer.rank(), (1001,)).to(device)
    outs = []
    for _ in range(2):
        comm.next_round()
        out = comm.start(x, 0).wait()
        assert out.device == device
        outs.append(out.cpu())
    return torch.stack(outs)


def _choco(device: torch.device) -> torch.Tensor:
    comm = communicators.ChocoGossip("uint8")
    x = _x(gossamer.rank(), (1001,)).to(device)
    for _ in range(3):
        comm.next_round()
        x = comm.start(x, 0).wait()
        assert x.device == device
    return x.cpu()


def _compressed_both(spec: str):
    return (
        _compressed(spec, GPU),
        _compressed(spec, torch.device("cpu")),
        _choco(GPU),
        _choco(torch.device("cpu")),
    )


@pytest.mark.parametrize("spec", ["uint8", "topk:0.1", "randomk:0.1"])
def test_compressed_allreduce_and_choco_on_cuda_match_the_cpu_run(spec):
    for gpu_ar, cpu_ar, gpu_choco, cpu_choco in run_distributed(
        _compressed_both, 2, args=(spec,), timeout=120
    ):
        # Compression kernels may round differently on the GPU: compare closely, not bitwise.
        assert torch.allclose(gpu_ar, cpu_ar, atol=1e-6), (gpu_ar - cpu_ar).abs().max()
        assert torch.allclose(gpu_choco, cpu_choco, atol=1e-6)


def _train(kind: str, device: torch.device) -> torch.Tensor:
    torch.manual_seed(0)  # the same start on every rank
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    model.to(device)
    sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if kind == "atc":
        opt = optim.AdaptThenCombine(sgd, model, fusion_threshold_bytes=64)
    elif kind == "awc_choco":
        opt = optim.AdaptWithCombine(sgd, model, compression="uint8")
    else:
        opt = optim.GradientAllreduce(sgd, model)
    g = torch.Generator().manual_seed(gossamer.rank())
    for _ in range(3):
        a = torch.randn(16, 6, generator=g, dtype=torch.float64).to(device)
        b = torch.randn(16, 1, generator=g, dtype=torch.float64).to(device)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(a), b).backward()
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    assert params.device.type == device.type
    return params.cpu()


def _train_both(kind: str):
    return _train(kind, GPU), _train(kind, torch.device("cpu"))


@pytest.mark.parametrize("kind", ["atc", "gradient_allreduce", "awc_choco"])
def test_optimizer_steps_of_a_cuda_model_match_the_cpu_run(kind):
    for on_gpu, on_host in run_distributed(_train_both, 2, args=(kind,), timeout=180):
        # cuBLAS and the CPU may sum a matmul in another order: close, not bitwise.
        assert torch.allclose(on_gpu, on_host, atol=1e-8), (on_gpu - on_host).abs().max()
        assert not torch.equal(on_host, _train_start())


def _train_start() -> torch.Tensor:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)
    ).double()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


_NCCL_RANK = textwrap.dedent(
    """
    import gossamer
    try:
        gossamer.init(backend="nccl")
    except ValueError as err:
        print("REFUSED:", err)
    else:
        print("ACCEPTED")
    """
)


def test_nccl_refuses_two_ranks_on_one_gpu_at_init(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(_NCCL_RANK)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "0")}
    env["CUDA_VISIBLE_DEVICES"] = env["CUDA_VISIBLE_DEVICES"].split(",")[0]  # one GPU
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29400 + os.getpid() % 1000))
    env["WORLD_SIZE"] = "2"
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    for out in outs:
        assert "REFUSED:" in out, out
        assert "ranks [0, 1]" in out and "cuda:0" in out and "backend='gloo'" in out, out
