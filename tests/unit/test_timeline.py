import ast
import importlib
import json
import pathlib
import re
import subprocess
import sys
import threading
import warnings
from collections import defaultdict

import pytest

import gossamer.profiling
from gossamer.errors import CommunicationTimeout, PeerError
from gossamer.profiling import counters, session, spans, timeline, trace
from gossamer.transport import HEADER_LEN
from traces import check_nesting_exact

ROOT = pathlib.Path(__file__).resolve().parents[2]

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
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"path: cannot make the folder of .*file/sub/t"):
        timeline.start_timeline(tmp_path / "file" / "sub" / "t")
    (tmp_path / "d.rank0.json").mkdir()
    with pytest.raises(ValueError, match=r"path: .*d\.rank0\.json' is a directory"):
        timeline.start_timeline(tmp_path / "d")
    assert not timeline.timeline_enabled()
    for call in (
        lambda: timeline.start_activity(3, "x"),
        lambda: timeline.start_activity("row", None),
        lambda: timeline.end_activity(3),
        lambda: timeline.activity(1, "x"),
        lambda: timeline.activity("row", 2),
    ):
        with pytest.raises(TypeError, match=r"(name|activity) must be a str; got"):
            call()
    with pytest.raises(TypeError, match="op must be a str or None; got 5"):
        counters.bytes_sent(5)
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


def test_merging_shifts_spans_without_rounding_them_apart(tmp_path):
    # Rank 1 started 2000123 ns after rank 0. Its "queued" ends at the very ns its "running"
    # begins; a float shift added to ts alone once rounded the first to end 1e-10 us after.
    write_rank_trace(
        tmp_path / "r0.json", 0, 10_000_000_000, [("op", "running", 1_000, 2_000, None)]
    )
    a, b, c = 578_230_859, 578_266_767, 579_024_356
    write_rank_trace(
        tmp_path / "r1.json",
        1,
        10_002_000_123,
        [("op", "queued", a, b, None), ("op", "running", b, c, None)],
    )
    check_nesting_exact(tmp_path / "r1.json")
    out = timeline.merge_traces([tmp_path / "r0.json", tmp_path / "r1.json"], tmp_path / "m.json")
    assert check_nesting_exact(out) == 3
    rank1 = [e for e in load(out) if e["ph"] == "X" and e["pid"] == 1]
    assert [(e["name"], e["ts"], e["dur"]) for e in rank1] == [
        ("queued", 580230.982, 35.908),
        ("running", 580266.89, 757.589),
    ]
    # What stop_timeline(merged=True) merges goes through the same shift.
    document = trace._merge(
        [
            (1, 10_002_000_123, trace._render([("op", "queued", a, b, None)], 1, 0)),
            (0, 10_000_000_000, []),
        ]
    )
    (queued,) = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert (queued["ts"], queued["dur"]) == (580230.982, 35.908)


