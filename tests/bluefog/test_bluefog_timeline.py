"""bf.timeline_*: False and one error while off; spans in the trace while on; optimizer hooks."""

import json
import logging

import pytest
import torch
from torch import nn

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
