"""bf.timeline_*: False and one error while off; spans in the trace while on; optimizer hooks."""

import json
import logging
import os
import pathlib
import subprocess
import sys

import pytest
import torch
from torch import nn

import gossamer
import gossamer.bluefog as bf
from gossamer.bluefog import timeline as bf_timeline
from gossamer.profiling import timeline
from gossamer.testing import run_distributed

# The timeline is process-wide: one test left tracing would record into the next.
pytestmark = pytest.mark.usefixtures("timeline_off")


def spans(path):
    """{row name: [activity labels]} of a trace file."""
    with open(path, encoding="utf-8") as f:
        events = json.load(f)["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    out = {}
    for e in events:
        if e["ph"] == "X":
            out.setdefault(rows[e["tid"]], []).append(e["name"])
    return out


def test_off_returns_false_and_logs_one_error(caplog):
    assert not timeline.timeline_enabled()
    bf_timeline._complained[0] = False
    with caplog.at_level(logging.ERROR, logger="gossamer.bluefog"):
        assert bf.timeline_start_activity("x", "A") is False
        assert bf.timeline_end_activity("x") is False
        with bf.timeline_context("x", "B"):
            pass
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "GOSSAMER_TIMELINE" in errors[0].getMessage()


def test_on_records_the_activities(tmp_path):
    timeline.start_timeline(tmp_path / "trace")
    assert bf.timeline_start_activity("batch", "LOAD") is True
    assert bf.timeline_end_activity("batch") is True
    with bf.timeline_context("model", "FORWARD"):
        pass
    with pytest.raises(RuntimeError), bf.timeline_context("model", "BACKWARD"):
        raise RuntimeError("the activity still ends")
    (path,) = timeline.stop_timeline()
    assert spans(path) == {"batch": ["LOAD"], "model": ["FORWARD", "BACKWARD"]}


def _optimizer_activities(prefix):
    bf.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))
    timeline.start_timeline(prefix)
    try:
        opt = bf.DistributedAdaptWithCombineOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model
        )  # the timeline is on: the hooks are on
        x = torch.randn(2, 3)
        for _ in range(2):
            opt.zero_grad()
            model(x).sum().backward()
            opt.step()
        opt.turn_off_timeline()
        model(x).sum().backward()  # not recorded
        opt.step()
    finally:
        (path,) = timeline.stop_timeline()
    for hook in opt._hooks:
        hook.remove()
    return str(path)


def test_optimizer_records_forward_and_gradient_activities(tmp_path):
    paths = run_distributed(_optimizer_activities, 2, args=(str(tmp_path / "trace"),))
    assert len(set(paths)) == 2
    for path in paths:
        rows = spans(path)
        for name in ("0.weight", "0.bias", "2.weight", "2.bias"):
            assert rows[name] == ["FORWARD", "GRADIENT COMPT."] * 2, name
        assert "neighbor_allreduce" in rows  # the core's own spans are there too


# ---------------------------------------------------------------------- BLUEFOG_TIMELINE
def _bluefog_program():
    """What a BlueFog program run with BLUEFOG_TIMELINE does."""
    bf.init()
    bf.init()  # programs call init many times: the timeline is started once
    assert timeline.timeline_enabled()
    torch.manual_seed(bf.rank())
    model = nn.Sequential(nn.Linear(3, 2))
    opt = bf.DistributedAdaptWithCombineOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model
    )
    x = torch.randn(4, 3)
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    opt.turn_off_timeline()
    for hook in opt._hooks:
        hook.remove()
    value = torch.ones(3) * bf.rank()
    bf.neighbor_allreduce(value, name="x")
    bf.synchronize(bf.neighbor_allreduce_nonblocking(value))
    bf.allreduce(value)
    bf.win_create(value.clone(), "win")
    bf.win_put(value, "win")
    bf.win_free("win")
    with bf.timeline_context("batch", "LOAD"):
        pass
    bf_timeline.stop_started_from_env()  # what bf.shutdown() does
    assert not timeline.timeline_enabled()


