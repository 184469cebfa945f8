"""`gossamer run --elastic` and `--max-restarts` with `--checkpoint-dir`, end to end.

Each test starts real torchrun agents and ranks through the launcher; a rank SIGKILLs
itself (no clean-up, as a crash or an OOM kill would).
"""

import json
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
    import os, signal, time, torch
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
    # The agent's tombstone for rank 0, where this rank's liveness reads it (the
    # survivors may have seen rank 0's process end first, and finished before it came).
    store, deadline = gossamer.context.runtime().store, time.monotonic() + 10
    while not (marked := store.check(["gossamer/dead/0"])) and time.monotonic() < deadline:
        time.sleep(0.05)
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

# --elastic with restarts: rank 3 dies at step 3 and the other three train on, saving the
# survivors' checkpoints (steps 4, 6, ...); rank 2 dies at step 7, which leaves fewer than
# --min-ranks 3, so every rank restarts and resumes the newest checkpoint of survivors,
# from their average. Each rank writes what it starts from.
ELASTIC_RESTART = textwrap.dedent(r"""
    import os, signal, time, torch
    import gossamer
    from gossamer import checkpoint, optim, topology
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    torch.manual_seed(rank)
    model = torch.nn.Linear(4, 1)
    sgd = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.ring(size), elastic=True)
    auto = checkpoint.AutoResume(model, opt, keep=10)
    torch.save(model.state_dict(), f"start{rank}.{attempt}.pt")
    os.write(1, f"rank {rank} attempt {attempt} starts at step {auto.steps}\n".encode())
    for step in range(auto.steps, 10):
        if attempt == "0" and (rank, step) in ((3, 3), (2, 7)):
            os.kill(os.getpid(), signal.SIGKILL)
        if attempt == "0" and step >= 7:
            time.sleep(1)  # the agent stops the survivors before they could finish
        x = torch.randn(8, 4)
        opt.zero_grad()
        (model(x) - x.sum(1, keepdim=True)).pow(2).mean().backward()
        opt.step()
        auto.after_step()
    opt.synchronize()
    gossamer.shutdown()
""")

# Rank 1 ends before it imports gossamer (an import error, an OOM kill at start-up); the
# others report how their gossamer.init() ended.
EARLY_DEATH = textwrap.dedent(r"""
    import os, signal, sys
    if os.environ["RANK"] == "1":
        if sys.argv[1] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        sys.exit(3)
    import gossamer
    try:
        gossamer.init()
    except Exception as err:
        os.write(1, f"rank {os.environ['RANK']}: {type(err).__name__} "
                    f"{getattr(err, 'ranks', None)} {err}\n".encode())
        sys.exit(1)
    os.write(1, f"rank {gossamer.rank()} joined\n".encode())
""")


def _gossamer(args, cwd, script, timeout=600, env=None):
    (cwd / "job.py").write_text(script)
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", *args]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        cwd=cwd,
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


# Rank 1 finishes early (less data) with code 0; gradient allreduce is not elastic, so
# the others raise RankLostError naming it. Rank 1 is slow to exit after shutdown(): the
# others fail while it still runs, and it must not count as a rank that went on.
EARLY_FINISH = textwrap.dedent(r"""
    import time
    import torch
    import gossamer
    from gossamer import optim
    gossamer.init()
    rank = gossamer.rank()
    model = torch.nn.Linear(3, 1)
    opt = optim.GradientAllreduce(torch.optim.SGD(model.parameters(), lr=0.05), model)
    for step in range(2 if rank == 1 else 50):
        opt.zero_grad()
        model(torch.randn(4, 3)).pow(2).mean().backward()
        opt.step()
    gossamer.shutdown()
    if rank == 1:
        time.sleep(3)
""")


def test_elastic_ranks_that_all_fail_after_an_early_finisher_fail_the_launch(tmp_path):
    # It exited 0: the early finisher counted as a rank that went on.
    done = _gossamer(["-np", "3", "--elastic", "job.py"], tmp_path, EARLY_FINISH, timeout=300)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "RankLostError" in done.stderr and "rank 1 was lost" in done.stderr


@pytest.mark.parametrize(("size", "how"), [(2, "kill"), (3, "exit")])
def test_elastic_a_rank_dead_before_init_fails_the_others_init_naming_it(tmp_path, size, how):
    # torch's rendezvous would wait GOSSAMER_TIMEOUT for rank 1, then raise its store error;
    # the launch must end long before (the subprocess timeout) with rank 1 named.
    done = _gossamer(
        ["-np", str(size), "--elastic", "job.py", how],
        tmp_path,
        EARLY_DEATH,
        timeout=60,
        env={"GOSSAMER_TIMEOUT": "120"},
    )
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert len(lines) == size - 1, done.stdout + done.stderr
    for survivor, line in zip([0, *range(2, size)], lines, strict=True):
        assert line.startswith(f"rank {survivor}: RankLostError [1] "), line
        assert "rank 1 died before joining the job" in line, line
    code, what = (137, "was killed by signal SIGKILL") if how == "kill" else (3, "exit code 3")
    assert done.returncode == code, done.stdout + done.stderr
    assert "gossamer run: rank 1 (local rank 1, pid " in done.stderr
    assert what in done.stderr


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


@pytest.mark.timeout(600)
def test_elastic_survivors_checkpoint_and_a_restart_resumes_their_average(tmp_path):
    options = ["--elastic", "--min-ranks", "3", "--max-restarts", "1"]
    options += ["--checkpoint-dir", "ck", "--checkpoint-every", "2"]
    done = _gossamer(["-np", "4", *options, "job.py"], tmp_path, ELASTIC_RESTART)
    assert done.returncode == 0, done.stdout + done.stderr
    starts = [line for line in done.stdout.splitlines() if " attempt 1 starts at " in line]
    assert len(starts) == 4, done.stdout
    step = int(starts[0].rsplit(" ", 1)[1])
    assert all(line.endswith(f" step {step}") for line in starts), starts
    # Saved after rank 3's death (step 4 on): the survivors' average; step 8 when ranks 0
    # and 1 saved it before their agent stopped them.
    assert step in (6, 8), starts
    newest = tmp_path / "ck" / f"step{step:08d}"
    manifest = json.loads((newest / "manifest.json").read_text())
    assert manifest["ranks"] == ([0, 1, 2] if step == 6 else [0, 1]), manifest
    saved = [torch.load(newest / f["file"])["model"] for f in manifest["files"]]
    for rank in range(4):
        start = torch.load(tmp_path / f"start{rank}.1.pt")
        for key, value in start.items():
            want = torch.stack([s[key].double() for s in saved]).mean(0).float()
            torch.testing.assert_close(value, want)
