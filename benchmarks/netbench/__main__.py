"""Command line of the emulated-cluster benchmark.

    python -m benchmarks.netbench --preset smoke|full|accuracy [--rates 1gbit,100mbit]
        [--hosts 4] [--ranks-per-host 1,2] [--models mlp,resnet,transformer]
        [--accuracy-steps 300 --accuracy-rate 100mbit] [--out results/netbench]

Options are checked first: a bad value exits with code 2 and says which. Needs root and
iproute2; says which is missing and exits 1 otherwise. Throughput: every model and strategy
at every rate and layout (:mod:`benchmarks.netbench.worker`). Time to accuracy: at
``--accuracy-rate`` with the first layout, every strategy trains on digits for
``--accuracy-steps`` steps (:mod:`benchmarks.netbench.accuracy`; 0 skips it). Writes
``results.md`` (tables, targets), ``rows.json`` and ``accuracy.json`` (every measurement),
one ``<model>.png`` per model and ``accuracy.png`` under ``--out``; per-host launcher logs
under ``--out/logs``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from benchmarks.netbench import report
from benchmarks.netbench.accuracy import STRATEGIES as ACCURACY_STRATEGIES
from benchmarks.netbench.cluster import (
    CONGESTION,
    Cluster,
    format_rate,
    parse_rate,
    parse_rates,
    preflight,
)
from benchmarks.netbench.runner import checked as _checked
from benchmarks.netbench.runner import run_job
from benchmarks.netbench.worker import MODELS, STRATEGIES, is_strategy

PRESETS = {
    # Two hosts with two ranks each so that hierarchical averaging runs too; ~1 minute.
    "smoke": {
        "hosts": 2, "ranks_per_host": "2", "rates": "1gbit", "models": "mlp",
        "batch": 16, "warmup": 1, "steps": 2, "reps": 1,
        "accuracy_steps": 20, "accuracy_rate": "1gbit",
    },
    "full": {
        "hosts": 4, "ranks_per_host": "1,2", "rates": "unshaped,10gbit,1gbit,100mbit",
        "models": "mlp,resnet,transformer", "batch": 32, "warmup": 2, "steps": 5, "reps": 3,
        "accuracy_steps": 300, "accuracy_rate": "100mbit",
    },
    # Time to accuracy only (the setting: 4 hosts x 1 rank at 100 Mbit).
    "accuracy": {
        "hosts": 4, "ranks_per_host": "1", "rates": "100mbit", "models": "", "batch": 32,
        "warmup": 2, "steps": 5, "reps": 1, "accuracy_steps": 300, "accuracy_rate": "100mbit",
    },
}  # fmt: skip
# With 2 ranks per host only what the layout adds is measured (beside DDP and the baseline).
TWO_PER_HOST = ("compute", "ddp", "atc/one-peer", "hier-atc")


def _names(known: tuple[str, ...], what: str, *, allow_none: bool = False, accept=None):
    """A comma-separated list of ``known`` names (or names ``accept`` takes); the text."""

    def convert(text: str) -> str:
        names = [name for name in text.split(",") if name]
        unknown = [n for n in names if n not in known and not (accept and accept(n))]
        if unknown:
            raise ValueError(
                f"unknown {what} {', '.join(map(repr, unknown))}; valid: {','.join(known)}"
            )
        if not names and not allow_none:
            raise ValueError(f"no {what} given in {text!r}; valid: {','.join(known)}")
        return text

    return convert


def _layouts(text: str) -> list[int]:
    """``--ranks-per-host``: comma-separated ints >= 1."""
    try:
        layouts = [int(part) for part in str(text).split(",")]
    except ValueError:
        raise ValueError(f"not a comma-separated list of ints: {text!r}") from None
    if any(n < 1 for n in layouts):
        raise ValueError(f"ranks per host must be >= 1; got {text}")
    return layouts


def _as_text(check):
    """A ``convert`` for :func:`_checked` that keeps the text (main parses it again)."""

    def convert(text: str) -> str:
        check(text)  # its ValueError says what is wrong
        return text

    return convert


def _congestion(text: str) -> str:
    """``--congestion``: ``machine``, the default, or what this kernel offers or can load."""
    if text in ("machine", CONGESTION):  # the cluster warns if the default is refused
        return text
    offered = _congestion_offered()
    if offered is not None and text not in offered:
        raise ValueError(
            f"unknown TCP congestion control {text!r}; this machine offers "
            f"{', '.join(sorted(offered))} (or 'machine': keep its default)"
        )
    return text


def _congestion_offered() -> set[str] | None:
    """The congestion controls loaded or loadable (``tcp_<name>`` modules); None: unknown."""
    try:
        path = "/proc/sys/net/ipv4/tcp_available_congestion_control"
        names = set(Path(path).read_text().split())
    except OSError:
        return None
    modules = Path("/lib/modules", os.uname().release, "kernel", "net", "ipv4")
    names.update(p.name.split(".")[0].removeprefix("tcp_") for p in modules.glob("tcp_*.ko*"))
    return names


def build_parser() -> argparse.ArgumentParser:
    """Options; unset ones come from the preset. Every value is checked here."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.netbench", description=__doc__)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="smoke")
    parser.add_argument(
        "--hosts", type=_checked(int, lambda n: 1 <= n <= 250, "in [1, 250]"), help="1 to 250"
    )
    parser.add_argument(
        "--ranks-per-host", type=_checked(_as_text(_layouts)), help="comma-separated, e.g. 1,2"
    )
    parser.add_argument(
        "--rates",
        type=_checked(_as_text(parse_rates)),
        help="comma-separated: unshaped, 10gbit, 1gbit, 100mbit",
    )
    parser.add_argument(
        "--models",
        type=_checked(_names(MODELS, "model", allow_none=True)),
        help=f"comma-separated of {','.join(MODELS)} (empty: none)",
    )
    parser.add_argument(
        "--strategies",
        type=_checked(_names(STRATEGIES, "strategy", accept=is_strategy)),
        help=f"comma-separated of {','.join(STRATEGIES)}, or of their families: "
        "probe/<kind>, gradient-allreduce-<N>mb, atc|awc[-one-bucket|-<N>mb][-forward|-k<K>]"
        "[-copy]/one-peer, choco-<compressor>[-copy]/one-peer",
    )
    for name, low in (("batch", 1), ("warmup", 0), ("steps", 1), ("reps", 1)):
        parser.add_argument(
            f"--{name}", type=_checked(int, lambda n, low=low: n >= low, f">= {low}")
        )
    parser.add_argument(
        "--accuracy-steps", type=_checked(int, lambda n: n >= 0, ">= 0"), help="0 skips it"
    )
    parser.add_argument(
        "--accuracy-rate",
        type=_checked(_as_text(parse_rate)),
        help="the rate of the time-to-accuracy run",
    )
    parser.add_argument(
        "--accuracy-strategies",
        type=_checked(_names(ACCURACY_STRATEGIES, "strategy")),
        help=f"comma-separated of {','.join(ACCURACY_STRATEGIES)}; default: all",
    )
    parser.add_argument(
        "--congestion",
        type=_checked(_congestion),
        default=CONGESTION,
        help=f"TCP congestion control of the hosts (default {CONGESTION}); 'machine': keep "
        "the machine's default",
    )
    parser.add_argument("--out", default="results/netbench")
    parser.add_argument(
        "--timeout",
        type=_checked(float, lambda t: t > 0, "> 0"),
        default=1800,
        help="seconds per job",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; return the exit code."""
    args = build_parser().parse_args(argv)
    cfg = dict(PRESETS[args.preset])
    cfg.update({k: v for k, v in vars(args).items() if v is not None and k in cfg})
    reason = preflight()
    if reason:
        print(f"netbench: cannot run: {reason}", file=sys.stderr)
        return 1
    rates = parse_rates(cfg["rates"])
    accuracy_rate = parse_rate(cfg["accuracy_rate"])
    if cfg["accuracy_steps"] and accuracy_rate not in rates:
        rates.append(accuracy_rate)
    layouts = _layouts(cfg["ranks_per_host"])
    models = [m for m in cfg["models"].split(",") if m]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    accuracy: list[dict] = []
    start = time.monotonic()
    for rate in rates:
        congestion = None if args.congestion == "machine" else args.congestion
        with Cluster(cfg["hosts"], rate, congestion=congestion) as cluster:
            for per_host in layouts if models else []:
                print(f"netbench: {format_rate(rate)}, {cfg['hosts']} hosts x {per_host} "
                      f"ranks ({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
                rows += run_job(cluster, per_host, _worker_args(cfg, args, per_host, models),
                                out, timeout=args.timeout)  # fmt: skip
                (out / "rows.json").write_text(json.dumps(rows, indent=1) + "\n")
            if cfg["accuracy_steps"] and rate == accuracy_rate:
                print(f"netbench: time to accuracy at {format_rate(rate)} "
                      f"({time.monotonic() - start:.0f} s)", flush=True)  # fmt: skip
                worker = ["--steps", str(cfg["accuracy_steps"])]
                if args.accuracy_strategies:
                    worker += ["--strategies", args.accuracy_strategies]
                accuracy = run_job(cluster, layouts[0], worker, out, timeout=args.timeout,
                                   module="benchmarks.netbench.accuracy")  # fmt: skip
                (out / "accuracy.json").write_text(json.dumps(accuracy, indent=1) + "\n")
    text = _markdown(args.preset, cfg, rows, accuracy, models, out, time.monotonic() - start)
    (out / "results.md").write_text(text)
    print(text)
    return 0


def _worker_args(cfg: dict, args: argparse.Namespace, per_host: int, models: list[str]):
    strategies = args.strategies or ",".join(
        s for s in STRATEGIES if (s in TWO_PER_HOST if per_host > 1 else s != "hier-atc")
    )
    return [
        "--models", ",".join(models), "--strategies", strategies,
        "--batch", str(cfg["batch"]), "--warmup", str(cfg["warmup"]),
        "--steps", str(cfg["steps"]), "--reps", str(cfg["reps"]),
    ]  # fmt: skip


def _markdown(preset, cfg, rows, accuracy, models, out: Path, seconds: float) -> str:
    """results.md: the throughput table and targets, the plots, the time-to-accuracy table."""
    used = sorted({str(r.get("congestion")) for r in rows + accuracy})
    parts = [
        f"# netbench ({preset}): {cfg['hosts']} hosts, gloo, TCP congestion control "
        f"{', '.join(used)}; {seconds:.0f} s"
    ]
    if rows:
        agg = report.aggregate(rows)
        targets = "\n".join(f"- {t}" for t in report.targets(agg))
        parts += [
            f"## Throughput\n\nBatch {cfg['batch']} per rank, {cfg['warmup']} warm-up + "
            f"{cfg['steps']} timed steps, {cfg['reps']} alternated repetitions.",
            report.markdown_table(agg),
            report.COLUMNS,
            "### Targets\n\n" + (targets or "(judged at 1 rank per host)"),
        ]
        for model in models:
            report.plot(agg, model, out / f"{model}.png")
            parts.append(f"![{model}]({model}.png)")
    if accuracy:
        report.plot_accuracy(accuracy, out / "accuracy.png")
        first = accuracy[0]
        parts += [
            f"## Time to accuracy\n\nDigits, MLP of {first['params_bytes'] / 1e6:.1f} MB, "
            f"batch {first['batch']} per rank, SGD with momentum, {first['steps']} steps; "
            f"target {first['target']:.0%} mean test accuracy of the ranks' models.",
            report.accuracy_table(accuracy),
            "\n".join(f"- {t}" for t in report.accuracy_targets(accuracy)),
            "![accuracy](accuracy.png)",
        ]
    return "\n\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.exit(main())
