"""`gossamer run --nnodes MIN:MAX`: a machine joins a running job through c10d.

Two torchrun agents on this machine stand for two machines. The first starts a job of 2
ranks, which checkpoints every 4 steps and, after 8 steps, waits. The second agent joins:
torchrun restarts every rank in a new rendezvous round of 4 ranks, and `AutoResume`
resumes the 2-rank checkpoint on 4 ranks, every rank from the mean of the saved two.
"""

import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from gossamer.testing import free_port

JOB = textwrap.dedent(r"""
    import os, time, torch
    import gossamer
    from gossamer import checkpoint, optim, topology
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(size))
    auto = checkpoint.AutoResume(model, opt, keep=100)
    os.write(1, f"start size {size} rank {rank} step {auto.steps}\n".encode())
    if auto.resumed_from is not None:
        loaded = [p.detach().clone() for p in model.parameters()]
        torch.save(loaded, f"loaded{rank}.pt")
    for step in range(auto.steps, 16):
        x = torch.randn(8, 4)
        opt.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
        auto.after_step()
        if size == 2 and auto.steps == 8:
            open("ready", "w").close()
            while True:  # until the joining machine makes torchrun restart this rank
                time.sleep(0.1)
    opt.synchronize()
    os.write(1, f"done size {size} rank {rank}\n".encode())
    gossamer.shutdown()
""")


@pytest.mark.timeout(300)
def test_a_joining_machine_restarts_the_job_on_more_ranks_from_the_average(tmp_path):
    (tmp_path / "job.py").write_text(JOB)
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "gossamer.launcher",
        "run",
        "--nnodes",
        "1:2",
        "--nproc-per-node",
        "2",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        f"join{port}",
        "--rdzv-conf",
        "last_call_timeout=1",
        "--checkpoint-dir",
        "ck",
        "--checkpoint-every",
        "4",
        "job.py",
    ]
    environ = dict(os.environ, GLOO_SOCKET_IFNAME="lo")

    def start():
        return subprocess.Popen(
            cmd,
            cwd=tmp_path,
            env=environ,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )

    first = start()
    deadline = time.monotonic() + 200
    while not (tmp_path / "ready").exists():
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()
        time.sleep(0.2)
    second = start()
    out = [p.communicate(timeout=240) for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, out
    lines = sorted(line for o, _ in out for line in o.splitlines())
    starts = [line.split() for line in lines if line.startswith("start ")]
    assert sorted(s[1:6] for s in starts) == sorted(
        [["size", "2", "rank", str(r), "step"] for r in range(2)]
        + [["size", "4", "rank", str(r), "step"] for r in range(4)]
    )
    assert sorted(s[6] for s in starts) == ["0", "0", "8", "8", "8", "8"]
    assert [line for line in lines if line.startswith("done")] == [
        f"done size 4 rank {r}" for r in range(4)
    ]
    # The reference: the mean of the two saved models, computed here from their files.
    saved = [
        torch.load(tmp_path / "ck" / "step00000008" / f"rank{k}.pt", weights_only=True)
        for k in range(2)
    ]
    mean = [
        (saved[0]["model"][k].double() + saved[1]["model"][k].double()) / 2
        for k in ("weight", "bias")
    ]
    assert not torch.equal(saved[0]["model"]["weight"], saved[1]["model"]["weight"])
    for rank in range(4):
        loaded = torch.load(tmp_path / f"loaded{rank}.pt")
        for got, want in zip(loaded, mean, strict=True):
            torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-7)


# Two machines (agents) of one rank each under --elastic; machine 1's rank dies at step 3.
SURVIVE = textwrap.dedent(r"""
    import os, signal, time, torch
    import gossamer
    from gossamer import optim, topology
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    model = torch.nn.Linear(3, 1)
    opt = optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                 topology=topology.ring(size), elastic=True)
    for step in range(30):
        if int(os.environ["GROUP_RANK"]) == 1 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
        time.sleep(0.05)
    opt.synchronize()
    os.write(1, f"rank {rank} finished, live {gossamer.live_ranks()}\n".encode())
    gossamer.shutdown()
""")


@pytest.mark.timeout(240)
def test_a_machine_whose_ranks_all_died_does_not_hold_the_others_at_exit(tmp_path):
    # torchrun's agents meet at an exit barrier only on success; the machine that lost its
    # ranks meets the others there too, so neither waits out the barrier's 300 s.
    (tmp_path / "job.py").write_text(SURVIVE)
    port = free_port()
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", "--elastic", "--nnodes", "2",
           "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--rdzv-id", f"survive{port}", "job.py"]  # fmt: skip
    environ = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    machines = [
        subprocess.Popen(cmd, cwd=tmp_path, env=environ, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for _ in range(2)
    ]  # fmt: skip
    # Without the meeting, the survivor's launcher would wait out the barrier: a timeout.
    out = [m.communicate(timeout=200) for m in machines]
    codes = sorted(m.returncode for m in machines)
    assert codes == [0, 137], out
    finished = [line for o, _ in out for line in o.splitlines() if "finished" in line]
    assert finished in (["rank 0 finished, live [0]"], ["rank 1 finished, live [1]"]), out
