"""Latency and throughput of window put / accumulate / get beside raw send/recv.

    gossamer run -np 4 benchmarks/bench_windows.py [--preset smoke] [--out results]

Latency: rank 0 operates on rank 1 (get: rank 1 fetches from rank 0) while the other ranks
serve; one repetition is one blocking operation, i.e. until the data is visible at the
target. The raw equivalent is a send plus a one-element acknowledgement (for get: a
one-element request plus the reply), on the main thread.
Throughput: every rank puts (accumulates, gets) to its ring neighbour at once, ``--depth``
operations in flight each; GB/s of payload over all ranks. Raw: concurrent isend/irecv.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import gossamer
from gossamer import topology as topo

PRESETS = {
    "full": ([1_000, 10_000, 100_000, 1_000_000, 10_000_000], 15),
    "smoke": ([1_000, 100_000], 3),
}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--depth", type=int, default=4, help="operations in flight per rank")
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    gossamer.init()
    if gossamer.size() < 2:
        raise SystemExit("bench_windows needs at least 2 ranks: gossamer run -np 4 ...")
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
