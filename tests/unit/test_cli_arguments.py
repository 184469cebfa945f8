"""The benchmarks' and examples' command lines refuse bad values with an argparse error.

Each bad value exits with code 2 and a message naming the option and the value, before
any training or communication (and, for netbench, before its root check), instead of a
traceback, a hang or a silent change to the preset's value.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]

# The benchmarks package lives beside src/, not inside the installed distribution.
sys.path.insert(0, str(ROOT))

import benchmarks.netbench.__main__ as netbench  # noqa: E402
import benchmarks.netbench.windows as netbench_windows  # noqa: E402

# (script, arguments, what stderr must name: the option, then the value).
CASES = [
    ("benchmarks/bench_ops.py", ["--reps", "-2"], ["--reps", "-2"]),
    ("benchmarks/bench_ops.py", ["--reps", "0"], ["--reps", "0"]),
    ("benchmarks/bench_ops.py", ["--sizes", "abc"], ["--sizes", "abc"]),
    ("benchmarks/bench_ops.py", ["--sizes", "10,0"], ["--sizes", "10,0"]),
    # A world of one has nobody to exchange with (it used to die inside gloo).
    ("benchmarks/bench_ops.py", ["--preset", "smoke", "--sizes", "10"], ["at least 2 ranks"]),
    ("benchmarks/bench_compression.py", ["--numel", "0"], ["--numel", "0"]),
    ("benchmarks/bench_compression.py", ["--numel", "-4"], ["--numel", "-4"]),
    ("benchmarks/bench_compression.py", ["--reps", "0"], ["--reps", "0"]),
    ("benchmarks/bench_compression.py", ["--reps", "-1"], ["--reps", "-1"]),
    ("benchmarks/bench_compression.py", ["--specs", "uint8", "topk:2"], ["--specs", "topk:2"]),
    ("benchmarks/bench_compression.py", ["--specs", "bogus"], ["--specs", "bogus"]),
    ("benchmarks/compression_accuracy.py", ["--steps", "0"], ["--steps", "0"]),
    ("benchmarks/compression_accuracy.py", ["--steps", "-3"], ["--steps", "-3"]),
    ("benchmarks/compression_accuracy.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("benchmarks/compression_accuracy.py", ["--warmup", "-1"], ["--warmup", "-1"]),
    (
        "benchmarks/compression_accuracy.py",
        ["--compressors", "uint8", "topk:2"],
        ["--compressors", "topk:2"],
    ),
    ("benchmarks/compression_accuracy.py", ["--compressors", "none"], ["--compressors", "none"]),
    (
        "benchmarks/compression_accuracy.py",
        ["--compressors", "powersgd:0"],
        ["--compressors", "powersgd:0"],
    ),
    ("benchmarks/compression_accuracy.py", ["--batch-size", "5000"], ["--batch-size", "5000"]),
    (
        "benchmarks/compression_accuracy.py",
        ["--choco-compressors", "bogus"],
        ["--choco-compressors", "bogus"],
    ),
    (
        "benchmarks/compression_accuracy.py",
        ["--choco-compressors", "none"],
        ["--choco-compressors", "none"],
    ),
    ("examples/average_consensus.py", ["--max-iters", "-3"], ["--max-iters", "-3"]),
    ("examples/average_consensus.py", ["--data-size", "0"], ["--data-size", "0"]),
    ("examples/average_consensus.py", ["--data-size", "-2"], ["--data-size", "-2"]),
    ("examples/average_consensus.py", ["--work-ms", "-5"], ["--work-ms", "-5"]),
    # The synchronous rounds simulate no work: a --work-ms there used to be ignored silently.
    ("examples/average_consensus.py", ["--work-ms", "5"], ["--work-ms", "5", "--asynchronous"]),
    ("examples/train_digits.py", ["--epochs", "0"], ["--epochs", "0"]),
    ("examples/train_digits.py", ["--epochs", "-1"], ["--epochs", "-1"]),
    ("examples/train_digits.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("examples/train_digits.py", ["--test-fraction", "1.5"], ["--test-fraction", "1.5"]),
    ("examples/train_digits.py", ["--test-fraction", "0"], ["--test-fraction", "0"]),
    ("examples/train_digits.py", ["--test-fraction", "1e-4"], ["--test-fraction", "0.0001"]),
    ("examples/train_digits.py", ["--batch-size", "2000"], ["--batch-size", "2000"]),
    # The compression spec is checked before any rank starts (it used to fail in the
    # optimizer, in a traceback from every rank), with the library's message.
    ("examples/train_digits.py", ["--compression", "bogus"], ["--compression", "bogus"]),
    ("examples/train_digits.py", ["--compression", "topk:2"], ["--compression", "topk:2"]),
    ("examples/train_digits.py", ["--compression", "powersgd:0"], ["--compression", "powersgd:0"]),
    ("examples/train_digits.py", ["--compression", "powersgd"], ["--compression", "powersgd"]),
    (
        "examples/train_digits.py",
        ["--optimizer", "dcd", "--topology", "one_peer"],
        ["--topology", "one_peer", "dcd"],
    ),
    ("examples/decentralized_optimization.py", ["--samples", "0"], ["--samples", "0"]),
    ("examples/decentralized_optimization.py", ["--dim", "0"], ["--dim", "0"]),
    ("examples/decentralized_optimization.py", ["--print-every", "0"], ["--print-every", "0"]),
    ("examples/decentralized_optimization.py", ["--max-iters", "-1"], ["--max-iters", "-1"]),
    # These used to run and diverge (to 1e81 or nan).
    ("examples/decentralized_optimization.py", ["--lr", "-1"], ["--lr", "-1"]),
    ("examples/decentralized_optimization.py", ["--lr", "0"], ["--lr", "0"]),
    ("examples/decentralized_optimization.py", ["--lr", "nan"], ["--lr", "nan"]),
    ("examples/decentralized_optimization.py", ["--lr", "inf"], ["--lr", "inf"]),
    ("examples/decentralized_optimization.py", ["--rho", "-1"], ["--rho", "-1"]),
    ("examples/decentralized_optimization.py", ["--rho", "nan"], ["--rho", "nan"]),
    ("benchmarks/bagua_overhead.py", ["--flatten", "bogus"], ["--flatten", "bogus"]),
    ("benchmarks/bagua_overhead.py", ["--algorithms", "foo"], ["--algorithms", "foo"]),
    ("benchmarks/bagua_overhead.py", ["--steps", "0"], ["--steps", "0"]),
    ("benchmarks/bagua_overhead.py", ["--reps", "0"], ["--reps", "0"]),
    ("benchmarks/bench_overlap.py", ["--steps", "0"], ["--steps", "0"]),
    ("benchmarks/bench_overlap.py", ["--reps", "0"], ["--reps", "0"]),
    ("benchmarks/bench_overlap.py", ["--warmup", "-1"], ["--warmup", "-1"]),
    # An unknown name used to train as ATC, in a row labelled with that name.
    ("benchmarks/bench_overlap.py", ["--strategies", "bogus"], ["--strategies", "bogus"]),
    (
        "benchmarks/bench_overlap.py",
        ["--strategies", "awc/one-peer,atc"],
        ["--strategies", "'atc'"],
    ),
    ("examples/synthetic_benchmark.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    (
        "examples/synthetic_benchmark.py",
        ["--num-batches-per-iter", "0"],
        ["--num-batches-per-iter", "0"],
    ),
    ("examples/synthetic_benchmark.py", ["--num-classes", "0"], ["--num-classes", "0"]),
    (
        "examples/synthetic_benchmark.py",
        ["--num-warmup-batches", "-1"],
        ["--num-warmup-batches", "-1"],
    ),
    ("examples/synthetic_benchmark.py", ["--num-iters", "1"], ["--num-iters"]),
    ("examples/bagua_digits.py", ["--epochs", "0"], ["--epochs", "0"]),
    ("examples/bagua_digits.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("examples/bagua_digits.py", ["--log-interval", "0"], ["--log-interval", "0"]),
    ("examples/bagua_digits.py", ["--test-batch-size", "0"], ["--test-batch-size", "0"]),
    ("examples/bagua_digits.py", ["--passes", "0"], ["--passes", "0"]),
    ("examples/bagua_digits.py", ["--epochs", "abc"], ["--epochs", "abc"]),
    # Columns used to be in the given order, values in ascending order.
    ("benchmarks/choco_gamma.py", ["--rounds", "0", "5"], ["--rounds", "0"]),
    ("benchmarks/choco_gamma.py", ["--rounds", "-5"], ["--rounds", "-5"]),
    ("benchmarks/choco_gamma.py", ["--rounds", "5", "5"], ["--rounds", "5 5"]),
    ("benchmarks/choco_gamma.py", ["--rounds"], ["--rounds"]),
    ("benchmarks/choco_gamma.py", ["--compressors", "bogus"], ["--compressors", "bogus"]),
    # These used to fail on the ranks (StatisticsError, ZeroDivisionError, a 60 s wait).
    ("examples/elastic_digits.py", ["--steps", "2"], ["--steps 2", "--steps >= 4"]),
    ("examples/elastic_digits.py", ["--eval-every", "0"], ["--eval-every", "0"]),
    ("examples/elastic_digits.py", ["--steps", "-3"], ["--steps", "-3"]),
    ("examples/elastic_digits.py", ["--steps", "0"], ["--steps", "0"]),
    ("examples/elastic_digits.py", ["--epochs", "0"], ["--epochs", "0"]),
    ("examples/elastic_digits.py", ["--lr", "-1"], ["--lr", "-1"]),
    ("examples/elastic_digits.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("examples/elastic_digits.py", ["--batch-size", "500"], ["--batch-size", "500"]),
    # --victim is only checked when somebody is killed.
    (
        "examples/elastic_digits.py",
        ["--world-size", "2", "--no-kill", "--steps", "0"],
        ["--steps", "0"],
    ),
    ("examples/join_digits.py", ["--eval-every", "0"], ["--eval-every", "0"]),
    ("examples/join_digits.py", ["--steps", "0"], ["--steps", "0"]),
    ("benchmarks/async_speed.py", ["--seconds", "0"], ["--seconds", "0"]),
    ("benchmarks/async_speed.py", ["--delays-ms", "0,-5"], ["--delays-ms", "0,-5"]),
    ("benchmarks/async_speed.py", ["--delays-ms", "a,b"], ["--delays-ms", "a,b"]),
    ("benchmarks/async_speed.py", ["--batch-size", "0"], ["--batch-size", "0"]),
    ("benchmarks/async_speed.py", ["--optimizers", "bogus"], ["--optimizers", "bogus"]),
    ("benchmarks/skewscout_drift.py", ["--periods", "-2"], ["--periods", "-2"]),
    ("benchmarks/skewscout_drift.py", ["--periods", "0"], ["--periods", "0"]),
    ("benchmarks/skewscout_drift.py", ["--ranks", "0"], ["--ranks", "0"]),
    ("benchmarks/skewscout_drift.py", ["--ranks", "1"], ["--ranks", "1"]),
    ("benchmarks/skewscout_drift.py", ["--steps", "0"], ["--steps", "0"]),
    ("benchmarks/skewscout_drift.py", ["--after", "50", "--steps", "20"], ["--after", "50"]),
    ("benchmarks/bench_windows.py", ["--depth", "0"], ["--depth", "0"]),
    ("benchmarks/bench_windows.py", ["--scaling", "--blocks", "0"], ["--blocks", "0"]),
    ("benchmarks/bench_windows.py", ["--scaling", "--numel", "0"], ["--numel", "0"]),
    ("benchmarks/elastic_digits.py", ["--steps", "2"], ["--steps", "2"]),
    ("benchmarks/bagua_digits_sim.py", ["--lr", "0"], ["--lr", "0"]),
    ("benchmarks/bagua_digits_sim.py", ["--lr", "-1"], ["--lr", "-1"]),
    (
        "benchmarks/heterogeneity.py",
        ["--compngc-compression", "bogus"],
        ["--compngc-compression", "bogus"],
    ),
    ("benchmarks/heterogeneity.py", ["--ranks", "0"], ["--ranks", "0"]),
]


def _alone(script, argv, cwd, timeout=60, **env_vars):
    """Run ``script argv`` in a world of one, in ``cwd``."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)  # a world of one, whatever launched the tests
    return subprocess.run(
        [sys.executable, str(ROOT / script), *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=env | env_vars,
    )


@pytest.mark.parametrize(
    ("script", "argv", "named"),
    CASES,
    ids=[f"{s.split('/')[-1]} {' '.join(a)}" for s, a, _ in CASES],
)
def test_a_bad_value_is_an_argparse_error(script, argv, named, tmp_path):
    # In tmp_path: nothing a script would write lands in the repository.
    done = _alone(script, argv, tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    error = done.stderr.strip().splitlines()[-1]
    assert "error:" in error, done.stderr
    for word in named:
        assert word in error, done.stderr
    assert not list(tmp_path.iterdir())  # no results written


def test_decentralized_optimization_warns_of_underdetermined_least_squares(tmp_path):
    """Fewer equations than unknowns runs (one may want to see it), with a warning."""
    argv = ["--samples", "3", "--dim", "5", "--max-iters", "1", "--method", "diffusion"]
    done = _alone("examples/decentralized_optimization.py", argv, tmp_path)
    assert done.returncode == 0, done.stderr
    assert "3 < --dim 5: least squares is underdetermined" in done.stderr
    done = _alone("examples/decentralized_optimization.py", argv[2:], tmp_path)
    assert done.returncode == 0 and "underdetermined" not in done.stderr, done.stderr


def test_bench_overlap_leaves_no_trace_without_trace(tmp_path):
    """The merged trace is only read, unless --trace asks to keep it."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    argv = ["--steps", "1", "--reps", "1", "--warmup", "0", "--strategies", "atc/one-peer"]
    done = _alone("benchmarks/bench_overlap.py", argv, tmp_path, timeout=120, TMPDIR=str(scratch))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "results" / "bench_overlap.md").exists()
    # (torch may leave its own caches there)
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("bench_overlap")]
    assert not list(tmp_path.glob("*.json"))


# netbench: checked in process, with everything after the option check made to fail, so a
# value that got past the parser shows (as root, preflight would pass and build namespaces).
NETBENCH = [
    (["--rates", "5furlongs"], "--rates", "5furlongs"),
    (["--rates", ","], "--rates", "no rates"),
    (["--accuracy-rate", "nope"], "--accuracy-rate", "nope"),
    (["--ranks-per-host", "abc"], "--ranks-per-host", "abc"),
    (["--ranks-per-host", "0"], "--ranks-per-host", "0"),
    (["--ranks-per-host", "1,-2"], "--ranks-per-host", "1,-2"),
    (["--hosts", "0"], "--hosts", "0"),
    (["--hosts", "-2"], "--hosts", "-2"),
    (["--hosts", "251"], "--hosts", "251"),
    (["--models", "bogus"], "--models", "bogus"),
    (["--strategies", "bogus"], "--strategies", "bogus"),
    (["--strategies", ","], "--strategies", "no strategy"),
    (["--accuracy-strategies", "bogus"], "--accuracy-strategies", "bogus"),
    (["--steps", "-1"], "--steps", "-1"),
    (["--reps", "0"], "--reps", "0"),
    (["--batch", "0"], "--batch", "0"),
    (["--warmup", "-1"], "--warmup", "-1"),
    (["--accuracy-steps", "-1"], "--accuracy-steps", "-1"),
    (["--timeout", "-5"], "--timeout", "-5"),
    (["--timeout", "nan"], "--timeout", "nan"),
    (["--congestion", "bogus"], "--congestion", "bogus"),
]


def _unreachable(*args, **kwargs):
    raise AssertionError("got past the option check")


@pytest.fixture
def netbench_stubbed(monkeypatch):
    for name in ("preflight", "Cluster", "run_job"):
        monkeypatch.setattr(netbench, name, _unreachable)


@pytest.mark.parametrize(("argv", "option", "value"), NETBENCH)
def test_netbench_checks_every_option_before_preflight(
    argv, option, value, netbench_stubbed, capsys
):
    if option == "--congestion" and netbench._congestion_offered() is None:
        pytest.skip("this machine does not say which congestion controls it has")
    with pytest.raises(SystemExit) as exit_:
        netbench.main([*argv, "--out", "unused"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {option}:" in error
    assert value in error


@pytest.mark.parametrize(
    ("argv", "option", "value"),
    [
        (["--rates", "5furlongs"], "--rates", "5furlongs"),
        (["--hosts", "1"], "--hosts", "1"),
        (["--hosts", "x"], "--hosts", "x"),
        (["--reps", "0"], "--reps", "0"),
        (["--mb", "0"], "--mb", "0"),
        (["--mb", "nan"], "--mb", "nan"),
    ],
)
def test_netbench_windows_checks_every_option_before_preflight(
    argv, option, value, monkeypatch, capsys
):
    for name in ("preflight", "Cluster", "run_job"):
        monkeypatch.setattr(netbench_windows, name, _unreachable)
    with pytest.raises(SystemExit) as exit_:
        netbench_windows.main([*argv, "--out", "unused"])
    assert exit_.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {option}:" in error
    assert value in error


def test_netbench_takes_valid_values(monkeypatch, tmp_path):
    """Valid values still reach the cluster and the jobs, as given."""
    built, jobs = [], []

    class Cluster:
        def __init__(self, hosts, rate, congestion=None):
            built.append((hosts, rate, congestion))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(netbench, "preflight", lambda: None)
    monkeypatch.setattr(netbench, "Cluster", Cluster)
    monkeypatch.setattr(netbench, "run_job", lambda *a, **k: jobs.append((a, k)) or [])
    argv = ["--preset", "smoke", "--hosts", "3", "--ranks-per-host", "1,2", "--models", ""]
    argv += ["--rates", "unshaped,100mbit", "--accuracy-rate", "1gbit", "--timeout", "2.5"]
    argv += ["--accuracy-strategies", "ddp", "--congestion", "machine", "--out", str(tmp_path)]
    assert netbench.main(argv) == 0
    assert built == [(3, None, None), (3, 10**8, None), (3, 10**9, None)]
    ((_, per_host, worker, _), options) = jobs[0]
    assert per_host == 1 and worker == ["--steps", "20", "--strategies", "ddp"]
    assert options["timeout"] == 2.5


DOCUMENTED_FAMILIES = [
    "probe/shift",
    "probe/ring:r=0.25",
    "choco-natural/one-peer",
    "choco-qsgd:16/one-peer",
    "choco-stc:0.01-copy/one-peer",
    "atc-k2/one-peer",
    "awc-copy/one-peer",
    "gradient-allreduce-2mb",
]


def test_the_documented_strategy_families_are_accepted():
    """docs/benchmarks.md runs these: the names worker.wrap builds beyond its list."""
    from benchmarks.netbench.__main__ import build_parser

    parser = build_parser()
    for name in DOCUMENTED_FAMILIES:
        assert parser.parse_args(["--strategies", name]).strategies == name
    for bad in ("choco-bogus/one-peer", "atc-zz/one-peer", "gradient-allreduce-xmb"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--strategies", bad])


def test_compression_accuracy_table_in_a_world_of_one():
    """Nothing is sent in a world of one: the bytes ratio shows "-", not a ZeroDivisionError."""
    from benchmarks.compression_accuracy import table

    rows = [
        {"name": "allreduce", "optimizer": "allreduce", "accuracy": 0.9, "bytes": 0.0},
        {"name": "allreduce + uint8 + EF", "optimizer": "allreduce", "accuracy": 0.8, "bytes": 0.0},
    ]
    for row in rows:
        row |= {"averaged_model_accuracy": row["accuracy"], "seed": 0}
    lines = table(rows, 3, 1).splitlines()
    assert lines[-1].endswith("| 0 | - |")
    assert "-10.00" in lines[-1]


def test_compression_accuracy_over_seeds_compares_each_seed_with_its_own_baseline():
    from benchmarks.compression_accuracy import seeds_table

    accuracies = {  # (name, optimizer): accuracy on seeds 0 and 1
        ("allreduce", "allreduce"): (0.90, 0.80),
        ("allreduce + topk:0.01 + EF", "allreduce"): (0.88, 0.81),
        ("gossip", "gossip"): (0.90, 0.95),
        ("choco sign", "gossip"): (0.895, 0.90),
    }
    rows = [
        {"name": name, "optimizer": optimizer, "seed": seed, "accuracy": acc, "bytes": 100.0}
        for (name, optimizer), both in accuracies.items()
        for seed, acc in enumerate(both)
    ]
    lines = {line.split(" | ")[0]: line for line in seeds_table(rows, 3, 4).splitlines()}
    assert lines["| allreduce + topk:0.01 + EF"].split(" | ")[1:6] == [
        "84.50", "-2.00 +1.00", "-0.50", "-2.00", "1 of 2"
    ]  # fmt: skip
    assert lines["| choco sign"].split(" | ")[2:6] == ["-0.50 -5.00", "-2.75", "-5.00", "1 of 2"]
    assert lines["| gossip"].split(" | ")[2:6] == ["+0.00 +0.00", "+0.00", "+0.00", "2 of 2"]


def test_train_digits_accuracy_leaves_a_qat_model_unchanged():
    """Evaluating a QAT model does not move its quantization ranges, and keeps observing."""
    sys.path.insert(0, str(ROOT / "examples"))
    from train_digits import accuracy, make_model

    from gossamer import compression

    model = compression.quantize_model(make_model(0))
    images = torch.randn(64, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 10, (64,), generator=torch.Generator().manual_seed(1))
    model(images[:8])  # the observers have seen a batch
    modules = dict(model.named_modules())
    last = modules[compression.fake_quant_modules(model)[-1]]
    last.disable_observer()  # one that was off stays off
    before = {k: v.clone() for k, v in model.state_dict().items()}
    first = accuracy(model, images * 10, labels)
    assert accuracy(model, images * 10, labels) == first
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert model.training
    model(images * 10)  # the observers that were on still observe
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert changed
    assert last.observer_enabled[0] == 0


def test_choco_gamma_puts_each_value_under_its_rounds(tmp_path):
    """Rounds given out of order: the columns follow the values' (ascending) order."""
    argv = ["--rounds", "20", "5", "--compressors", "sign", "--out", str(tmp_path)]
    done = _alone("benchmarks/choco_gamma.py", argv, tmp_path, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    header = (tmp_path / "choco_gamma.md").read_text().splitlines()[0]
    assert header.index("after 5 rounds") < header.index("after 20 rounds")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| `sign` | fixed")]
    first, later = (float(v) for v in rows[-1].strip("| ").split(" | ")[3:5])
    assert later < first  # the error falls with the rounds
