import json
from collections import defaultdict

import pytest
import torch

import gossamer
from gossamer.profiling import timeline
from gossamer.testing import run_distributed

SIZES = [1, 2, 4]
NEIGHBOR_PHASES = {"queued", "running", "communicating", "combining"}
ALLREDUCE_PHASES = {"queued", "running", "communicating"}


def _run_ops():
    gossamer.neighbor_allreduce(torch.ones(4))
    gossamer.allreduce(torch.ones(4))
    handles = [gossamer.neighbor_allreduce(torch.ones(4), async_op=True) for _ in range(3)]
    for handle in handles:
        handle.wait()


def _traced_ops(path, merged):
    timeline.start_timeline(path, merged=merged)
    try:
        _run_ops()
    finally:
        written = timeline.stop_timeline()
    return [str(p) for p in written]


def _traced_ops_from_env():
    # Until gossamer.init() starts it, the timeline is started here (then this returns False).
    timeline.maybe_start_from_env()
    assert timeline.timeline_enabled()
    try:
        _run_ops()
    finally:
        written = timeline.stop_timeline()
    return [str(p) for p in written]


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)["traceEvents"]


def phases_by_rank(events):
    """``{pid: {row: set of activities}}``, rows "op (2)" folded into "op"; checks metadata."""
    processes, rows = {}, {}
    found = defaultdict(lambda: defaultdict(set))
    for e in events:
        if e["name"] == "process_name":
            processes[e["pid"]] = e["args"]["name"]
        elif e["name"] == "thread_name":
            rows[e["pid"], e["tid"]] = e["args"]["name"].split(" (")[0]
    for e in events:
        if e["ph"] == "X":
            assert e["ts"] >= 0 and e["dur"] >= 0
            found[e["pid"]][rows[e["pid"], e["tid"]]].add(e["name"])
    assert processes == {pid: f"rank {pid}" for pid in found}
    return found


def check_ops(found, world_size):
    assert sorted(found) == list(range(world_size))
    for pid in range(world_size):
        assert found[pid]["neighbor_allreduce"] == NEIGHBOR_PHASES
        assert found[pid]["allreduce"] == ALLREDUCE_PHASES


@pytest.mark.parametrize("world_size", SIZES)
def test_per_rank_files_hold_every_phase(tmp_path, world_size):
    written = run_distributed(_traced_ops, world_size, args=(str(tmp_path / "trace"), False))
    files = [tmp_path / f"trace.rank{r}.json" for r in range(world_size)]
    assert written == [[str(f)] for f in files]
    for rank, path in enumerate(files):
        found = phases_by_rank(load(path))
        assert sorted(found) == [rank]
        assert found[rank]["neighbor_allreduce"] == NEIGHBOR_PHASES
        assert found[rank]["allreduce"] == ALLREDUCE_PHASES
    # The per-rank files merge into one afterwards, as merged=True would have written.
    merged = timeline.merge_traces(files, tmp_path / "merged.json")
    check_ops(phases_by_rank(load(merged)), world_size)


@pytest.mark.parametrize("world_size", SIZES)
def test_merged_file_on_rank_zero_holds_every_rank(tmp_path, world_size):
    written = run_distributed(_traced_ops, world_size, args=(str(tmp_path / "trace"), True))
    assert written == [[str(tmp_path / "trace.json")]] + [[]] * (world_size - 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["trace.json"]
    check_ops(phases_by_rank(load(tmp_path / "trace.json")), world_size)


def test_gossamer_timeline_variable_names_the_files(tmp_path):
    world_size = 2
    prefix = str(tmp_path / "{rank}" / "trace.json")
    written = run_distributed(_traced_ops_from_env, world_size, env={"GOSSAMER_TIMELINE": prefix})
    files = [tmp_path / str(r) / "trace.json" for r in range(world_size)]
    assert written == [[str(f)] for f in files]
    check_ops(phases_by_rank(load(timeline.merge_traces(files, tmp_path / "m.json"))), world_size)