def test_merge_traces_rejects_bad_inputs_naming_them(tmp_path):
    write_rank_trace(tmp_path / "r0.json", 0, 5, [("op", "running", 1, 2, None)])
    write_rank_trace(tmp_path / "r0-again.json", 0, 7, [("op", "running", 1, 2, None)])
    one, out = tmp_path / "r0.json", tmp_path / "m.json"
    for single in (str(one), one):  # a path is iterable by character: not taken as inputs
        with pytest.raises(TypeError, match=r"inputs must be an iterable .* not a single path"):
            timeline.merge_traces(single, out)
    with pytest.raises(TypeError, match=r"inputs must be an iterable .*; got int"):
        timeline.merge_traces(3, out)
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a str or os.PathLike; got int"):
        timeline.merge_traces([one, 4], out)
    with pytest.raises(ValueError, match="inputs must name at least one"):
        timeline.merge_traces([], out)
    with pytest.raises(ValueError, match="inputs must name at least one"):
        timeline.merge_traces(iter([]), out)
    bad = {
        "list.json": ("[1, 2]", "its JSON is a list, not an object"),
        "text.json": ("not json", "it is not JSON"),
        "other.json": ('{"traceEvents": [], "otherData": "x"}', "its otherData is 'x'"),
        "no-other.json": ('{"traceEvents": []}', "its otherData is None"),
        "events.json": ('{"traceEvents": 1, "otherData": {}}', "its traceEvents is 1"),
        "chrome.json": ('{"traceEvents": [], "otherData": {}}', "gossamer_time_origin_ns is None"),
        "rank.json": (
            '{"traceEvents": [], "otherData": {"gossamer_time_origin_ns": {"r": 5}}}',
            "time origin",
        ),
        "origin.json": (
            '{"traceEvents": [], "otherData": {"gossamer_time_origin_ns": {"0": 1.5}}}',
            "time origin",
        ),
    }
    for name, (text, why) in bad.items():
        (tmp_path / name).write_text(text)
        where = re.escape(f"inputs[1] = {str(tmp_path / name)!r} is not a per-rank trace")
        with pytest.raises(ValueError, match=f"{where}.*{re.escape(why)}"):
            timeline.merge_traces([one, tmp_path / name], out)
    with pytest.raises(ValueError, match=r"inputs\[0\] = .* and inputs\[1\] = .* both hold rank 0"):
        timeline.merge_traces([one, one], out)
    with pytest.raises(ValueError, match="both hold rank 0"):
        timeline.merge_traces([one, tmp_path / "r0-again.json"], out)
    with pytest.raises(ValueError, match=r"output: .* is a directory"):
        timeline.merge_traces([one], tmp_path)
    assert not out.exists() and not list(tmp_path.parent.glob(f".{tmp_path.name}*"))
    assert timeline.merge_traces((p for p in [one]), out) == out  # any iterable of paths


def test_documented_header_sizes_are_the_transports():
    head = HEADER_LEN * 8
    assert head == 176
    doc = counters.__doc__
    assert f"int64 values,\naccumulates, gets, replies)        {head} bytes)" in doc
    assert f"headers only ({head} bytes per acknowledgement)" in doc
    # 1000 float32 to 2 out-neighbours (exponential-2 on 3 ranks): one header and payload each.
    assert f"2 x ({head} + 4000)  # doctest: +SKIP\n    {2 * (head + 4000)}\n" in doc
    assert f"\n        {2 * (head + 4000)}\n" in counters.bytes_sent.__doc__
    compression = " ".join((ROOT / "docs" / "compression.md").read_text().split())
    from gossamer.compression import get_compressor

    uint8, topk = get_compressor("uint8"), get_compressor("topk:0.05")
    put = head + 1 + len(uint8.name) + uint8.payload_nbytes(1000)
    sparse = head + 1 + len(topk.name) + topk.payload_nbytes(1000)
    ratio = (head + 4000) / sparse
    for text in (
        f"`d x ({head} + 1 + len(name) + payload)`",
        f"{put} instead of {head + 4000} per destination; `topk:0.05`: {sparse}, {ratio:.1f}x",
        f"each {head}-byte call header",
        f"`d x ({head} + {uint8.payload_nbytes(1000)})` bytes",
        f"`d x ({head} + 4000)` uncompressed",
    ):
        assert text in compression
    assert not re.search(r"\b(160|4160|1174|433|8320)\b", compression + doc)


def test_the_quickstart_describes_the_rows_of_the_trace():
    text = " ".join((ROOT / "docs" / "quickstart.md").read_text().split())
    assert "one row per tensor" not in text
    assert "one row per operation" in text


def _resolves(target):
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


@pytest.mark.parametrize("page", ["gossamer.bluefog.md", "gossamer.profiling.md"])
def test_api_page_references_name_objects_that_exist(page):
    text = (ROOT / "docs" / "api" / page).read_text()
    targets = re.findall(r":(?:meth|func|class|data|attr|mod|exc):`~?(gossamer[\w.]*)`", text)
    assert targets
    assert [t for t in targets if not _resolves(t)] == []


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
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("GOSSAMER_TIMELINE", str(tmp_path / "file" / "t"))
    with pytest.raises(ValueError, match=r"GOSSAMER_TIMELINE='.*file/t': path: cannot make"):
        timeline.maybe_start_from_env()


