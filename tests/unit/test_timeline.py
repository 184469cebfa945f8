import ast
import json
import pathlib
import subprocess
import sys
import threading
from collections import defaultdict

import pytest

import gossamer.profiling
from gossamer.profiling import session, spans, timeline, trace

# The timeline is process-wide: one test left tracing would record into the next.
pytestmark = pytest.mark.usefixtures("timeline_off")


def load(path):
    with open(path, encoding="utf-8") as f:
        document = json.load(f)
    assert set(document) >= {"traceEvents", "otherData"}
    return document["traceEvents"]


def check_well_formed(events):
    """Metadata names every pid and tid; per tid, spans come in time order and nest."""
    processes, rows = {}, {}
    spans = defaultdict(list)
    for event in events:
        assert {"name", "ph", "pid", "tid"} <= set(event)
        assert isinstance(event["pid"], int) and isinstance(event["tid"], int)
        if event["ph"] == "M":
            if event["name"] == "process_name":
                processes[event["pid"]] = event["args"]["name"]
            elif event["name"] == "thread_name":
                rows[event["pid"], event["tid"]] = event["args"]["name"]
            continue
        assert event["ph"] == "X"
        assert event["ts"] >= 0 and event["dur"] >= 0
        spans[event["pid"], event["tid"]].append(event)
    for key, track in spans.items():
        assert key[0] in processes, f"pid {key[0]} has no process_name"
        assert key in rows, f"tid {key} has no thread_name"
        starts = [e["ts"] for e in track]
        assert starts == sorted(starts), f"ts not monotonic on {rows[key]}"
        # The Chrome viewer draws a track right only if its spans nest (a matched B/E stack).
        stack = []
        for e in track:
            end = e["ts"] + e["dur"]
            while stack and stack[-1] <= e["ts"] + 1e-6:
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, f"{e} overlaps its parent"
            stack.append(end)
    by_row = defaultdict(list)
    for key, track in spans.items():
        by_row[processes[key[0]], rows[key]] += [e["name"] for e in track]
    return dict(by_row)


