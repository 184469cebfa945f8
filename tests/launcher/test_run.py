"""End-to-end runs of `gossamer run` (each starts real torchrun agents and ranks)."""

import os
import subprocess
import sys
import textwrap
import time

import pytest

REPORT = textwrap.dedent(r"""
    import os, signal, sys
    import gossamer
    gossamer.init()
    # One write per line: the ranks share the pipe and must not interleave.
    os.write(1, f"rank {gossamer.rank()} of {gossamer.size()} machine "
                f"{gossamer.machine_rank()}/{gossamer.machine_size()}\n".encode())
    if len(sys.argv) > 2 and gossamer.rank() == int(sys.argv[2]):
        if sys.argv[1] == "exit":
            sys.exit(3)
        os.kill(os.getpid(), signal.SIGKILL)
    gossamer.shutdown()
""")


def _gossamer(args, tmp_path, env=None, timeout=180):
    script = tmp_path / "report.py"
    script.write_text(REPORT)
    full_env = {**os.environ, **(env or {})}
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", *args]
    cmd = [str(script) if a == "REPORT" else a for a in cmd]
    return subprocess.run(
        cmd, capture_output=True, text=True, env=full_env, timeout=timeout, cwd=tmp_path
    )


def _ranks(stdout):
    return sorted(line for line in stdout.splitlines() if line.startswith("rank "))