def test_a_timeline_left_on_is_written_at_exit(tmp_path):
    code = (
        "import sys; from gossamer.profiling import timeline as t; "
        "t.start_timeline(sys.argv[1]); t.start_activity('row', 'open'); "
        "t.activity('row', 'closed').__enter__()"
    )
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "exit")], check=True, timeout=120)
    rows = check_well_formed(load(tmp_path / "exit.rank0.json"))
    assert rows == {("rank 0", "row"): ["open"]}


@pytest.mark.parametrize("rank, size", [("0", 2), (0, None), (0.5, 2), (2, 2), (-1, 2)])
def test_attach_refuses_a_rank_outside_the_job(rank, size):
    with pytest.raises(ValueError, match=r"rank|size"):
        session.attach(rank, size)


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
    timeline.start_timeline(tmp_path / "d")
    assert timeline.stop_timeline() == [tmp_path / "d.rank1.json"]
    with pytest.raises(ValueError, match="rank"):
        gossamer.profiling.attach(2, 2)


def test_a_merged_stop_after_shutdown_writes_per_rank_files_and_warns(tmp_path, monkeypatch):
    monkeypatch.setattr(session, "_world", session._World())  # restored after the test
    # Every rank of a job of 3 stops after shutdown: each must keep its own spans, where
    # each used to overwrite the one merged file with its own.
    for rank in range(3):
        gossamer.profiling.attach(rank, 3, lambda part: pytest.fail("gathered after detach"))
        timeline.start_timeline(tmp_path / "t", merged=True)
        with timeline.activity("user", f"work of rank {rank}"):
            pass
        gossamer.profiling.detach()
        with pytest.warns(RuntimeWarning, match=r"after gossamer\.shutdown\(\).*live runtime"):
            written = timeline.stop_timeline()
        assert written == [tmp_path / f"t.rank{rank}.json"]
        assert not timeline.timeline_enabled()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"t.rank{r}.json" for r in range(3)]
    for rank in range(3):
        rows = check_well_formed(load(tmp_path / f"t.rank{rank}.json"))
        assert rows == {(f"rank {rank}", "user"): [f"work of rank {rank}"]}

    # A job of one has nothing to gather: its merged file is written, without a warning.
    gossamer.profiling.attach(0, 1, lambda part: pytest.fail("gathered a world of one"))
    gossamer.profiling.detach()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        timeline.start_timeline(tmp_path / "one", merged=True)
        assert timeline.stop_timeline() == [tmp_path / "one.json"]


@pytest.mark.parametrize(
    ("failure", "kind"),
    [
        (RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:1234"), PeerError),
        (TimeoutError("Timed out waiting 15000ms for recv operation"), CommunicationTimeout),
    ],
)
def test_a_failed_merged_stop_keeps_this_ranks_spans_and_names_the_stop(
    tmp_path, monkeypatch, failure, kind
):
    monkeypatch.setattr(session, "_world", session._World())  # restored after the test

    def gather(part):
        raise failure

    gossamer.profiling.attach(1, 2, gather)
    timeline.start_timeline(tmp_path / "t", merged=True)
    with timeline.activity("user", "rank 1 work"):
        pass
    with pytest.raises(kind, match=r"stop_timeline\(merged=True\) on rank 1 of 2") as raised:
        timeline.stop_timeline()
    assert raised.value.__cause__ is failure
    assert str(tmp_path / "t.rank1.json") in str(raised.value)
    assert not timeline.timeline_enabled()
    assert [p.name for p in tmp_path.iterdir()] == ["t.rank1.json"]
    rows = check_well_formed(load(tmp_path / "t.rank1.json"))
    assert rows == {("rank 1", "user"): ["rank 1 work"]}


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
