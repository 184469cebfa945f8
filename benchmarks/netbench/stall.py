"""A rank killed on the emulated network: time from the kill to the survivors' next step.

    python -m benchmarks.netbench.stall [--rates 1gbit,100mbit] [--hosts 4] [--steps 16]
        [--kill-at 6] [--out results/netbench-stall]          # as root

Each host runs ``gossamer run --elastic`` with one rank, as on separate machines (static
rendezvous at host 0; gloo on the host's shaped ``eth0``). Every rank trains the netbench
MLP (21 MB) with elastic adapt-with-combine over ``exponential_two(n)``, and calls
``synchronize()`` after each step, so a step is complete when it returns. At step
``--kill-at`` the last host's rank SIGKILLs itself; its host's agent writes its tombstone
into the store (served by host 0's agent), the survivors' next exchange with it fails, and
they go on among themselves. Per survivor: the time from the kill to its next completed
step (which may be the step in flight, not needing the dead rank's next value), its median
step before the kill, its longest step after it, and the stall: longest minus median. One
clock serves every namespace, so the times compare. Writes ``<out>/stall.{json,md}``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

_KEY = "netbench_stall/"


def rank_main(argv: list[str]) -> None:
    """One rank (started by ``gossamer run`` on a host)."""
    import torch

    import gossamer
    from benchmarks.netbench.runner import job_arguments
    from benchmarks.netbench.worker import MODELS
    from gossamer import context, optim, topology

    parser = argparse.ArgumentParser()
    job_arguments(parser)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    store = context.runtime().store
    make_model, make_input = MODELS["mlp"]
    torch.manual_seed(0)
    model = make_model()
    sgd = torch.optim.SGD(model.parameters(), lr=0.01)
    opt = optim.AdaptWithCombine(sgd, model, topology=topology.exponential_two(size), elastic=True)
    done = []
    for step in range(args.steps):
        if rank == size - 1 and step == args.kill_at:
            store.set(f"{_KEY}killed_at", repr(time.time()))
            os.kill(os.getpid(), signal.SIGKILL)
        opt.zero_grad()
        model(make_input(args.batch)).square().mean().backward()
        opt.step()
        opt.synchronize()
        done.append(time.time())
    store.set(f"{_KEY}{rank}", json.dumps(done))
    live = gossamer.live_ranks()
    if rank == min(live):
        killed = float(store.get(f"{_KEY}killed_at"))
        rows = [_row(r, json.loads(store.get(f"{_KEY}{r}")), killed) for r in live]
        meta = json.loads(args.meta)
        Path(args.out).write_text(json.dumps([row | meta for row in rows], indent=1) + "\n")
    gossamer.shutdown()


def _row(rank: int, done: list[float], killed: float) -> dict:
    steps = [(b - a, b) for a, b in itertools.pairwise(done)]  # (duration, end)
    median = statistics.median(d for d, end in steps if end < killed)
    longest = max(d for d, end in steps if end > killed)
    return {
        "rank": rank,
        "next_step_s": next(t for t in done if t > killed) - killed,
        "median_step_before_s": median,
        "longest_step_after_s": longest,
        "stall_s": longest - median,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the stall job at every rate; print and write the table."""
    from benchmarks.netbench.cluster import Cluster, format_rate, parse_rates, preflight
    from benchmarks.netbench.runner import publish, run_job

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="1gbit,100mbit")
    parser.add_argument("--hosts", type=int, default=4)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--kill-at", type=int, default=6)
    parser.add_argument("--out", type=Path, default=Path("results/netbench-stall"))
    args = parser.parse_args(argv)
    if not 2 <= args.kill_at < args.steps - 1:
        parser.error(f"--kill-at must be in [2, steps - 1); got {args.kill_at}")
    reason = preflight()
    if reason:
        print(f"netbench stall: cannot run: {reason}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    worker = ["--steps", str(args.steps), "--kill-at", str(args.kill_at)]
    rows = []
    for rate in parse_rates(args.rates):
        with Cluster(args.hosts, rate) as cluster:
            found = run_job(
                cluster, 1, worker, args.out, module="benchmarks.netbench.stall",
                launcher_args=("--elastic",), lost_host=args.hosts - 1,
            )  # fmt: skip
        rows += [row | {"rate": format_rate(rate)} for row in found]
    lines = [
        "| rate | survivor | kill -> next completed step (s) | median step before (ms) "
        "| longest step after (ms) | stall: longest - median (s) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['rate']} | {r['rank']} | {r['next_step_s']:.2f} | "
            f"{1000 * r['median_step_before_s']:.0f} | {1000 * r['longest_step_after_s']:.0f} | "
            f"{r['stall_s']:.2f} |"
        )
    publish(args.out, "stall", lines, rows)
    return 0


if __name__ == "__main__":
    if "RANK" in os.environ:
        rank_main(sys.argv[1:])
    else:
        sys.exit(main())
