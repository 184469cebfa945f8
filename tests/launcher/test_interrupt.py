"""Ctrl-C and SIGTERM: every rank stops, one line, the shell's exit code, no traceback."""

import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

SLEEPER = textwrap.dedent("""
    import os, signal, sys, time
    if "--ignore-sigterm" in sys.argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--gossamer" in sys.argv:  # GOSSAMER_TIMELINE in the environment starts the timeline
        import gossamer
        gossamer.init()
        gossamer.barrier()
    print(f"ready {os.environ['RANK']} {os.getpid()}", flush=True)
    time.sleep(600)
""")


class Job:
    """``gossamer run`` in a subprocess whose stdout lines are read as they come."""

    def __init__(self, args, tmp_path, env=None, script_args=()):
        (tmp_path / "sleeper.py").write_text(SLEEPER)
        cmd = [sys.executable, "-m", "gossamer.launcher", "run", *args, "sleeper.py", *script_args]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
            env={**os.environ, **(env or {})},
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line)

    def rank_pids(self, count, deadline=180):
        """Wait until ``count`` ranks said they are ready; their pids."""
        pids = {}
        end = time.monotonic() + deadline
        while len(pids) < count:
            try:
                line = self.lines.get(timeout=max(0.1, end - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                pytest.fail(f"only {len(pids)} of {count} ranks started: {self.proc.stderr.read()}")
            if line.startswith("ready "):
                _, rank, pid = line.split()
                pids[int(rank)] = int(pid)
        return pids

    def stop(self, sig):
        self.proc.send_signal(sig)
        code = self.proc.wait(timeout=180)
        return code, self.proc.stderr.read()


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] != "Z"
    except OSError:  # FileNotFoundError, or ProcessLookupError when it goes while read
        return False


def _assert_all_gone(pids, deadline=60):
    end = time.monotonic() + deadline
    while any(_alive(pid) for pid in pids) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [pid for pid in pids if _alive(pid)], "ranks left alive"


@pytest.mark.parametrize(
    ("sig", "np_", "code"), [(signal.SIGINT, 4, 130), (signal.SIGTERM, 2, 143)], ids=["int", "term"]
)
def test_a_signal_stops_every_rank_with_one_line_and_the_shells_code(tmp_path, sig, np_, code):
    job = Job(["-np", str(np_)], tmp_path)
    pids = job.rank_pids(np_)
    assert sorted(pids) == list(range(np_))
    assert all(_alive(pid) for pid in pids.values())
    returncode, stderr = job.stop(sig)
    assert returncode == code, stderr
    assert stderr.splitlines() == [f"gossamer run: interrupted; stopped {np_} ranks"]
    _assert_all_gone(pids.values())


def test_a_second_signal_kills_ranks_that_ignore_sigterm_at_once(tmp_path):
    # A grace period longer than Job.stop waits: only the second signal can end the job.
    env = {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "900"}
    job = Job(["-np", "2"], tmp_path, env=env, script_args=["--ignore-sigterm"])
    pids = job.rank_pids(2)
    job.proc.send_signal(signal.SIGINT)
    # The ranks ignore the SIGTERM they get; the launcher waits out the grace period...
    with pytest.raises(subprocess.TimeoutExpired):
        job.proc.wait(timeout=3)
    assert all(_alive(pid) for pid in pids.values())
    # ...unless a second Ctrl-C comes.
    returncode, stderr = job.stop(signal.SIGINT)
    assert returncode == 130, stderr
    assert stderr.splitlines() == ["gossamer run: interrupted; stopped 2 ranks"]
    _assert_all_gone(pids.values())


def test_a_signal_to_a_hosts_job_stops_every_agent_and_rank(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "ssh").write_text('#!/bin/sh\nshift 3\nexec sh -c "$1"\n')
    (fake / "ssh").chmod(0o755)
    job = Job(
        ["-np", "3", "-H", "localhost:1,127.0.0.1:1,elsewhere:1"],
        tmp_path,
        env={"PATH": f"{fake}:{os.environ['PATH']}"},
    )
    pids = job.rank_pids(3)
    agents = {int(p) for p in os.listdir("/proc") if p.isdigit() and _parent(p) == job.proc.pid}
    assert len(agents) == 3
    returncode, stderr = job.stop(signal.SIGINT)
    assert returncode == 130, stderr
    assert stderr.splitlines() == ["gossamer run: interrupted; stopped 3 ranks"]
    _assert_all_gone([*pids.values(), *agents])


def test_an_agent_whose_hosts_launcher_dies_stops_its_ranks(tmp_path):
    # SIGKILL leaves no chance to clean up: the agents notice that their stdin has closed.
    job = Job(["-np", "2", "-H", "localhost:1,127.0.0.1:1"], tmp_path)
    pids = job.rank_pids(2)
    job.proc.kill()
    job.proc.wait(timeout=60)
    _assert_all_gone(pids.values(), deadline=120)


def _parent(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rpartition(")")[2].split()[1])
    except OSError:
        return None


def test_children_with_a_marker_are_only_the_launchs_own(tmp_path):
    from gossamer.launcher.signals import children

    ours = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(60)"],
        env={**os.environ, "TORCHELASTIC_ERROR_FILE": f"{tmp_path}/1.rank.0.error.json"},
    )
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert {ours.pid, other.pid} <= set(children())
        assert children(f"TORCHELASTIC_ERROR_FILE={tmp_path}/".encode()) == [ours.pid]
    finally:
        ours.kill()
        other.kill()
        ours.wait()
        other.wait()
    assert ours.pid not in children() and other.pid not in children()


@pytest.mark.parametrize("np_", [2, 3])
def test_an_interrupted_job_still_writes_every_rank_s_timeline(tmp_path, np_):
    env = {"GOSSAMER_TIMELINE": str(tmp_path / "trace")}
    job = Job(["-np", str(np_)], tmp_path, env=env, script_args=("--gossamer",))
    pids = job.rank_pids(np_)
    code, err = job.stop(signal.SIGINT)
    assert code == 130, err
    _assert_all_gone(pids.values())
    for rank in range(np_):
        assert (tmp_path / f"trace.rank{rank}.json").stat().st_size > 0, err