def test_two_ranks_report_rank_and_size(tmp_path):
    done = _gossamer(["-np", "2", "REPORT"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert _ranks(done.stdout) == ["rank 0 of 2 machine 0/1", "rank 1 of 2 machine 0/1"]


def test_a_failing_rank_fails_the_launch_with_its_exit_code_and_name(tmp_path):
    done = _gossamer(["-np", "3", "REPORT", "exit", "1"], tmp_path)
    assert done.returncode == 3
    assert "gossamer run: rank 1 (local rank 1" in done.stderr
    assert "failed with exit code 3" in done.stderr


def test_a_killed_rank_is_named_with_its_signal(tmp_path):
    done = _gossamer(["-np", "2", "REPORT", "kill", "0"], tmp_path)
    assert done.returncode == 128 + 9
    assert "rank 0" in done.stderr and "SIGKILL" in done.stderr


RAISE_WITH_WINDOWS = textwrap.dedent(r"""
    import torch, gossamer
    from gossamer import optim
    gossamer.init()
    model = torch.nn.Linear(4, 2)
    opt = optim.WindowPut(torch.optim.SGD(model.parameters(), lr=0.01), model)
    for step in range(2000):
        if step == 5 and gossamer.rank() == 1:
            raise ValueError("a user's bug on rank 1")
        opt.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
        gossamer.allreduce(torch.ones(1))
""")


def test_a_rank_that_raises_with_a_window_optimizer_alive_exits_without_waiting(tmp_path):
    # Its window service kept answering its peers' puts after the STOP it sent at exit,
    # and its exit waited for those answers until GOSSAMER_TIMEOUT (5 of 6 runs here).
    (tmp_path / "raises.py").write_text(RAISE_WITH_WINDOWS)
    done = _gossamer(
        ["-np", "3", "raises.py"], tmp_path, env={"GOSSAMER_TIMEOUT": "300"}, timeout=120
    )
    assert done.returncode == 1
    assert "a user's bug on rank 1" in done.stderr
    assert "rank 1 (local rank 1" in done.stderr and "failed with exit code 1" in done.stderr


REINIT = textwrap.dedent(r"""
    import os, sys, torch, gossamer
    for i in range(int(sys.argv[1])):
        gossamer.init()
        total = gossamer.allreduce(torch.ones(2), average=False)[0].item()
        mixed = gossamer.neighbor_allreduce(torch.full((2,), float(gossamer.rank())))[0].item()
        os.write(1, f"init {i} rank {gossamer.rank()} {total} {mixed}\n".encode())
        gossamer.shutdown()
""")


@pytest.mark.parametrize("launcher", [True, False])
def test_init_after_shutdown_in_the_same_process(tmp_path, launcher):
    """Each init must meet its peers in this init, not in the last one's store or sockets."""
    script = tmp_path / "reinit.py"
    script.write_text(REINIT)
    if launcher:  # the agent's store outlives every init
        done = _gossamer(["-np", "2", str(script), "8"], tmp_path, timeout=240)
        outs, codes = [done.stdout], [done.returncode]
    else:  # rank 0 hosts the store itself
        env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        env["MASTER_PORT"] = str(20000 + os.getpid() % 20000)
        procs = [
            subprocess.Popen(
                [sys.executable, str(script), "8"],
                env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                stdout=subprocess.PIPE,
                text=True,
            )
            for r in range(2)
        ]
        outs = [p.communicate(timeout=240)[0] for p in procs]
        codes = [p.returncode for p in procs]
    assert codes == [0] * len(codes), outs
    lines = sorted(line for out in outs for line in out.splitlines() if line.startswith("init"))
    # ring of 2: the neighbour average of ranks 0 and 1 is 0.5 on both
    assert lines == sorted(f"init {i} rank {r} 2.0 0.5" for i in range(8) for r in range(2))


def test_module_mode_runs_pytest_under_the_launcher(tmp_path):
    (tmp_path / "test_inside.py").write_text(
        "import gossamer\n\ndef test_size():\n    gossamer.init()\n"
        "    assert gossamer.size() == 2\n"
    )
    done = _gossamer(
        ["-np", "2", "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_inside.py"], tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("1 passed") == 2


def _fake_ssh(tmp_path, body):
    """The environment of a launch whose `ssh` is a shell script of ``body``."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text(f"#!/bin/sh\n{body}\n")
    (fake / "ssh").chmod(0o755)
    return {"PATH": f"{fake}:{os.environ['PATH']}"}


def test_hosts_start_one_agent_per_machine(tmp_path):
    # Two "machines" on this host (both names are local), plus a fake ssh for a remote name:
    # the remote agent is started through `ssh HOST CMD`, which the fake runs here.
    env = _fake_ssh(tmp_path, 'shift 3\nexec sh -c "$1"')
    done = _gossamer(
        ["-np", "3", "-H", "localhost:1,127.0.0.1:1,elsewhere:1", "REPORT"], tmp_path, env=env
    )
    assert done.returncode == 0, done.stderr
    lines = _ranks(done.stdout)
    assert [line.split(" machine ")[0] for line in lines] == [
        "rank 0 of 3",
        "rank 1 of 3",
        "rank 2 of 3",
    ]
    assert {line.split(" machine ")[1] for line in lines} == {"0/3", "1/3", "2/3"}


def test_an_unreachable_host_fails_the_job_at_once_naming_it(tmp_path):
    # A fake ssh that cannot resolve the name, as ssh exits: the local agent waits in the
    # rendezvous for it, and the launcher used to wait for that agent first.
    env = _fake_ssh(tmp_path, 'echo "ssh: Could not resolve hostname" >&2\nexit 255')
    start = time.monotonic()
    done = _gossamer(["-np", "2", "-H", "localhost:1,nowhere:1", "REPORT"], tmp_path, env=env)
    assert done.returncode == 255, done.stderr
    assert "the agent on nowhere exited with code 255 (ssh could not reach it?)" in done.stderr
    assert time.monotonic() - start < 60  # not the rendezvous' timeout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-np", "0", "REPORT"], "-np must be an integer >= 1"),
        (["-np", "2", "-H", "a:1,,b:1", "REPORT"], "-H/--hosts entry"),
        (
            ["-np", "4", "--nproc-per-node", "2", "REPORT"],
            "-np 4 disagrees with --nproc-per-node 2 x --nnodes 1 = 2",
        ),
        (
            ["-np", "2", "--elastic", "--min-ranks", "5", "REPORT"],
            "--min-ranks 5 is more than the 2 ranks of this machine",
        ),
    ],
)
def test_bad_input_fails_before_anything_starts(tmp_path, args, message):
    done = _gossamer(args, tmp_path, timeout=60)
    assert done.returncode == 2
    assert message in done.stderr
    assert "rank" not in done.stdout