def test_activities_from_two_threads_make_a_well_formed_trace(tmp_path):
    timeline.start_timeline(tmp_path / "trace")
    assert timeline.timeline_enabled()
    barrier = threading.Barrier(2)

    def work(name):
        barrier.wait()
        for _ in range(50):
            with timeline.activity(name, "outer"):
                timeline.start_activity(name, "inner")
                timeline.end_activity(name)
            with timeline.activity("shared", name):
                pass

    threads = [threading.Thread(target=work, args=(f"thread{i}",)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    written = timeline.stop_timeline()
    assert written == [tmp_path / "trace.rank0.json"]
    assert not timeline.timeline_enabled()
    rows = check_well_formed(load(written[0]))
    assert sorted(rows[("rank 0", "thread0")]) == ["inner"] * 50 + ["outer"] * 50
    assert sorted(rows[("rank 0", "thread1")]) == ["inner"] * 50 + ["outer"] * 50
    # Both threads wrote row "shared"; overlapping spans, if any, moved to "shared (2)".
    shared = [n for (_, row), names in rows.items() if row.startswith("shared") for n in names]
    assert sorted(shared) == ["thread0"] * 50 + ["thread1"] * 50


def test_metadata_names_rank_and_rows_in_order_of_first_appearance(tmp_path):
    timeline.start_timeline(tmp_path / "trace.json")
    with timeline.activity("first", "a"):
        pass
    with timeline.activity("second", "b"):
        pass
    (path,) = timeline.stop_timeline()
    assert path == tmp_path / "trace.rank0.json"
    meta = [e for e in load(path) if e["ph"] == "M"]
    assert {
        "name": "process_name",
        "ph": "M",
        "pid": 0,
        "tid": 0,
        "args": {"name": "rank 0"},
    } in meta
    threads = [(e["tid"], e["args"]["name"]) for e in meta if e["name"] == "thread_name"]
    assert threads == [(1, "first"), (2, "second")]


def test_overlapping_spans_of_one_row_are_spread_over_tracks(tmp_path):
    timeline.start_timeline(tmp_path / "t")
    # Both queued at once: the second's "queued" overlaps the first's "running".
    first = timeline.traced("neighbor_allreduce", lambda: 1)
    second = timeline.traced("neighbor_allreduce", lambda: 2)
    assert first() == 1 and second() == 2
    (path,) = timeline.stop_timeline()
    rows = check_well_formed(load(path))
    assert rows[("rank 0", "neighbor_allreduce")] == ["queued", "running", "running"]
    assert rows[("rank 0", "neighbor_allreduce (2)")] == ["queued"]


def test_record_with_no_name_uses_the_operation_being_run(tmp_path):
    timeline.start_timeline(tmp_path / "t")

    def body():
        with timeline.record("allreduce", "communicating"):
            pass
        with timeline.record(None, "combining"):
            pass

    timeline.traced("allreduce", body)()
    with timeline.record(None, "combining"):  # outside any operation
        pass
    (path,) = timeline.stop_timeline()
    rows = check_well_formed(load(path))
    assert rows[("rank 0", "allreduce")] == ["queued", "running", "communicating", "combining"]
    assert rows[("rank 0", "gossamer")] == ["combining"]


def test_a_failing_block_is_recorded_with_its_error(tmp_path):
    timeline.start_timeline(tmp_path / "t")
    with pytest.raises(KeyError), timeline.activity("x", "lookup"):
        raise KeyError("k")
    with pytest.raises(ZeroDivisionError):
        timeline.traced("op", lambda: 1 / 0)()
    (path,) = timeline.stop_timeline()
    errors = {e["name"]: e.get("args") for e in load(path) if e["ph"] == "X"}
    assert errors == {
        "lookup": {"error": "KeyError"},
        "queued": None,
        "running": {"error": "ZeroDivisionError"},
    }


def test_off_records_nothing_and_writes_no_file(tmp_path):
    assert not timeline.timeline_enabled()
    # Off: the shared no-op context manager, the job itself, no buffer growth.
    assert timeline.record("op", "queued") is timeline.record(None, "combining")
    assert timeline.activity("a", "b") is timeline.record("op", "queued")

    def job():
        return 3

    assert timeline.traced("op", job) is job
    for _ in range(1000):
        with timeline.record("op", "communicating"), timeline.activity("a", "b"):
            timeline.start_activity("a", "c")
            timeline.end_activity("a")
    assert spans._events == []
    assert spans._open == {}
    assert timeline.stop_timeline() == []
    assert list(tmp_path.iterdir()) == []


def test_unended_activities_are_closed_at_stop_and_unmatched_ends_ignored(tmp_path):
    timeline.end_activity("never-started")  # off: nothing
    timeline.start_activity("early", "x")  # off: nothing
    timeline.start_timeline(tmp_path / "t")
    timeline.end_activity("early")  # started while off: ignored
    timeline.start_activity("late", "open")
    (path,) = timeline.stop_timeline()
    spans = [e for e in load(path) if e["ph"] == "X"]
    assert [(e["name"], e["args"]) for e in spans] == [("open", {"error": "not ended"})]


def test_a_span_open_across_a_restart_is_not_carried_into_the_next_trace(tmp_path):
    timeline.start_timeline(tmp_path / "a")
    block = timeline.activity("row", "crossing")
    block.__enter__()
    timeline.stop_timeline()
    timeline.start_timeline(tmp_path / "b")
    block.__exit__(None, None, None)
    (path,) = timeline.stop_timeline()
    assert [e for e in load(path) if e["ph"] == "X"] == []


def test_starting_twice_and_bad_arguments_raise(tmp_path):
    with pytest.raises(TypeError, match="path"):
        timeline.start_timeline(42)
    with pytest.raises(ValueError, match="path"):
        timeline.start_timeline("")
    with pytest.raises(TypeError, match="merged"):
        timeline.start_timeline(tmp_path / "t", merged=1)
    timeline.start_timeline(tmp_path / "t")
    with pytest.raises(RuntimeError, match="already on"):
        timeline.start_timeline(tmp_path / "u")


@pytest.mark.parametrize(
    ("path", "rank_file", "merged_file"),
    [
        ("out/trace", "out/trace.rank3.json", "out/trace.json"),
        ("out/trace.json", "out/trace.rank3.json", "out/trace.json"),
        ("out/{rank}/t.json", "out/3/t.json", "out/all/t.json"),
        ("out/", "out/timeline.rank3.json", "out/timeline.json"),
    ],
)
def test_file_names(path, rank_file, merged_file):
    assert str(trace._rank_file(path, 3)) == rank_file
    assert str(trace._merged_file(path)) == merged_file


def test_merged_in_a_single_process_writes_one_file(tmp_path):
    with timeline.tracing(tmp_path / "{rank}.json", merged=True), timeline.activity("a", "b"):
        pass
    assert sorted(p.name for p in tmp_path.iterdir()) == ["all.json"]
    rows = check_well_formed(load(tmp_path / "all.json"))
    assert rows == {("rank 0", "a"): ["b"]}


def write_rank_trace(path, rank, origin_ns, spans):
    events = trace._render(spans, rank, 0)
    trace._write(path, trace._document(events, {rank: origin_ns}))


def test_merge_traces_aligns_the_ranks_clocks(tmp_path):
    # Rank 1 started its timeline 2 ms after rank 0; both ran an op at the same wall time.
    write_rank_trace(
        tmp_path / "r0.json", 0, 10_000_000, [("op", "running", 3_000_000, 4_000_000, None)]
    )
    write_rank_trace(
        tmp_path / "r1.json", 1, 12_000_000, [("op", "running", 1_000_000, 2_000_000, None)]
    )
    out = timeline.merge_traces([tmp_path / "r1.json", tmp_path / "r0.json"], tmp_path / "m.json")
    events = load(out)
    check_well_formed(events)
    spans = {e["pid"]: e for e in events if e["ph"] == "X"}
    assert spans[0]["ts"] == spans[1]["ts"] == 3000.0
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1"}
    with pytest.raises(ValueError, match="not a per-rank trace"):
        timeline.merge_traces([out], tmp_path / "again.json")


def test_maybe_start_from_env(tmp_path, monkeypatch):
    monkeypatch.delenv("GOSSAMER_TIMELINE", raising=False)
    assert not timeline.maybe_start_from_env()
    monkeypatch.setenv("GOSSAMER_TIMELINE", "")
    assert not timeline.maybe_start_from_env()
    assert not timeline.timeline_enabled()
    monkeypatch.setenv("GOSSAMER_TIMELINE", str(tmp_path / "env"))
    assert timeline.maybe_start_from_env()
    assert not timeline.maybe_start_from_env()  # already on: left alone
    with timeline.activity("x", "y"):
        pass
    assert timeline.stop_timeline() == [tmp_path / "env.rank0.json"]


def test_a_timeline_left_on_is_written_at_exit(tmp_path):
    code = (
        "import sys; from gossamer.profiling import timeline as t; "
        "t.start_timeline(sys.argv[1]); t.start_activity('row', 'open'); "
        "t.activity('row', 'closed').__enter__()"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "exit")], check=True, timeout=120)
    rows = check_well_formed(load(tmp_path / "exit.rank0.json"))
    assert rows == {("rank 0", "row"): ["open"]}


