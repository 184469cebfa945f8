"""Window puts on the emulated network beside the raw exchange of the same bytes.

    python -m benchmarks.netbench.windows [--rates 1gbit] [--hosts 4] [--mb 21] [--reps 5]
        [--out results/netbench-windows]                      # as root

Each host runs one rank (static rendezvous at host 0, gloo on the host's shaped ``eth0``).
Every rank sends ``--mb`` MB of float32 to each of its out-neighbours in
``exponential_two(n)`` and receives as much from each in-neighbour, four ways, alternated,
a barrier before each: the raw exchange (``isend``/``irecv``, receives posted first, each
direction of a pair on its own gloo group), ``gossamer.neighbor_allreduce`` over the
graph, and ``Window.put`` to every out-neighbour of one window, and of three windows of a
third each (the buckets of an optimizer), waited for until every put is visible at its
destination. The time of one repetition is the slowest rank's; the table shows medians
and each row against the raw exchange. Writes ``<out>/windows.{json,md}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.netbench.cluster import Cluster, format_rate, parse_rates, preflight
from benchmarks.netbench.runner import checked, job_arguments, publish, run_job


def _rates(text: str) -> str:
    try:
        parse_rates(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _cases(numel: int) -> dict:
    """The four exchanges of one rank, by name (collective to build: windows, groups)."""
    import torch
    import torch.distributed as dist

    import gossamer
    from gossamer import topology
    from gossamer.windows import Window

    rank, size = gossamer.rank(), gossamer.size()
    graph = topology.exponential_two(size)
    gossamer.set_topology(graph)
    x = torch.randn(numel)
    outs, ins = sorted(graph.out_neighbors(rank)), sorted(graph.in_neighbors(rank))
    up, down = dist.new_group(), dist.new_group()
    received = {s: torch.empty_like(x) for s in ins}
    one = [Window.create(x.clone(), name="netbench_windows_one")]
    three = [
        Window.create(t.clone(), name=f"netbench_windows_{i}")
        for i, t in enumerate(x.tensor_split(3))
    ]

    def raw() -> None:
        works = [dist.irecv(received[s], s, down if s > rank else up) for s in ins]
        works += [dist.isend(x, d, down if rank > d else up) for d in outs]
        for work in works:
            work.wait()

    def put(windows: list) -> None:
        for handle in [w.put(async_op=True) for w in windows]:
            handle.wait()

    return {
        "raw isend/irecv": raw,
        "neighbor_allreduce": lambda: gossamer.neighbor_allreduce(x),
        "Window.put, 1 window": lambda: put(one),
        "Window.put, 3 windows": lambda: put(three),
    }, one + three


def rank_main(argv: list[str]) -> None:
    """One rank (started by ``gossamer run`` on a host)."""
    import torch
    import torch.distributed as dist

    import gossamer

    parser = argparse.ArgumentParser()
    job_arguments(parser)
    parser.add_argument("--mb", type=float, required=True)
    parser.add_argument("--reps", type=int, required=True)
    args = parser.parse_args(argv)
    gossamer.init()
    cases, windows = _cases(int(args.mb * 1e6 / 4))
    times: dict[str, list[float]] = {name: [] for name in cases}
    for fn in cases.values():  # warm-up: connections, buffers
        fn()
    for _ in range(args.reps):
        for name, fn in cases.items():
            dist.barrier()
            start = time.perf_counter()
            fn()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            times[name].append(elapsed.item())
    for window in windows:
        window.free()
    if gossamer.rank() == 0:
        rows = [{"case": name, "seconds": t} for name, t in times.items()]
        Path(args.out).write_text(json.dumps(rows))
    gossamer.shutdown()


def main(argv: list[str] | None = None) -> int:
    """Run the probe at every rate; print and write the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=_rates, default="1gbit", help="e.g. 1gbit,100mbit")
    parser.add_argument("--hosts", type=checked(int, lambda n: n >= 2, ">= 2"), default=4)
    parser.add_argument(
        "--mb",
        type=checked(float, lambda x: x > 0, "> 0"),
        default=21.0,
        help="MB per neighbour and call",
    )
    parser.add_argument("--reps", type=checked(int, lambda n: n >= 1, ">= 1"), default=5)
    parser.add_argument("--out", type=Path, default=Path("results/netbench-windows"))
    args = parser.parse_args(argv)
    reason = preflight()
    if reason:
        print(f"netbench windows: cannot run: {reason}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for rate in parse_rates(args.rates):
        with Cluster(args.hosts, rate) as cluster:
            found = run_job(
                cluster, 1, ["--mb", str(args.mb), "--reps", str(args.reps)], args.out,
                module="benchmarks.netbench.windows",
            )  # fmt: skip
        rows += [row | {"rate": format_rate(rate), "hosts": args.hosts} for row in found]
    lines = ["| rate | exchange | median ms | all ms | x raw |", "|---|---|---:|---:|---:|"]
    for rate in dict.fromkeys(r["rate"] for r in rows):
        mine = [r for r in rows if r["rate"] == rate]
        raw = statistics.median(mine[0]["seconds"])
        for r in mine:
            median = statistics.median(r["seconds"])
            runs = ", ".join(f"{1000 * t:.0f}" for t in r["seconds"])
            lines.append(
                f"| {rate} | {r['case']} | {1000 * median:.1f} | {runs} | {median / raw:.2f} |"
            )
    publish(args.out, "windows", lines, rows)
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1:])
    else:
        sys.exit(main())
