"""Latency of gossamer's operations beside the raw torch.distributed calls they build on.

    gossamer run -np 4 benchmarks/bench_ops.py [--preset smoke] [--sizes 1e6] [--reps 25]

It needs at least 2 ranks. For each size (float32 elements) and each operation, every
repetition starts after a barrier and its time is the slowest rank's; the table shows
medians and the ratio of each gossamer operation to its raw torch.distributed equivalent:

- ``allreduce`` / ``allreduce_`` vs ``torch all_reduce`` (in place, then / n),
- dynamic one-peer ``neighbor_allreduce`` vs a raw ``batch_isend_irecv`` one-peer exchange
  followed by the same averaging written by hand (preallocated receive buffers),
- static exponential-two ``neighbor_allreduce`` vs the same with the exp-2 peers.

The bare exchange (no arithmetic) is shown too. gossamer's cost over the raw equivalent is
the call header that catches mismatched calls (a repeated call of 1e6 floats between ranks
of one machine sends none) and the hand-off to the communication thread; two one-peer
probes time each alone (the raw exchange after a raw 16-integer header round, and the raw
exchange run on gossamer's communication thread).
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
from gossamer import transport

PRESETS = {
    "full": ([10_000, 1_000_000, 10_000_000], 25),
    "smoke": ([10_000, 100_000], 5),
    "big": ([10_000_000], 8),
}


def _raw_exchange(x, recv, dsts, srcs):
    ops = [dist.P2POp(dist.isend, x, d) for d in dsts]
    ops += [dist.P2POp(dist.irecv, recv[s], s) for s in srcs]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def _raw_mix(x, recv, dsts, srcs):
    """What a user would write by hand: the exchange, then (x + sum of received) / (k + 1)."""
    _raw_exchange(x, recv, dsts, srcs)
    y = torch.add(x, recv[srcs[0]])
    for s in srcs[1:]:
        y.add_(recv[s])
    return y.div_(len(srcs) + 1)


def _cases(x, rank, size):
    graph = topo.exponential_two(size)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    peers = {
        "one-peer": ([nxt], [prv]),
        "exp-2": (list(graph.out_neighbors(rank)), list(graph.in_neighbors(rank))),
    }
    bufs = {k: {s: torch.empty_like(x) for s in v[1]} for k, v in peers.items()}

    def torch_allreduce():
        y = x.clone()
        dist.all_reduce(y)
        y /= size

    def torch_allreduce_inplace():
        dist.all_reduce(x)

    cases = {
        ("allreduce", "torch all_reduce (clone, /n)"): torch_allreduce,
        ("allreduce", "gossamer allreduce"): lambda: gossamer.allreduce(x),
        ("allreduce in place", "torch all_reduce"): torch_allreduce_inplace,
        ("allreduce in place", "gossamer allreduce_"): lambda: gossamer.allreduce_(
            x, average=False
        ),
    }
    for name, (dsts, srcs) in peers.items():
        cases[(name, "raw batch_isend_irecv + combine")] = lambda d=dsts, s=srcs, b=bufs[name]: (
            _raw_mix(x, b, d, s)
        )
        cases[(name, "raw batch_isend_irecv only")] = lambda d=dsts, s=srcs, b=bufs[name]: (
            _raw_exchange(x, b, d, s)
        )
    # Where neighbor_allreduce's time goes beyond the raw exchange: its header round (a
    # 16-integer exchange before the data), and the hand-off to the communication thread.
    dsts, srcs = peers["one-peer"]
    head, head_in = torch.zeros(16, dtype=torch.int64), {prv: torch.zeros(16, dtype=torch.int64)}

    def two_rounds():
        _raw_exchange(head, head_in, dsts, srcs)
        _raw_mix(x, bufs["one-peer"], dsts, srcs)

    cases[("one-peer", "probe: raw header round, then + combine")] = two_rounds
    cases[("one-peer", "probe: raw + combine on gossamer's thread")] = lambda: transport.run(
        "probe", lambda: _raw_mix(x, bufs["one-peer"], dsts, srcs), False
    )
    cases[("one-peer", "gossamer neighbor_allreduce")] = lambda: gossamer.neighbor_allreduce(
        x, self_weight=0.5, src_weights={prv: 0.5}, dst_weights=[nxt]
    )
    cases[("exp-2", "gossamer neighbor_allreduce")] = lambda: gossamer.neighbor_allreduce(
        x, topology=graph
    )
    return cases


def _time(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def measure(numel: int, reps: int) -> dict:
    rank, size = gossamer.rank(), gossamer.size()
    x = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
    cases = _cases(x, rank, size)
    times: dict = {key: [] for key in cases}
    for fn in cases.values():  # warm-up: connections, allocator
        fn()
        fn()
    for _ in range(reps):  # round robin, so drift hits every case alike
        for key, fn in cases.items():
            times[key].append(_time(fn))
    return {key: statistics.median(t) for key, t in times.items()}


_ORDER = ["allreduce", "allreduce in place", "one-peer", "exp-2"]


def table(results: dict) -> str:
    lines = [
        "| elements | group | operation | median ms | ratio to raw |",
        "|---:|---|---|---:|---:|",
    ]
    for numel, medians in results.items():
        base: dict = {}
        for (group, name), t in sorted(medians.items(), key=lambda kv: _ORDER.index(kv[0][0])):
            ratio = f"{t / base[group]:.3f}" if group in base else "1 (raw)"
            base.setdefault(group, t)
            lines.append(f"| {numel:.0e} | {group} | {name} | {t * 1e3:.3f} | {ratio} |")
    return "\n".join(lines)


def _checked(convert):
    """An argparse ``type=``: ``convert(text)``, its ValueError an error of the option."""

    def parse(text: str):
        try:
            return convert(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(f"{err}; got {text}") from None

    return parse


def _count(text: str) -> int:
    """A whole number >= 1, also written as a float (``1e6``)."""
    try:
        value = float(text)
    except ValueError:
        raise ValueError("must be a whole number >= 1") from None
    if not value.is_integer() or value < 1:
        raise ValueError("must be a whole number >= 1")
    return int(value)


def _counts(text: str) -> list[int]:
    return [_count(part) for part in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="full")
    parser.add_argument("--out", default="results", help="folder for bench_ops.{md,json}")
    parser.add_argument(
        "--sizes",
        type=_checked(_counts),
        help="comma-separated element counts, e.g. 1e4,1e6 (instead of the preset's)",
    )
    parser.add_argument(
        "--reps", type=_checked(_count), help="repetitions, >= 1 (instead of the preset's)"
    )
    args = parser.parse_args()
    gossamer.init()
    if gossamer.size() < 2:  # a world of one has nobody to exchange with
        size = gossamer.size()
        gossamer.shutdown()
        parser.error(
            f"needs at least 2 ranks (it times exchanges between ranks); got {size}: "
            "run it under the launcher, e.g. gossamer run -np 4 benchmarks/bench_ops.py"
        )
    sizes, reps = PRESETS[args.preset]
    sizes = args.sizes if args.sizes is not None else sizes
    reps = args.reps if args.reps is not None else reps
    results = {n: measure(n, reps) for n in sizes}
    if gossamer.rank() == 0:
        text = table(results)
        print(f"{gossamer.size()} ranks, gloo, {reps} repetitions, median of slowest rank\n")
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench_ops.md").write_text(text + "\n")
        flat = {str(n): {" / ".join(k): v for k, v in m.items()} for n, m in results.items()}
        (out / "bench_ops.json").write_text(json.dumps(flat, indent=2) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
