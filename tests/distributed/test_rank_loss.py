"""A rank killed in the middle of an operation: every survivor raises RankLostError naming it.

Each case starts its own processes (a killed rank would break the shared pool): the ranks
loop on one operation until the victim kills itself (SIGKILL, no clean-up). A survivor
next to the victim sees gloo's connection error; one that is not (a ring neighbour's
neighbour, the other machine of a hierarchical call) waits on a survivor that already
failed, and must not wait for the deadline: the heartbeats tell it who died. Every
survivor must also fail at once on its next call, and exit normally.
"""

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

from gossamer.testing import free_port

SCRIPT = textwrap.dedent(r"""
    import json, os, signal, sys, time, torch, gossamer
    from gossamer import topology as topo

    op, victim, mark = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    gossamer.init()
    r, n = gossamer.rank(), gossamer.size()
    if op == "hierarchical_neighbor_allreduce":
        gossamer.set_machine_topology(topo.fully_connected(gossamer.machine_size()))
    x = torch.ones(20_000)
    calls = {
        "allreduce": lambda: gossamer.allreduce(x),
        # a ring: some survivors exchange only with other survivors
        "neighbor_allreduce": lambda: gossamer.neighbor_allreduce(x, topology=topo.ring(n)),
        "hierarchical_neighbor_allreduce": lambda: gossamer.hierarchical_neighbor_allreduce(x),
    }
    report = {"rank": r}
    for i in range(100_000):
        if r == victim and i == 5:
            with open(mark, "w") as f:
                f.write(str(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            calls[op]()
        except Exception as err:
            report["raised_at"] = time.time()
            report["error"] = type(err).__name__
            report["lost"] = getattr(err, "ranks", None)
            report["message"] = str(err)
            break
    start = time.time()
    try:
        calls[op]()
        report["next"] = "no error"
    except Exception as err:
        report["next"] = type(err).__name__
        report["next_lost"] = getattr(err, "ranks", None)
    report["next_s"] = time.time() - start
    # One write: print() writes the line and its newline apart, and a warning from another
    # thread (on the same pipe) could land between them.
    os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
""")


# world size, victim, environment. Rank 0 hosts the rendezvous store here (no torchrun agent):
# killing it takes the heartbeats' store with it, which names it too.
CASES = {
    "allreduce": (3, 0, {}),
    "neighbor_allreduce": (4, 2, {}),
    "hierarchical_neighbor_allreduce": (4, 3, {"GOSSAMER_NODES_PER_MACHINE": "2"}),
}


def _launch(tmp_path, script_text, world, args, extra):
    """Run ``script_text`` as ``world`` ranks; return each rank's process and output."""
    script = tmp_path / "victim.py"
    script.write_text(script_text)
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": str(world),
        # the deadline the survivors must beat, by far; the test fails on a hang long before
        "GOSSAMER_TIMEOUT": "60",
        **extra,
    }
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), *args],
            env={**env, "RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = {}
    for r, proc in enumerate(procs):
        try:
            outputs[r], _ = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"rank {r} hung: {proc.communicate()[0]}")
    return procs, outputs


def _report(output):
    lines = [ln for ln in output.splitlines() if ln.startswith("REPORT ")]
    assert lines, output
    return json.loads(lines[0].removeprefix("REPORT "))


@pytest.mark.parametrize("op", sorted(CASES))
def test_survivors_name_the_killed_rank(op, tmp_path):
    world, victim, extra = CASES[op]
    mark = tmp_path / "killed_at"
    procs, outputs = _launch(tmp_path, SCRIPT, world, [op, str(victim), str(mark)], extra)
    exited_at = time.time()
    assert procs[victim].returncode == -9
    killed_at = float(mark.read_text())
    delays = []
    for r in range(world):
        if r == victim:
            continue
        assert procs[r].returncode == 0, outputs[r]  # raised, then exited normally
        report = _report(outputs[r])
        assert report["error"] == "RankLostError", report
        assert report["lost"] == [victim], report
        assert f"rank {victim} was lost" in report["message"], report
        assert report["next"] == "RankLostError" and report["next_lost"] == [victim], report
        assert report["next_s"] < 1.0, report
        delays.append(report["raised_at"] - killed_at)
    # the deadline is 60 s: every survivor named the victim well before it
    assert max(delays) < 20.0, delays
    print(f"{op}: survivors raised {[round(d, 2) for d in delays]} s after the kill")
    assert exited_at - killed_at < 120


