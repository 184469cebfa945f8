"""The emulated-cluster benchmark: rates, host plan, cost model, report, the Bagua rows."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import gossamer
from gossamer.testing import run_distributed

# The benchmarks package lives beside src/, not inside the installed distribution.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.netbench import report, worker
from benchmarks.netbench.__main__ import main
from benchmarks.netbench.cluster import (
    format_rate,
    parse_rate,
    parse_rates,
    plan_hosts,
    preflight,
    tbf_args,
)
from benchmarks.netbench.worker import BAGUA_STRATEGIES, STRATEGIES

M = 20e6  # model bytes


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("10gbit", 10**10),
        ("1gbit", 10**9),
        ("100mbit", 10**8),
        ("1.5Gbit", 1_500_000_000),
        ("500kbit", 500_000),
        ("1mbps", 8 * 10**6),
        ("unshaped", None),
        (" none ", None),
    ],
)
def test_parse_rate(text, bits):
    assert parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "fast", "10 gigabit", "0mbit", "-1gbit", "1xbit"])
def test_parse_rate_rejects(text):
    with pytest.raises(ValueError):
        parse_rate(text)


def test_parse_rates_keeps_order_and_drops_duplicates():
    assert parse_rates("unshaped,1gbit,100mbit,1000mbit,") == [None, 10**9, 10**8]
    with pytest.raises(ValueError, match="no rates"):
        parse_rates(" , ")


@pytest.mark.parametrize("bits", [None, 10**10, 10**9, 10**8, 1_500_000_000, 64_000])
def test_format_rate_round_trips(bits):
    assert parse_rate(format_rate(bits)) == bits


def test_tbf_burst_holds_a_gso_segment_and_scales_with_rate():
    slow, fast = tbf_args(10**8), tbf_args(10**10)
    assert slow[:3] == ["tbf", "rate", "100000000bit"]
    assert int(slow[slow.index("burst") + 1]) >= 65536
    assert int(fast[fast.index("burst") + 1]) == 10**10 // 8 // 200


def test_plan_hosts_node_rank_order():
    hosts = plan_hosts(3, 2, "p")
    assert [h.namespace for h in hosts] == ["p-h0", "p-h1", "p-h2"]
    assert [h.address for h in hosts] == ["10.77.0.1", "10.77.0.2", "10.77.0.3"]
    assert [h.ranks for h in hosts] == [(0, 1), (2, 3), (4, 5)]
    assert {h.interface for h in hosts} == {"eth0"}
    assert len({h.switch_port for h in hosts}) == 3
    for bad in [(0, 1), (2, 0), (251, 1)]:
        with pytest.raises(ValueError):
            plan_hosts(*bad, "p")


def test_cost_model_matches_design_formulas():
    # One rank per host: DESIGN.md section 6 with L = 0.
    assert report.host_egress_bytes("ddp", M, 4, 1) == pytest.approx(1.5 * M)
    assert report.host_egress_bytes("gradient-allreduce", M, 8, 1) == pytest.approx(1.75 * M)
    assert report.host_egress_bytes("atc/exp2", M, 4, 1) == pytest.approx(2 * M)
    assert report.host_egress_bytes("win-put", M, 8, 1) == pytest.approx(3 * M)
    assert report.host_egress_bytes("atc/one-peer", M, 4, 1) == pytest.approx(M)
    assert report.host_egress_bytes("compute", M, 4, 1) == 0
    assert report.host_egress_bytes("ddp", M, 2, 2) == 0  # one host: nothing leaves it
    assert report.comm_seconds("atc/one-peer", M, 4, 1, 10**8) == pytest.approx(M / 12.5e6)
    assert report.comm_seconds("ddp", M, 4, 1, None) is None
    with pytest.raises(ValueError):
        report.host_egress_bytes("nope", M, 4, 1)


def test_choco_rows_take_any_compressor_and_its_payload_size():
    assert report.choco_spec("choco-qsgd:16-copy/one-peer") == ("qsgd:16", True)
    assert report.choco_spec("choco-uint8/one-peer") == ("uint8", False)
    # 8-bit codes: a quarter of the one-peer bytes; natural compression 9 bits of 32.
    assert report.host_egress_bytes("choco-uint8/one-peer", M, 4, 1) == pytest.approx(M / 4, 1e-4)
    approx = pytest.approx(M * 9 / 32, 1e-4)
    assert report.host_egress_bytes("choco-natural/one-peer", M, 4, 1) == approx


def test_cost_model_two_ranks_per_host():
    # Ranks 0,1 | 2,3: exp-2 offsets 1 and 2; rank 0's +1 stays home, the other three leave.
    assert report.host_egress_bytes("atc/exp2", M, 4, 2) == pytest.approx(3 * M)
    # One-peer: offset 1 sends one rank's model off-host, offset 2 both: mean 1.5 M.
    assert report.host_egress_bytes("atc/one-peer", M, 4, 2) == pytest.approx(1.5 * M)
    assert report.host_egress_bytes("hier-atc", M, 8, 2) == pytest.approx(2 * M)
    assert report.host_egress_bytes("ddp", M, 4, 2) == pytest.approx(1.5 * M)


def test_ceiling_is_the_slower_of_compute_and_comm():
    comm = report.comm_seconds("ddp", M, 4, 1, 10**9)
    assert report.ceiling_samples_per_s("ddp", M, 4, 1, 10**9, 32, 0.01) == pytest.approx(
        4 * 32 / comm
    )
    assert report.ceiling_samples_per_s("ddp", M, 4, 1, 10**12, 32, 0.5) == pytest.approx(256)
    assert report.ceiling_samples_per_s("ddp", M, 4, 1, None, 32, 0.5) is None


def _row(strategy, rep, samples, step, tx, rate=10**9, model="mlp", per_host=1):
    return {
        "rate": rate, "model": model, "hosts": 4, "ranks_per_host": per_host,
        "strategy": strategy, "rep": rep, "ranks": 4 * per_host, "batch": 32,
        "params_bytes": M, "samples_per_s": samples, "step_s": step,
        "tx_bytes_per_step_per_rank": tx,
    }  # fmt: skip


ROWS = [
    _row("compute", 0, 1000, 0.1, 0),
    _row("compute", 1, 1200, 0.12, 0),
    _row("compute", 2, 1100, 0.11, 0),
    _row("ddp", 0, 100, 0.4, 30e6),
    _row("ddp", 1, 90, 0.5, 30e6),
    _row("ddp", 2, 110, 0.35, 30e6),
    _row("atc/one-peer", 0, 200, 0.3, 20e6),
    _row("atc/one-peer", 1, 180, 0.31, 20e6),
    _row("atc/one-peer", 2, 220, 0.29, 20e6),
    _row("gradient-allreduce", 0, 90, 0.45, 31e6, rate=10**8),
]


def test_aggregate_medians_ratios_and_utilisation():
    agg = {(r["rate"], r["strategy"]): r for r in report.aggregate(ROWS)}
    ddp = agg[(10**9, "ddp")]
    assert (ddp["samples_per_s"], ddp["samples_min"], ddp["samples_max"]) == (100, 90, 110)
    assert ddp["reps"] == 3 and ddp["step_s"] == 0.4
    assert ddp["comm_s"] == pytest.approx(0.4 - 0.11)
    assert ddp["utilisation"] == pytest.approx(30e6 / (125e6 * 0.29))
    assert agg[(10**9, "atc/one-peer")]["vs_ddp"] == pytest.approx(2.0)
    assert agg[(10**9, "compute")]["vs_ddp"] is None
    # Another rate is another group: no DDP and no compute baseline there.
    lonely = agg[(10**8, "gradient-allreduce")]
    assert lonely["vs_ddp"] is None and lonely["utilisation"] is None
    assert lonely["ceiling"] is None


def test_table_and_targets():
    agg = report.aggregate(ROWS)
    table = report.markdown_table(agg)
    assert table.count("\n") == len(agg) + 1
    assert "| 1gbit | mlp | 4x1 | ddp | 100.0 [90.0-110.0] | 400.0 | 30.00 |" in table
    lines = report.targets(agg)
    assert "1gbit mlp 4x1: atc/one-peer 2.00x DDP (target >= 1.5): met" in lines
    assert any(line.startswith("1gbit mlp 4x1: ddp link utilisation") for line in lines)


def test_plot_writes_a_png(tmp_path):
    rows = [*ROWS, _row("ddp", 0, 50, 0.8, 30e6, rate=10**8)]
    report.plot(report.aggregate(rows), "mlp", tmp_path / "mlp.png")
    assert (tmp_path / "mlp.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _accuracy_row(strategy, reached, final, step_s=0.1):
    curve = [(10, 1.0, 0.5), (20, 2.0, final)]
    return {
        "strategy": strategy, "rate": 10**8, "hosts": 4, "ranks_per_host": 1, "target": 0.95,
        "params_bytes": 1e6, "batch": 16, "steps": 20, "step_s": step_s, "curve": curve,
        "steps_to_target": 20 if reached else None, "time_to_target_s": reached,
        "final_accuracy": final,
    }  # fmt: skip


def test_time_to_accuracy_table_and_targets(tmp_path):
    rows = [
        _accuracy_row("ddp", 30.0, 0.97),
        _accuracy_row("atc/one-peer", 15.0, 0.965),
        _accuracy_row("atc/exp2", None, 0.90),
    ]
    table = report.accuracy_table(rows)
    assert "| 100mbit | 4x1 | atc/one-peer | 100.0 | 20 | 15.0 | 2.00 | 96.50% |" in table
    assert "| 100mbit | 4x1 | atc/exp2 | 100.0 | - | - | - | 90.00% |" in table
    met, accuracy = report.accuracy_targets(rows)
    assert met.startswith("best decentralized (atc/one-peer) reaches 95% 2.00x") and "met" in met
    assert "0.50 points below" in accuracy and accuracy.endswith("met")
    slow = [rows[0], _accuracy_row("atc/one-peer", 25.0, 0.95)]
    met, accuracy = report.accuracy_targets(slow)
    assert met.endswith("MISSED") and accuracy.endswith("MISSED")
    assert "missed the target" in report.accuracy_targets([rows[0], rows[2]])[0]
    report.plot_accuracy(rows, tmp_path / "accuracy.png")
    assert (tmp_path / "accuracy.png").stat().st_size > 0


def test_cli_without_root_says_why(monkeypatch, capsys):
    monkeypatch.setattr("benchmarks.netbench.__main__.preflight", lambda: "needs root (test)")
    assert main(["--preset", "smoke", "--out", "unused"]) == 1
    assert "needs root (test)" in capsys.readouterr().err


def test_preflight_reports_missing_tools(monkeypatch):
    monkeypatch.setattr("os.geteuid", lambda: 0)
    monkeypatch.setattr("shutil.which", lambda tool: None)
    assert "iproute2" in preflight()
    monkeypatch.setattr("os.geteuid", lambda: 1000)
    assert "root" in preflight()


# ---------------------------------------------------------------------- Bagua rows
def _bagua_rows(strategies):
    """Build each Bagua row as the worker does, take 3 steps on a small MLP, release it."""
    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
        net, opt = worker.wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(gossamer.rank())
        x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
        worker.release(strategy, opt)
        end = torch.cat([p.detach().flatten() for p in model.parameters()])
        out[strategy] = (start, end)
    return out


def test_bagua_rows_construct_step_and_release():
    assert set(BAGUA_STRATEGIES) <= set(STRATEGIES)
    got = run_distributed(_bagua_rows, 2, args=(list(BAGUA_STRATEGIES),))
    for strategy in BAGUA_STRATEGIES:
        (start0, end0), (start1, end1) = got[0][strategy], got[1][strategy]
        assert torch.equal(start0, start1), strategy  # same start (with_bagua broadcasts)
        for end in (end0, end1):
            assert bool(end.isfinite().all()) and not torch.equal(end, start0), strategy
        if strategy in ("bagua-gradient-allreduce", "bagua-bytegrad", "bagua-qadam"):
            assert torch.equal(end0, end1), strategy  # every rank takes the averaged step
        else:  # ranks mix their own models: they differ, but stay close
            assert not torch.equal(end0, end1), strategy


def test_bagua_rows_cost_model():
    assert report.host_egress_bytes("bagua-gradient-allreduce", M, 4, 1) == pytest.approx(1.5 * M)
    assert report.host_egress_bytes("bagua-bytegrad", M, 4, 1) == pytest.approx(0.375 * M)
    assert report.host_egress_bytes("bagua-qadam", M, 4, 1) == pytest.approx(0.375 * M)
    assert report.host_egress_bytes("bagua-decentralized", M, 4, 1) == pytest.approx(M)
    # the ring: both neighbours leave a one-rank host; with two ranks per host only one does
    assert report.host_egress_bytes("bagua-low-precision-decentralized", M, 4, 1) == (
        pytest.approx(0.5 * M)
    )
    assert report.host_egress_bytes("bagua-low-precision-decentralized", M, 4, 2) == (
        pytest.approx(0.5 * M)
    )
    assert report.comm_seconds("bagua-async", M, 4, 1, 10**9) is None


# ---------------------------------------------------------------------- one-peer rows
def _one_peer_rows(models, strategies):
    """Each one-peer row on each model, built and stepped as the worker does (batch 2)."""
    out = {}
    for name in models:
        build, inputs = worker.MODELS[name]
        for strategy in strategies:
            torch.manual_seed(gossamer.rank())  # different models: an exchange changes them
            model = build()
            start = torch.cat([p.detach().flatten() for p in model.parameters()]).clone()
            net, opt = worker.wrap(strategy, model, torch.optim.SGD(model.parameters(), lr=0.1))
            x, y = inputs(2), torch.randint(0, 10, (2,))
            opt.zero_grad()
            if "exchange/" not in strategy:
                nn.functional.cross_entropy(net(x), y).backward()
            opt.step()
            if hasattr(opt, "synchronize"):
                opt.synchronize()
            worker.release(strategy, opt)
            end = torch.cat([p.detach().flatten() for p in model.parameters()])
            out[name, strategy] = bool(end.isfinite().all()) and not torch.equal(end, start)
    return out


def test_every_one_peer_row_runs_on_the_cnn_and_the_transformer():
    rows = [s for s in report.ONE_PEER if s in STRATEGIES and not s.startswith("bagua")]
    got = run_distributed(_one_peer_rows, 2, args=(["resnet", "transformer"], rows), timeout=300)
    for rank_rows in got:
        assert all(rank_rows.values()), [k for k, ok in rank_rows.items() if not ok]
