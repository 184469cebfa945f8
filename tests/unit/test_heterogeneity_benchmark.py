"""benchmarks/heterogeneity.py: its report, and one tiny run as a world of one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
# The benchmarks package lives beside src/, not inside the installed distribution.
sys.path.insert(0, str(ROOT))

from benchmarks.heterogeneity import _with_gaps, markdown, parse  # noqa: E402


def test_report_gives_gaps_to_the_same_method_on_iid():
    args = parse(["--quick"])
    assert (args.steps, args.eval_every, args.graphs) == (64, 16, ["ring"])
    rows = [
        {"partition": "iid", "method": "atc", "graph": "ring", "accuracy": 0.9},
        {"partition": "2-classes", "method": "atc", "graph": "ring", "accuracy": 0.4},
        {"partition": "2-classes", "method": "ngc", "graph": "ring", "accuracy": 0.5},
    ]
    for r in rows:
        r.update(bytes_per_rank=2e6 if r["method"] == "atc" else float("nan"), samples_per_s=10)
    rows[0]["average_model_accuracy"] = 0.95  # a row without it (older results) stays blank
    table = markdown(_with_gaps(rows), args).splitlines()
    assert table[-3] == "| iid | atc | ring | 90.0% | ref | 95.0% | 2.00 | 10 |"
    assert table[-2] == "| 2-classes | atc | ring | 40.0% | -50.0 |  | 2.00 | 10 |"
    assert table[-1] == "| 2-classes | ngc | ring | 50.0% |  |  | n/c | 10 |"


@pytest.mark.slow
def test_a_tiny_run_as_a_world_of_one(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    methods = ["atc", "allreduce", "d-cliques", "clumping", "skewscout", "fedhisyn", "cocofl"]
    command = [sys.executable, "-m", "benchmarks.heterogeneity", "--worker", "--steps", "8"]
    command += ["--eval-every", "8", "--probe-every", "4", "--delay-ms", "1", "--graphs", "ring"]
    command += ["--partitions", "iid", "--out", str(tmp_path), "--methods", *methods, "ngc"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["method"] for r in rows if r["method"] != "ngc"] == methods
    assert "ngc" in [r["method"] for r in rows] or "ngc        not built yet" in done.stdout
    for r in rows:
        assert 0 <= r["accuracy"] <= 1 and r["curve"][-1][0] == 8
        assert 0 <= r["average_model_accuracy"] <= 1
        # one rank sends nothing; uncounted methods report NaN
        assert r["bytes_per_rank"] == 0 or np.isnan(r["bytes_per_rank"])
    assert (tmp_path / "table.md").read_text().count("| iid |") == len(rows)
    assert (tmp_path / "accuracy.png").stat().st_size > 0


@pytest.mark.slow
def test_the_time_varying_graph_runs_only_the_methods_that_take_a_schedule(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    command = [sys.executable, "-m", "benchmarks.heterogeneity", "--worker", "--steps", "4"]
    command += ["--eval-every", "4", "--delay-ms", "0", "--graphs", "onepeer", "--partitions"]
    command += ["iid", "--out", str(tmp_path), "--methods", "atc", "cocofl", "dacfl"]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [(r["method"], r["graph"]) for r in rows] == [("atc", "onepeer"), ("dacfl", "onepeer")]
    assert "cocofl     onepeer: runs on static graphs only, skipped" in done.stdout
    assert all(r["bytes_per_rank"] == 0 for r in rows)  # one rank: no peer in any round


def test_two_classes_per_rank_needs_five_ranks(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(["--ranks", "4"])
    assert exit_.value.code == 2
    assert "--partitions 2-classes needs --ranks >= 5" in capsys.readouterr().err
    assert parse(["--ranks", "4", "--partitions", "iid", "dirichlet-0.1"]).ranks == 4