def test_bluefog_timeline_writes_bluefogs_files_with_bluefogs_activities(tmp_path):
    prefix = tmp_path / "out" / "bf_trace_"
    run_distributed(_bluefog_program, 2, env={"BLUEFOG_TIMELINE": str(prefix)})
    expected = [f"{prefix}0.json", f"{prefix}1.json"]
    assert sorted(map(str, prefix.parent.iterdir())) == expected  # BlueFog's: <prefix><rank>.json
    for path in expected:
        rows = spans(path)
        assert rows["0.weight"] == rows["0.bias"] == ["FORWARD", "GRADIENT COMPT."]
        assert rows["neighbor.allreduce.x"] == ["ENQUEUE_NEIGHBOR_ALLREDUCE"]
        nonames = [r for r in rows if r.startswith("neighbor.allreduce.noname.")]
        assert [rows[r] for r in nonames] == [["ENQUEUE_NEIGHBOR_ALLREDUCE"]]
        assert any(r.startswith("allreduce.noname.") for r in rows)
        assert rows["win"] == ["WIN_CREATE", "ENQUEUE_WIN_PUT"]
        assert rows["batch"] == ["LOAD"]
        assert "neighbor_allreduce" in rows  # gossamer's own spans are kept beside them


def test_gossamer_timeline_wins_over_bluefog_timeline(tmp_path):
    env = {
        "BLUEFOG_TIMELINE": str(tmp_path / "bf_"),
        "GOSSAMER_TIMELINE": str(tmp_path / "gs"),
    }
    run_distributed(_start_and_stop, 2, env=env)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gs.rank0.json", "gs.rank1.json"]


@pytest.mark.parametrize(
    ("prefix", "written"),
    [("out/", "out/0.json"), ("run.", "run.0.json"), ("a/b_", "a/b_0.json")],
)
def test_bluefog_prefix_is_taken_as_bluefog_takes_it(tmp_path, monkeypatch, prefix, written):
    # Relative to the working directory at init, where BlueFog opened its file.
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("BLUEFOG_TIMELINE", prefix)
    monkeypatch.delenv("GOSSAMER_TIMELINE", raising=False)
    assert bf_timeline.start_from_env() is True
    monkeypatch.chdir(tmp_path.parent)
    bf_timeline.stop_started_from_env()
    assert [str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*.json")] == [written]


def test_bluefog_timeline_unset_starts_nothing(monkeypatch):
    monkeypatch.delenv("BLUEFOG_TIMELINE", raising=False)
    assert bf_timeline.start_from_env() is False
    assert not timeline.timeline_enabled()


def _start_and_stop():
    bf.init()
    timeline.stop_timeline()


BLUEFOG_SCRIPT = """
import torch
import gossamer.bluefog as bf

bf.init()
bf.neighbor_allreduce(torch.ones(2) * bf.rank(), name="x")
"""


@pytest.mark.slow
def test_bluefog_timeline_of_a_launched_program_is_written_at_exit(tmp_path):
    script = tmp_path / "program.py"
    script.write_text(BLUEFOG_SCRIPT)
    # The ranks run in tmp_path: they must import this gossamer, not an installed one.
    source = str(pathlib.Path(gossamer.__file__).parents[1])
    path = os.pathsep.join([source, *filter(None, [os.environ.get("PYTHONPATH")])])
    env = {**os.environ, "PYTHONPATH": path, "BLUEFOG_TIMELINE": "trace_"}  # relative
    env.pop("GOSSAMER_TIMELINE", None)
    done = subprocess.run(
        [sys.executable, "-m", "gossamer.launcher", "run", "-np", "2", str(script)],
        capture_output=True,
        text=True,
        env=env,
        timeout=180,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    for rank in (0, 1):
        rows = spans(tmp_path / f"trace_{rank}.json")
        assert rows["neighbor.allreduce.x"] == ["ENQUEUE_NEIGHBOR_ALLREDUCE"]