def test_attach_names_the_rank_and_gathers_the_merged_trace(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_world", session._World())  # restored after the test
    gossamer.profiling.attach(3, 4)
    with timeline.tracing(tmp_path / "a"), timeline.activity("x", "y"):
        pass
    assert [p.name for p in tmp_path.iterdir()] == ["a.rank3.json"]

    sent = []

    def gather_on_rank_zero(part):
        sent.append(part)
        other = (1, part[1] + 1000, trace._render([("x", "z", 5, 6, None)], 1, 0))
        return [part, other]

    gossamer.profiling.attach(0, 2, gather_on_rank_zero)
    with timeline.tracing(tmp_path / "m", merged=True), timeline.activity("x", "y"):
        pass
    assert [part[0] for part in sent] == [0]
    assert sorted(check_well_formed(load(tmp_path / "m.json"))) == [
        ("rank 0", "x"),
        ("rank 1", "x"),
    ]

    gossamer.profiling.attach(1, 2, lambda part: None)  # not rank 0: nothing to write
    timeline.start_timeline(tmp_path / "n", merged=True)
    assert timeline.stop_timeline() == []

    # Detached (after shutdown): no gather, but the rank still names the files.
    gossamer.profiling.detach()
    timeline.start_timeline(tmp_path / "d", merged=True)
    assert timeline.stop_timeline() == [tmp_path / "d.json"]
    timeline.start_timeline(tmp_path / "d")
    assert timeline.stop_timeline() == [tmp_path / "d.rank1.json"]
    with pytest.raises(ValueError, match="rank"):
        gossamer.profiling.attach(2, 2)


ALLOWED_GOSSAMER_IMPORTS = ("gossamer.env", "gossamer.errors", "gossamer.profiling")


def _imported_modules(path, package):
    """Every module an ``import`` or ``from ... import`` in ``path`` names, resolved."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: "." is the package, ".." its parent
                parent = package.rsplit(".", node.level - 1)[0]
                base = f"{parent}.{base}" if base else parent
            # "from gossamer import context" imports gossamer.context, not just gossamer.
            yield from (f"{base}.{alias.name}" for alias in node.names)


def test_the_import_check_sees_every_kind_of_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import gossamer.ops\nfrom gossamer import context\nfrom .. import topology\n"
        "from .spans import record\n\ndef lazy():\n    from gossamer.env import settings\n"
    )
    assert list(_imported_modules(probe, "gossamer.profiling")) == [
        "gossamer.ops",
        "gossamer.context",
        "gossamer.topology",
        "gossamer.profiling.spans.record",
        "gossamer.env.settings",
    ]


def test_profiling_imports_no_other_part_of_gossamer():
    root = pathlib.Path(gossamer.profiling.__file__).parent
    modules = sorted(root.rglob("*.py"))
    assert {m.name for m in modules} >= {"__init__.py", "spans.py", "trace.py", "session.py"}
    wrong = [
        f"{path.relative_to(root)}: {name}"
        for path in modules
        for name in _imported_modules(
            path, ".".join(("gossamer.profiling", *path.relative_to(root).parent.parts))
        )
        if name.split(".")[0] == "gossamer"
        and not any(name == ok or name.startswith(f"{ok}.") for ok in ALLOWED_GOSSAMER_IMPORTS)
    ]
    assert wrong == []
