"""Latency and throughput of window put / accumulate / get beside raw send/recv.

    gossamer run -np 4 benchmarks/bench_windows.py [--preset smoke] [--out results]
    gossamer run -np 4 benchmarks/bench_windows.py --scaling [--calls N] [--blocks B]

Latency: rank 0 operates on rank 1 (get: rank 1 fetches from rank 0) while the other ranks
serve; one repetition is one blocking operation, i.e. until the data is visible at the
target. The raw equivalent is a send plus a one-element acknowledgement (for get: a
one-element request plus the reply), on the main thread.
Throughput: every rank puts (accumulates, gets) to its ring neighbour at once, ``--depth``
operations in flight each; GB/s of payload over all ranks. Raw: concurrent isend/irecv.
Scaling (``--scaling``): every rank calls blocking ``accumulate`` (to its out-neighbours in
the exponential-two graph, as ``win_accumulate`` does by default) ``--calls`` times, with
``require_mutex`` and then without; calls/s summed over the ranks, per block of calls and for
the first and the last 10 % of the calls (the service must not slow down with its history),
and the accumulates lost (the sum at every target against the expected total).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch
import torch.distributed as dist

import gossamer
from gossamer import topology as topo

PRESETS = {
    "full": ([1_000, 10_000, 100_000, 1_000_000, 10_000_000], 15),
    "smoke": ([1_000, 100_000], 3),
}
# calls per rank for --scaling: 4 ranks x 25,000 = 10^5 accumulates
SCALING_CALLS = {"full": 25_000, "smoke": 200}


def _raw_write(x, ack, rank):
    if rank == 0:
        dist.send(x, 1)
        dist.recv(ack, 1)
    elif rank == 1:
        dist.recv(x, 0)
        dist.send(ack, 0)


def _raw_read(x, ack, rank):
    if rank == 1:
        dist.send(ack, 0)
        dist.recv(x, 0)
    elif rank == 0:
        dist.recv(ack, 1)
        dist.send(x, 1)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def latency(win, x, reps):
    rank = gossamer.rank()
    ack = torch.zeros(1)
    cases = {
        "raw send + ack": lambda: _raw_write(x, ack, rank),
        "put": lambda: win.put(dst_weights={1: 1.0}) if rank == 0 else None,
        "accumulate": lambda: win.accumulate(dst_weights={1: 1.0}) if rank == 0 else None,
        "raw request + reply": lambda: _raw_read(x, ack, rank),
        "get": lambda: win.get(src_weights={0: 1.0}) if rank == 1 else None,
    }
    times = {k: [] for k in cases}
    for _ in range(reps):
        for name, fn in cases.items():
            times[name].append(_timed(fn))
    return {k: statistics.median(v) for k, v in times.items()}


def throughput(win, x, depth):
    rank, size = gossamer.rank(), gossamer.size()
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    buf = torch.empty_like(x)

    def raw():
        works = []
        for _ in range(depth):
            works += [dist.isend(x, nxt), dist.irecv(buf, prv)]
        for w in works:
            w.wait()

    def window(op):
        def run():
            handles = [op() for _ in range(depth)]
            for h in handles:
                h.wait()

        return run

    cases = {
        "raw isend/irecv": raw,
        "put": window(lambda: win.put(async_op=True)),
        "accumulate": window(lambda: win.accumulate(async_op=True)),
        "get": window(lambda: win.get(async_op=True)),
    }
    total = x.numel() * x.element_size() * depth * size
    return {k: total / min(_timed(fn) for _ in range(3)) / 1e9 for k, fn in cases.items()}


def _rate(stamps, lo: int, hi: int) -> float:
    """Calls per second over calls ``lo`` .. ``hi`` (``stamps[i]``: time when call i ended)."""
    return (hi - lo) / (stamps[hi] - stamps[lo])


def scaling(numel: int, calls: int, blocks: int, require_mutex: bool) -> dict:
    """Blocking accumulates, one call after another on every rank; rates summed over ranks."""
    rank, size = gossamer.rank(), gossamer.size()
    x = torch.full((numel,), float(rank + 1), dtype=torch.float64)
    graph = topo.exponential_two(size)
    with gossamer.Window.create(x, zero_init=True, topology=graph) as win:
        stamps = [0.0] * (calls + 1)
        dist.barrier()
        stamps[0] = time.perf_counter()
        for i in range(calls):
            win.accumulate(require_mutex=require_mutex)
            stamps[i + 1] = time.perf_counter()
        dist.barrier()
        bufs = win.buffers()
    # every in-neighbour s added x_s = s + 1 into each element, once per call
    lost = sum(calls - round(b.sum().item() / (numel * (s + 1))) for s, b in bufs.items())
    tenth = max(calls // 10, 1)
    edges = [calls * k // blocks for k in range(blocks + 1)]
    mine = torch.tensor(
        [_rate(stamps, 0, tenth), _rate(stamps, calls - tenth, calls), lost]
        + [_rate(stamps, a, b) for a, b in itertools.pairwise(edges)],
        dtype=torch.float64,
    )
    dist.all_reduce(mine)  # rates add over ranks; so do the lost accumulates
    return {
        "require_mutex": require_mutex,
        "calls_per_rank": calls,
        "first_10pct_calls_per_s": mine[0].item(),
        "last_10pct_calls_per_s": mine[1].item(),
        "last_over_first": mine[1].item() / mine[0].item(),
        "lost": int(mine[2].item()),
        "block_calls_per_s": mine[3:].tolist(),
        "block_edges": edges,
    }


def main_scaling(args) -> None:
    calls = args.calls or SCALING_CALLS[args.preset]
    size = gossamer.size()
    rows = [scaling(args.numel, calls, args.blocks, mutex) for mutex in (True, False)]
    if gossamer.rank() != 0:
        return
    lines = [
        "| path | calls | first 10 % calls/s | last 10 % calls/s | last / first | lost |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {'mutex' if row['require_mutex'] else 'plain'} | {size} x {calls} | "
            f"{row['first_10pct_calls_per_s']:.1f} | {row['last_10pct_calls_per_s']:.1f} | "
            f"{row['last_over_first']:.2f} | {row['lost']} |"
        )
    text = "\n".join(lines)
    print(
        f"{size} ranks, gloo, blocking accumulate of {args.numel} float64 to the "
        "exponential-two out-neighbours; calls/s summed over ranks\n"
    )
    for row in rows:
        path = "mutex" if row["require_mutex"] else "plain"
        per_block = " ".join(f"{v:.0f}" for v in row["block_calls_per_s"])
        print(f"{path} calls/s per block of {calls // args.blocks}: {per_block}")
    print()
    print(text)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_windows_scaling.md").write_text(text + "\n")
    (out / "bench_windows_scaling.json").write_text(json.dumps(rows, indent=2) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument(
        "--depth", type=argtypes.POSITIVE, default=4, help="operations in flight per rank"
    )
    parser.add_argument("--out", default="results")
    parser.add_argument(
        "--scaling", action="store_true", help="long run of accumulates instead (see above)"
    )
    parser.add_argument("--calls", type=int, help="--scaling: calls per rank (default: preset)")
    parser.add_argument(
        "--blocks", type=argtypes.POSITIVE, default=10, help="--scaling: blocks reported"
    )
    parser.add_argument(
        "--numel", type=argtypes.POSITIVE, default=1_000, help="--scaling: window elements"
    )
    args = parser.parse_args()
    if args.calls is not None and args.calls < max(args.blocks, 10):
        parser.error(
            f"argument --calls: must be at least 10 and at least --blocks ({args.blocks}); "
            f"got {args.calls}"
        )
    if args.calls is None and SCALING_CALLS[args.preset] < args.blocks:
        parser.error(
            f"argument --blocks: must be <= the {SCALING_CALLS[args.preset]} calls of "
            f"--preset {args.preset} (or give --calls); got {args.blocks}"
        )
    gossamer.init()
    if gossamer.size() < 2:
        raise SystemExit("bench_windows needs at least 2 ranks: gossamer run -np 4 ...")
    if args.scaling:
        main_scaling(args)
        gossamer.shutdown()
        return
    sizes, reps = PRESETS[args.preset]
    gossamer.set_topology(topo.ring(gossamer.size(), style="right"))
    rows = []
    for numel in sizes:
        x = torch.randn(numel)
        with gossamer.Window.create(x, zero_init=True) as win:
            lat = latency(win, x, reps)
            thr = throughput(win, x, args.depth)
        rows.append((numel, lat, thr))
    if gossamer.rank() == 0:
        lines = [
            "| elements | raw send+ack ms | put ms | accumulate ms | raw req+reply ms | get ms "
            "| raw GB/s | put GB/s | accumulate GB/s | get GB/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for numel, lat, thr in rows:
            ms = [
                lat[k] * 1e3
                for k in ("raw send + ack", "put", "accumulate", "raw request + reply", "get")
            ]
            gbs = [thr[k] for k in ("raw isend/irecv", "put", "accumulate", "get")]
            lines.append(
                f"| {numel:.0e} | "
                + " | ".join(f"{v:.3f}" for v in ms)
                + " | "
                + " | ".join(f"{v:.2f}" for v in gbs)
                + " |"
            )
        text = "\n".join(lines)
        print(
            f"{gossamer.size()} ranks, gloo, latency: median of {reps}; throughput: "
            f"{args.depth} in flight per rank, best of 3\n"
        )
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_windows.md").write_text(text + "\n")
        (out / "bench_windows.json").write_text(
            json.dumps(
                [{"numel": n, "latency_s": lat, "throughput_GBps": thr} for n, lat, thr in rows],
                indent=2,
            )
            + "\n"
        )
    gossamer.shutdown()


if __name__ == "__main__":
    main()
