"""`gossamer run --elastic` and `--max-restarts` with `--checkpoint-dir`, end to end.

Each test starts real torchrun agents and ranks through the launcher; a rank SIGKILLs
itself (no clean-up, as a crash or an OOM kill would).
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

# Rank 0 dies before step 3; with --elastic the others finish all 8 steps of elastic
# neighbour averaging and report the live set they agreed on. Rank 0 hosts nothing under
# the launcher (the agent hosts the store of heartbeats and membership epochs).
SURVIVE = textwrap.dedent(r"""
    import os, signal, torch
    import gossamer
    from gossamer import optim, topology
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    torch.manual_seed(rank)
    model = torch.nn.Linear(3, 1)
    opt = optim.AdaptWithCombine(torch.optim.SGD(model.parameters(), lr=0.05), model,
                                 topology=topology.ring(size), elastic=True)
    for step in range(8):
        if rank == 0 and step == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    # The agent's tombstone for rank 0, where this rank's liveness reads it.
    marked = gossamer.context.runtime().store.check(["gossamer/dead/0"])
    os.write(1, f"rank {rank} finished 8 steps, live {gossamer.live_ranks()}, {marked}\n".encode())
    gossamer.shutdown()
""")

# Checkpoints every 4 steps; with "kill", rank 1 dies at step 7 of the first attempt, and
# the restarted ranks resume from step 4. The global generator draws the data, so a resume
# that did not restore it (or the momentum, or the counters) would end elsewhere.
RESUME = textwrap.dedent(r"""
    import os, signal, sys, torch
    import gossamer
    from gossamer import checkpoint, optim, topology
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(size))
    auto = checkpoint.AutoResume(model, opt)
    os.write(1, f"rank {rank} attempt {attempt} starts at step {auto.steps}\n".encode())
    for step in range(auto.steps, 12):
        if sys.argv[1:] == ["kill"] and rank == 1 and step == 7 and attempt == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.randn(8, 4)
        opt.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
        auto.after_step()
    opt.synchronize()
    torch.save([p.detach() for p in model.parameters()], f"final{rank}.pt")
    gossamer.shutdown()
""")


def _gossamer(args, cwd, script, timeout=600):
    (cwd / "job.py").write_text(script)
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", *args]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=dict(os.environ), timeout=timeout, cwd=cwd
    )


def test_elastic_survivors_finish_and_the_launch_exits_0(tmp_path):
    done = _gossamer(["-np", "3", "--elastic", "job.py"], tmp_path, SURVIVE)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [
        "rank 1 finished 8 steps, live [1, 2], True",
        "rank 2 finished 8 steps, live [1, 2], True",
    ]
    assert "gossamer run: rank 0 (local rank 0" in done.stderr
    assert "was killed by signal SIGKILL; the others went on (--elastic)" in done.stderr


@pytest.mark.timeout(600)  # two launches, one with a restart: over 300 s on a loaded machine
def test_a_restart_resumes_from_the_newest_checkpoint_exactly(tmp_path):
    killed, whole = tmp_path / "killed", tmp_path / "whole"
    killed.mkdir()
    whole.mkdir()
    options = ["--max-restarts", "1", "--checkpoint-dir", "ck", "--checkpoint-every", "4"]
    done = _gossamer(["-np", "3", *options, "job.py", "kill"], killed, RESUME)
    assert done.returncode == 0, done.stdout + done.stderr
    starts = sorted(line for line in done.stdout.splitlines() if " starts at " in line)
    assert starts == sorted(
        [f"rank {r} attempt 0 starts at step 0" for r in range(3)]
        + [f"rank {r} attempt 1 starts at step 4" for r in range(3)]
    )
    assert sorted(p.name for p in (killed / "ck").iterdir()) == ["step00000008", "step00000012"]
    # The reference: the same job, never interrupted, without checkpoints.
    reference = _gossamer(["-np", "3", "job.py"], whole, RESUME)
    assert reference.returncode == 0, reference.stdout + reference.stderr
    for rank in range(3):
        got = torch.load(killed / f"final{rank}.pt")
        want = torch.load(whole / f"final{rank}.pt")
        assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True)), rank
