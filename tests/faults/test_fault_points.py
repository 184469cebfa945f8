"""A rank kills itself (SIGKILL) at one of eleven points; every survivor names it in time.

Points: in the middle of an allreduce, a neighbor_allreduce (ring), a
hierarchical_neighbor_allreduce, a window put, get and accumulate with the mutex, and a
step of each optimizer (AdaptWithCombine, AdaptThenCombine, GradientAllreduce, WindowPut)
and of asynchronous push-sum (PushSum). Each point is one job of its own (a world with a dead
rank cannot be reused); the jobs run side by side. Every survivor must raise
``RankLostError`` naming the victim within ``GOSSAMER_TIMEOUT`` (20 s here) of the kill,
raise it again at once on its next call, and exit normally and soon after (no hang, no
abort, no thread left waiting on the dead rank). Two points
also run under the launcher (``gossamer run``), which must exit with 137 (128 + SIGKILL) and
name the killed rank.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gossamer.testing import free_port

TIMEOUT_S = 20
SCRIPT = textwrap.dedent(r"""
    import atexit, json, os, signal, sys, time, torch, gossamer
    from gossamer import topology as topo
    from gossamer.optim import (
        AdaptThenCombine, AdaptWithCombine, GradientAllreduce, PushSum, WindowPut,
    )

    point, victim, mark = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gossamer.init()
    r, n = gossamer.rank(), gossamer.size()
    # atexit runs after the interpreter joined its threads: when the process really ends.
    atexit.register(lambda: open(f"{mark}.{r}.exit", "w").write(str(time.time())))
    torch.manual_seed(0)
    x = torch.ones(20_000)

    def optimizer(cls):
        model = torch.nn.Linear(50, 1)
        opt = cls(torch.optim.SGD(model.parameters(), lr=0.01), model)
        data = torch.randn(16, 50)

        def step():
            opt.zero_grad()
            model(data).pow(2).mean().backward()
            opt.step()
            if hasattr(opt, "synchronize"):
                opt.synchronize()
        return step

    if point == "hierarchical_neighbor_allreduce":
        gossamer.set_machine_topology(topo.fully_connected(gossamer.machine_size()))
    if point.startswith("window"):
        gossamer.set_topology(topo.fully_connected(n))
        win = gossamer.Window.create(torch.zeros(20_000), zero_init=True)
    steps = {
        "allreduce": lambda: gossamer.allreduce(x),
        "neighbor_allreduce": lambda: gossamer.neighbor_allreduce(x, topology=topo.ring(n)),
        "hierarchical_neighbor_allreduce": lambda: gossamer.hierarchical_neighbor_allreduce(x),
        "window_put": lambda: win.put(),
        "window_get": lambda: win.get(),
        "window_accumulate_mutex": lambda: win.accumulate(require_mutex=True),
    }
    classes = {
        "awc_step": AdaptWithCombine,
        "atc_step": AdaptThenCombine,
        "gradient_allreduce_step": GradientAllreduce,
        "win_put_step": WindowPut,
        "push_sum_step": PushSum,
    }
    step = steps[point] if point in steps else optimizer(classes[point])
    report = {"rank": r}
    for i in range(1_000_000):
        if r == victim and i == 5:
            with open(mark, "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            step()
        except Exception as err:
            report["raised_at"] = time.time()
            report["error"] = type(err).__name__
            report["lost"] = getattr(err, "ranks", None)
            report["message"] = str(err)[:500]
            break
    start = time.time()
    try:
        step()
        report["next"] = "no error"
    except Exception as err:
        report["next"] = type(err).__name__
        report["next_lost"] = getattr(err, "ranks", None)
    report["next_s"] = time.time() - start
    # One write: print() writes the line and its newline apart, and a warning from another
    # thread (on the same pipe) could land between them.
    os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
    # Leaving before every survivor has reported could make a slower one name this rank
    # too (rank 0 hosts the store): wait for their marks, as a barrier that needs no peer.
    open(f"{mark}.{r}", "w").close()
    others = [f"{mark}.{q}" for q in range(n) if q != victim]
    end = time.time() + 10
    while time.time() < end and not all(os.path.exists(o) for o in others):
        time.sleep(0.05)
""")

# point: (world size, victim, extra environment)
POINTS = {
    "allreduce": (3, 1, {}),
    "neighbor_allreduce": (3, 2, {}),
    "hierarchical_neighbor_allreduce": (4, 3, {"GOSSAMER_NODES_PER_MACHINE": "2"}),
    "window_put": (3, 2, {}),
    "window_get": (3, 1, {}),
    "window_accumulate_mutex": (3, 2, {}),
    "awc_step": (2, 1, {}),
    "atc_step": (2, 1, {}),
    "gradient_allreduce_step": (2, 1, {}),
    "win_put_step": (2, 1, {}),
    "push_sum_step": (2, 1, {}),
}
UNDER_LAUNCHER = ["allreduce", "window_put"]
_NAMES = list(POINTS)
BATCHES = [_NAMES[0:3], _NAMES[3:6], _NAMES[6:9], _NAMES[9:]]


def _env(extra):
    return {**os.environ, **extra, "GOSSAMER_TIMEOUT": str(TIMEOUT_S), "PYTHONUNBUFFERED": "1"}


def _start(point, tmp_path, script):
    """Start the ranks of ``point`` directly (rank 0 hosts the store); return what to check."""
    world, victim, extra = POINTS[point]
    mark = tmp_path / f"{point}.killed_at"
    env = {
        **_env(extra),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), point, str(victim), str(mark)],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    return procs, mark


def _collect(procs, deadline):
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=max(1.0, deadline - time.time()))[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            outputs.append("HUNG: " + proc.communicate()[0])
    return outputs


def _exit_after(mark, rank, report):
    """Seconds from a survivor's error to its process's end (a thread left waiting on the
    dead rank would hold the exit to the deadline)."""
    ended = mark.with_name(f"{mark.name}.{rank}.exit")
    return float(ended.read_text()) - report["raised_at"] if ended.exists() else float("inf")


def _check_point(point, procs, outputs, mark):
    world, victim, _ = POINTS[point]
    problems = []
    if procs[victim].returncode != -9 or not mark.exists():
        problems.append(f"victim exited {procs[victim].returncode}: {outputs[victim][-2000:]}")
        problems += [f"rank {r}: {out[-1500:]}" for r, out in enumerate(outputs) if r != victim]
        return problems, []
    killed_at = float(mark.read_text())
    delays = []
    for r in range(world):
        if r == victim:
            continue
        out = outputs[r]
        lines = [ln for ln in out.splitlines() if ln.startswith("REPORT ")]
        if procs[r].returncode != 0 or not lines:
            problems.append(f"rank {r} exited {procs[r].returncode}: {out[-3000:]}")
            continue
        report = json.loads(lines[0].removeprefix("REPORT "))
        delay = report["raised_at"] - killed_at
        delays.append(round(delay, 2))
        if report["error"] != "RankLostError" or report["lost"] != [victim]:
            problems.append(f"rank {r}: {report}")
        elif f"rank {victim} was lost" not in report["message"]:
            problems.append(f"rank {r}: message does not name rank {victim}: {report}")
        elif delay > TIMEOUT_S:
            problems.append(f"rank {r} raised {delay:.1f} s after the kill: {report}")
        elif report["next"] != "RankLostError" or report["next_s"] > 1.0:
            problems.append(f"rank {r}: the next call gave {report}")
        elif (late := _exit_after(mark, r, report)) > TIMEOUT_S / 2:
            problems.append(f"rank {r} ended {late:.1f} s after raising")
    return problems, delays


@pytest.mark.parametrize("batch", BATCHES, ids=["+".join(b) for b in BATCHES])
def test_every_survivor_names_the_killed_rank(batch, tmp_path):
    script = tmp_path / "victim.py"
    script.write_text(SCRIPT)
    problems, timings = {}, {}
    # A few jobs side by side: all at once would starve each other of CPU on a small machine.
    started = {point: _start(point, tmp_path, script) for point in batch}
    deadline = time.time() + 3 * TIMEOUT_S + 60
    for point, (procs, mark) in started.items():
        outputs = _collect(procs, deadline)
        found, delays = _check_point(point, procs, outputs, mark)
        timings[point] = delays
        if found:
            problems[point] = found
    print("seconds from the kill to each survivor's RankLostError:", timings)
    assert not problems, json.dumps(problems, indent=1)


@pytest.mark.parametrize("point", UNDER_LAUNCHER)
def test_launcher_names_the_killed_rank(point, tmp_path):
    world, victim, extra = POINTS[point]
    script = tmp_path / "victim.py"
    script.write_text(SCRIPT)
    mark = tmp_path / "killed_at"
    cmd = [sys.executable, "-m", "gossamer.launcher", "run", "-np", str(world), "--tag-output"]
    proc = subprocess.run(
        [*cmd, str(script), point, str(victim), str(mark)],
        env=_env(extra),
        capture_output=True,
        text=True,
        timeout=150,
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 128 + 9, out[-3000:]
    assert f"rank {victim}" in out, out[-3000:]
    assert "SIGKILL" in out or "signal 9" in out, out[-3000:]
