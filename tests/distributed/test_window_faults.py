"""A rank that dies while holding a window mutex: the survivor gets RankLostError, not a hang."""

import os
import subprocess
import sys
import textwrap
import time

from gossamer.testing import free_port

SCRIPT = textwrap.dedent(r"""
    import os, sys, time, torch, gossamer
    from gossamer import topology as topo
    gossamer.init()
    gossamer.set_topology(topo.fully_connected(2))
    win = gossamer.Window.create(torch.zeros(3), zero_init=True)
    if gossamer.rank() == 1:
        with win.mutex():          # rank 1 holds its slot's mutex at rank 0 ...
            gossamer.barrier()
            time.sleep(0.5)
            os._exit(3)            # ... and dies without releasing it
    gossamer.barrier()
    start = time.time()
    for name, call in [("update", lambda: win.update(require_mutex=True)),
                       ("put", lambda: win.put())]:
        try:
            call()
            print(f"{name}: no error", flush=True)
        except Exception as err:
            print(f"{name}: {type(err).__name__} after {time.time() - start:.1f} s: {err}",
                  flush=True)
    gossamer.shutdown()
    print("rank 0 shut down", flush=True)
""")


def test_dead_mutex_holder_gives_the_waiter_an_error(tmp_path):
    script = tmp_path / "dead.py"
    script.write_text(SCRIPT)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "GOSSAMER_TIMEOUT": "10",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    start = time.time()
    out0, _ = procs[0].communicate(timeout=180)
    procs[1].communicate(timeout=30)
    assert procs[1].returncode == 3
    lines = [line for line in out0.splitlines() if line.startswith(("update:", "put:", "rank"))]
    # The heartbeats show the holder died: the waiter names it well before the deadline.
    assert lines[0].startswith("update: RankLostError"), out0
    assert "rank 1 was lost" in lines[0] and "mutex slot 1 of rank 0" in lines[0], out0
    assert float(lines[0].split(" after ")[1].split(" s")[0]) < 10.0, out0
    assert lines[1].startswith("put: RankLostError") and "rank 1 was lost" in lines[1], out0
    assert "rank 0 shut down" in out0, out0
    assert time.time() - start < 120


RAISES_IN_WITH = textwrap.dedent(r"""
    import torch, gossamer
    gossamer.init()
    with gossamer.Window.create(torch.zeros(3), zero_init=True) as win:
        for it in range(20):
            if it == 2 and gossamer.rank() == 1:
                raise ValueError("user bug on rank 1")
            win.put()
            win.update()
            gossamer.barrier()
""")


def test_an_error_inside_a_window_block_is_the_error_reported(tmp_path):
    """Leaving ``with Window.create(...)`` by an exception does not run the collective free.

    It used to wait there for the ranks that did not fail, until the timeout, and the
    ``CommunicationTimeout`` of the free hid the user's error from the traceback.
    """
    script = tmp_path / "raises.py"
    script.write_text(RAISES_IN_WITH)
    done = subprocess.run(
        [sys.executable, "-m", "gossamer.launcher", "run", "-np", "2", str(script)],
        env={**os.environ, "GOSSAMER_TIMEOUT": "10"},
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode != 0
    assert "ValueError: user bug on rank 1" in done.stderr, done.stderr
    assert "Window.free" not in done.stderr, done.stderr
