import json
import os
import warnings
from collections import defaultdict

import pytest
import torch

import gossamer
from gossamer.errors import PeerError
from gossamer.profiling import timeline
from gossamer.testing import run_distributed
from traces import check_nesting_exact

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


def _many_traced_ops(path, rounds):
    with timeline.tracing(path, merged=True):
        for _ in range(rounds):
            gossamer.allreduce(torch.ones(4))
            gossamer.neighbor_allreduce(torch.ones(4))


@pytest.mark.parametrize("world_size", [2, 3])
def test_merged_spans_nest_exactly_as_in_per_rank_files(tmp_path, world_size):
    # Ranks > 0 are shifted onto rank 0's clock: a float shift added to ts alone left about
    # 3 % of back-to-back spans ("queued" then "running") overlapping by a rounding error.
    rounds = 100
    run_distributed(_many_traced_ops, world_size, args=(str(tmp_path / "trace"), rounds))
    spans = check_nesting_exact(tmp_path / "trace.json")
    assert spans >= world_size * rounds * (len(ALLREDUCE_PHASES) + len(NEIGHBOR_PHASES))


def _merged_stop_after_shutdown(path):
    rank = gossamer.rank()
    timeline.start_timeline(path, merged=True)
    with timeline.activity("user", f"work of rank {rank}"):
        gossamer.allreduce(torch.ones(2))
    gossamer.shutdown()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        written = timeline.stop_timeline()
    return [str(p) for p in written], [str(w.message) for w in caught]


@pytest.mark.parametrize("world_size", [2, 3])
def test_merged_stop_after_shutdown_writes_per_rank_files(tmp_path, world_size):
    # gossamer.shutdown() leaves this pool's ranks uninitialized: run on fresh ranks, which
    # run_distributed starts for a call where a rank may die (none does) and stops after.
    results = run_distributed(
        _merged_stop_after_shutdown,
        world_size,
        args=(str(tmp_path / "trace"),),
        dies=[world_size - 1],
    )
    files = [tmp_path / f"trace.rank{r}.json" for r in range(world_size)]
    assert [written for written, _ in results] == [[str(f)] for f in files]
    for rank, (_, messages) in enumerate(results):
        assert len(messages) == 1
        assert f"after gossamer.shutdown() on rank {rank} of {world_size}" in messages[0]
        assert "needs a live runtime" in messages[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f.name for f in files)
    for rank, path in enumerate(files):  # each rank's own spans, none overwritten
        user = [e for e in load(path) if e["ph"] == "X" and e["name"].startswith("work")]
        assert [(e["pid"], e["name"]) for e in user] == [(rank, f"work of rank {rank}")]


def _merged_stop_with_a_peer_gone(path):
    rank, last = gossamer.rank(), gossamer.size() - 1
    gossamer.barrier()
    timeline.start_timeline(path, merged=True)
    with timeline.activity("user", f"work of rank {rank}"):
        gossamer.allreduce(torch.ones(2))
    if rank == last:
        os._exit(0)  # never joins the collective stop, and writes nothing
    try:
        timeline.stop_timeline()
    except PeerError as err:
        return type(err).__name__, str(err), repr(err.__cause__), timeline.timeline_enabled()
    return None


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_failed_merged_stop_keeps_each_ranks_spans(tmp_path, world_size):
    last = world_size - 1
    results = run_distributed(
        _merged_stop_with_a_peer_gone,
        world_size,
        args=(str(tmp_path / "trace"),),
        dies=[last],
        timeout=120,
    )
    assert results[last] is None
    for rank, result in enumerate(results[:last]):
        assert result is not None, f"rank {rank}: the merged stop did not fail"
        kind, message, cause, still_on = result
        assert kind in ("PeerError", "CommunicationTimeout")
        assert message.startswith(f"stop_timeline(merged=True) on rank {rank} of {world_size}")
        assert str(tmp_path / f"trace.rank{rank}.json") in message
        assert cause != "None" and not still_on
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"trace.rank{r}.json" for r in range(last)
    ]
    for rank in range(last):
        user = [
            e for e in load(tmp_path / f"trace.rank{rank}.json") if e["name"].startswith("work")
        ]
        assert [(e["pid"], e["name"]) for e in user] == [(rank, f"work of rank {rank}")]