LEAVER = textwrap.dedent(r"""
    import json, os, signal, sys, torch, gossamer

    gossamer.init()
    rank = gossamer.rank()
    if rank != 0 and sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)  # dies before its first call: no clean-up
    if rank == 1:
        gossamer.shutdown()  # leaves before the call its peers make
    if rank != 0:
        sys.exit(0)  # rank 2 leaves by the program's end (shutdown at exit)
    report = {}
    for op in ("neighbor_allreduce", "allreduce"):
        try:
            getattr(gossamer, op)(torch.ones(3))
            report[op] = "no error"
        except Exception as err:
            report[op] = [type(err).__name__, getattr(err, "ranks", None), str(err)]
    os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
""")


@pytest.mark.parametrize("how", ["leave", "kill"])
def test_ranks_gone_before_their_first_call_are_named(how, tmp_path):
    # Ranks that left by shutdown() mark it in the store: the call that finds their
    # connections closed names them at once. Ranks killed before any call are found by
    # their processes, which have ended (ranks of one machine). Either way the heartbeats
    # alone would take GOSSAMER_DEAD_AFTER, here longer than the deadline.
    extra = {"GOSSAMER_DEAD_AFTER": "600"}
    procs, outputs = _launch(tmp_path, LEAVER, 3, [how], extra)
    codes = [0, 0, 0] if how == "leave" else [0, -9, -9]
    assert [p.returncode for p in procs] == codes, outputs
    report = _report(outputs[0])
    for op in ("neighbor_allreduce", "allreduce"):
        kind, ranks, message = report[op]
        assert kind == "RankLostError" and ranks == [1, 2], report
        assert message.startswith(f"{op}: ranks [1, 2] were lost"), report


HANGER = textwrap.dedent(r"""
    import json, os, time, torch, gossamer

    gossamer.init()
    if gossamer.rank() == 1:
        time.sleep(12)  # hangs outside gossamer, alive: its heartbeat goes on
    else:
        try:
            gossamer.allreduce(torch.ones(3))
        except Exception as err:
            report = [type(err).__name__, str(err)]
            os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
""")


def test_a_timeout_tells_which_rank_hung_outside_gossamer(tmp_path):
    _, outputs = _launch(tmp_path, HANGER, 3, [], {"GOSSAMER_TIMEOUT": "4"})
    for r, other in ((0, 2), (2, 0)):
        kind, message = _report(outputs[r])
        assert kind == "CommunicationTimeout", message
        assert message.endswith(
            "waiting for all ranks (at their last heartbeat: rank 1 in no gossamer "
            f"operation; rank {other} waiting in allreduce)"
        ), message


STARVED = textwrap.dedent(r"""
    import ctypes, json, os, torch, gossamer

    gossamer.init()
    if gossamer.rank() == 1:
        # libc's sleep called with the GIL held: the heartbeat thread cannot beat for 4 s,
        # as behind a long C call on a machine with more busy processes than cores
        ctypes.PyDLL(None).sleep(4)
    try:
        report = gossamer.allreduce(torch.ones(3), average=False).tolist()
    except Exception as err:
        report = [type(err).__name__, str(err)]
    os.write(1, ("REPORT " + json.dumps(report) + "\n").encode())
""")


def test_a_live_rank_whose_heartbeat_stands_still_is_waited_for(tmp_path):
    # GOSSAMER_DEAD_AFTER=1: rank 1's counter stands still 4 times that long, but its
    # process runs on this machine, so its peers wait for it instead of declaring it lost.
    procs, outputs = _launch(tmp_path, STARVED, 3, [], {"GOSSAMER_DEAD_AFTER": "1"})
    assert [p.returncode for p in procs] == [0, 0, 0], outputs
    assert [_report(outputs[r]) for r in range(3)] == [[3.0, 3.0, 3.0]] * 3, outputs
