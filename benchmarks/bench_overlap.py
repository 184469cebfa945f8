"""Where an overlapped step's time goes: the timeline of ATC and AWC one-peer, per step.

    gossamer run -np 4 benchmarks/bench_overlap.py [--steps 20] [--reps 3] [--out results]

Trains the MLP of ``benchmarks/netbench`` (5 hidden layers of 1024, 5.26 M parameters) on
random data with each strategy (``atc-forward`` is ATC with ``send_order="forward"``) in
turn (alternated, ``--reps`` times), records the timeline, and prints per strategy the
median over steps and ranks of: the step (wall time from one ``zero_grad`` to the next),
the forward pass, the backward pass (which takes ATC's local steps and queues its rounds),
``step()``, and the time the optimizer waited for combines (``"waiting for combine"``
spans; for ATC those are in the forward pre-hooks, so inside the forward pass).
``--trace`` keeps the merged trace file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch
from torch import nn

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.models import MLP
from gossamer.profiling import timeline

STRATEGIES = ("atc/one-peer", "atc-forward/one-peer", "awc/one-peer")
_ROW = "bench"


def wrap(strategy: str, model: nn.Module, fusion_bytes: int):
    """The optimizer of ``strategy`` around plain SGD on ``model``."""
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    schedule = topo.one_peer_exponential(topo.exponential_two(gossamer.size()), gossamer.rank())
    options = {"schedule": schedule, "fusion_threshold_bytes": fusion_bytes}
    if strategy == "awc/one-peer":
        return optim.AdaptWithCombine(sgd, model, **options)
    # "atc/one-peer": rounds in backward order; "atc-forward/one-peer": send_order="forward"
    order = "forward" if strategy.startswith("atc-forward") else "backward"
    return optim.AdaptThenCombine(sgd, model, send_order=order, **options)


def run(strategy: str, args: argparse.Namespace) -> list[float]:
    """Train ``args.steps`` timed steps; the wall time of each."""
    torch.manual_seed(0)
    model = MLP(1024, 1024, 10, depth=5)
    opt = wrap(strategy, model, int(args.fusion_mib * 2**20))
    x, y = torch.randn(args.batch, 1024), torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        with timeline.activity(_ROW, "forward"):
            loss = loss_fn(model(x), y)
        with timeline.activity(_ROW, "backward"):
            loss.backward()
        with timeline.activity(_ROW, "step"):
            opt.step()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        with timeline.activity(_ROW, strategy):
            step()
        times.append(time.perf_counter() - start)
    opt.synchronize()
    gossamer.barrier()
    return times


def spans(path: Path) -> list[tuple[int, str, str, float, float]]:
    """``(rank, row, label, start us, duration us)`` of every complete span in a trace."""
    events = json.loads(path.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    rows = {
        (e["pid"], e["tid"]): e["args"]["name"]
        for e in events
        if e.get("ph") == "M" and e.get("name") == "thread_name"
    }
    return [
        (e["pid"], rows.get((e["pid"], e["tid"]), "?"), e["name"], e["ts"], e["dur"])
        for e in events
        if e.get("ph") == "X"
    ]


def per_step(found: list[tuple], strategy: str) -> dict[str, list[float]]:
    """Per timed step of ``strategy`` and rank: its phases and the waits inside it (ms)."""
    steps = [(r, t, t + d) for r, row, name, t, d in found if row == _ROW and name == strategy]
    out: dict[str, list[float]] = {k: [] for k in ("forward", "backward", "step", "waiting")}
    for rank, lo, hi in steps:
        inside = [(row, name, d) for r, row, name, t, d in found if r == rank and lo <= t <= hi]
        for phase in ("forward", "backward", "step"):
            out[phase] += [d / 1e3 for row, name, d in inside if row == _ROW and name == phase]
        waits = [d for _, name, d in inside if name == "waiting for combine"]
        out["waiting"].append(sum(waits) / 1e3)
    return out


def _strategies(text: str) -> list[str]:
    """An argparse ``type=``: comma-separated names from ``STRATEGIES``."""
    names = text.split(",")
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown:
        # wrap() would train any other name as ATC and label its row with that name.
        raise argparse.ArgumentTypeError(
            f"unknown strategy {unknown[0]!r} in {text!r}; choose from {', '.join(STRATEGIES)}"
        )
    return names


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategies",
        type=_strategies,
        default=list(STRATEGIES),
        help=f"comma-separated, from {','.join(STRATEGIES)} (default: all)",
    )
    # Medians over the timed steps and reps: at least one of each.
    parser.add_argument("--steps", type=argtypes.at_least(1), default=20)
    parser.add_argument("--warmup", type=argtypes.at_least(0), default=3)
    parser.add_argument("--reps", type=argtypes.at_least(1), default=3)
    parser.add_argument("--batch", type=argtypes.at_least(1), default=32)
    parser.add_argument("--fusion-mib", type=float, default=8.0)
    parser.add_argument("--trace", default=None, help="keep the trace files under this prefix")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    gossamer.init()
    strategies = args.strategies
    # Without --trace the trace is only read here: it goes into a folder of this run's own
    # (no clash with another run), removed at the end.
    with tempfile.TemporaryDirectory(prefix="bench_overlap.") as scratch:
        prefix = args.trace or str(Path(scratch) / "bench_overlap")
        timeline.start_timeline(prefix, merged=True)
        walls: dict[str, list[float]] = {s: [] for s in strategies}
        for _ in range(args.reps):
            for s in strategies:
                walls[s] += run(s, args)
        files = timeline.stop_timeline()
        found = spans(files[0]) if gossamer.rank() == 0 else []
    if gossamer.rank() == 0:
        lines = [
            f"{gossamer.size()} ranks, MLP 5.26 M, batch {args.batch}, "
            f"{args.reps} x {args.steps} steps, buckets {args.fusion_mib} MiB",
            "",
            "| strategy | step ms | forward ms | backward ms | step() ms | waiting ms |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        table = {}
        for s in strategies:
            phases = per_step(found, s)
            med = {k: statistics.median(v) if v else 0.0 for k, v in phases.items()}
            med["wall"] = statistics.median(walls[s]) * 1e3
            table[s] = med
            lines.append(
                f"| {s} | {med['wall']:.1f} | {med['forward']:.1f} | {med['backward']:.1f} "
                f"| {med['step']:.1f} | {med['waiting']:.1f} |"
            )
        text = "\n".join(lines)
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_overlap.md").write_text(text + "\n")
        (out / "bench_overlap.json").write_text(json.dumps(table, indent=2) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
