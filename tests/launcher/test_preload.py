"""Ranks forked from the preloader see what a fresh `python -u script.py` would show them."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

from gossamer.launcher import preload

PROBE = textwrap.dedent(r"""
    import json, os, sys
    preloaded = "torch" in sys.modules
    import numpy, torch
    report = {
        "preloaded": preloaded,
        "name": __name__,
        "file": __file__,
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "rank": os.environ["RANK"],
        "mine": os.environ.get("PROBE_VARIABLE"),
        "threads": torch.get_num_threads(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "draw": numpy.random.rand(),
        "torch_draw": torch.rand(1).item(),
        "unbuffered": sys.stdout.write_through,
        "fds": sorted(os.listdir("/proc/self/fd")),
    }
    os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
    sys.exit(int(sys.argv[1]) if os.environ["RANK"] == "1" else 0)
""")


def _launch(tmp_path, *options, code=0):
    (tmp_path / "probe.py").write_text(PROBE)
    env = dict(os.environ, PROBE_VARIABLE="given")
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", "-np", "2", *options]
    done = subprocess.run(
        [*cmd, "probe.py", str(code)], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=240,
    )  # fmt: skip
    lines = [ln.removeprefix("REPORT ") for ln in done.stdout.splitlines() if "REPORT " in ln]
    reports = sorted((json.loads(ln) for ln in lines), key=lambda r: r["rank"])
    return done, reports


def test_a_forked_rank_sees_what_a_fresh_interpreter_would(tmp_path):
    forked, ours = _launch(tmp_path)
    fresh, theirs = _launch(tmp_path, "--no-preload")
    assert forked.returncode == 0 and fresh.returncode == 0, forked.stderr + fresh.stderr
    assert [r.pop("preloaded") for r in ours] == [True, True]
    assert [r.pop("preloaded") for r in theirs] == [False, False]
    # Unseeded generators differ between ranks (and runs), as in fresh processes.
    for key in ("draw", "torch_draw"):
        assert ours[0].pop(key) != ours[1].pop(key)
        assert theirs[0].pop(key) != theirs[1].pop(key)
    assert ours == theirs
    assert ours[0]["name"] == "__main__" and ours[0]["threads"] == 1 and ours[0]["unbuffered"]
    assert ours[0]["mine"] == "given" and ours[0]["argv"] == ["probe.py", "0"]


def test_a_forked_rank_passes_its_exit_code_through(tmp_path):
    done, reports = _launch(tmp_path, code=7)
    assert done.returncode == 7, done.stderr
    assert "rank 1 (local rank 1" in done.stderr and "failed with exit code 7" in done.stderr
    assert len(reports) == 2


def test_without_a_preloader_the_client_runs_the_program_itself(tmp_path):
    (tmp_path / "hello.py").write_text("import sys; print('hello', sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k != preload.SOCKET_VARIABLE}
    done = subprocess.run(
        [*preload.client_command(["hello.py", "a"])], cwd=tmp_path, env=env,
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout == "hello ['a']\n", done.stderr


def test_a_rank_whose_client_dies_is_killed_and_the_preloader_ends_with_its_launcher(tmp_path):
    (tmp_path / "sleeper.py").write_text(
        "import os, time\nprint(os.getpid(), flush=True)\ntime.sleep(300)\n"
    )
    preloader = preload.start()
    try:
        client, rank = _sleeper(tmp_path)
        assert rank != client.pid
        client.send_signal(signal.SIGTERM)  # relayed: the rank dies of it, then the client
        assert client.wait(timeout=30) == -signal.SIGTERM
        assert _gone(rank)
        client, rank = _sleeper(tmp_path)
        client.kill()  # no relay: the preloader sees the client's connection close
        client.wait(timeout=30)
        assert _gone(rank)
        client, rank = _sleeper(tmp_path)
    finally:
        preloader.stop()
        os.environ.pop(preload.SOCKET_VARIABLE, None)
    assert client.wait(timeout=30) == -signal.SIGKILL
    assert _gone(rank)


def _sleeper(tmp_path):
    """A client of sleeper.py and its rank's pid (which the rank prints)."""
    client = subprocess.Popen(
        preload.client_command(["sleeper.py"]), cwd=tmp_path, stdout=subprocess.PIPE, text=True
    )
    return client, int(client.stdout.readline())


def _gone(pid, within=10.0):
    end = time.monotonic() + within
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False
