"""Where a ``gossamer.bagua`` step's time goes: compute, bucket copies, communication.

    gossamer run -np 2 benchmarks/bagua_overhead.py [--steps 20] [--reps 3] [--out results]

Trains the MLP of ``benchmarks/netbench`` (5 hidden layers of 1024, 5.26 M parameters, three
10 MiB buckets) on random data with plain SGD, wrapped by ``with_bagua`` with each algorithm
(decentralized ones with ``hierarchical=False`` so that they gossip on one host) and each
``do_flatten``, alternated ``--reps`` times, and prints per configuration the median over
steps and ranks, in milliseconds, of:

* ``step``: wall time of one training step (forward, backward, ``optimizer.step()``);
* ``compute``: the same step of the same model without ``with_bagua`` (no hooks);
* ``copy``: the bucket's own copies: everything a bucket's operations do outside their
  communicator's round (packing the tensors into the flat buffer, writing results back,
  the decentralized ``peer_weight`` copies), on whichever thread they run, as wall time
  and as CPU time of that thread (``copy cpu``, ``time.thread_time``: less sensitive to
  other processes on a shared host);
* ``comm``: the communicator rounds (``start`` to ``wait``; for the low-precision ring this
  includes compressing and decompressing; for ``decentralized``, whose op averages each
  segment into ``peer_weight`` as it arrives, the op's whole run, packing included);
* ``copy %``: ``copy / step``.

The pieces are timed with ``time.perf_counter`` around the bucket's methods (patched here,
for this benchmark only); the communication thread overlaps them with the backward pass, so
``copy`` and ``comm`` are work, not necessarily time added to the step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from pathlib import Path

import argtypes  # this folder: the script runs as a file
import torch
from torch import nn

import gossamer
import gossamer.bagua as bagua
from gossamer.bagua import bucket as bucket_mod
from gossamer.bagua.algorithms import decentralized, gradient_allreduce
from gossamer.models import MLP

ALGORITHMS = ("gradient_allreduce", "decentralized", "low_precision_decentralized")


class Clock:
    """Seconds spent in the patched bucket methods since the last :meth:`take`."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def take(self) -> dict[str, float]:
        """The sums so far (ms), reset."""
        out = {k: v * 1e3 for k, v in self.spent.items()}
        self.spent.clear()
        return out

    def patch(self) -> None:
        """Time ``execute`` (copy + comm), the rounds (comm) and ``copy_back_peer_weight``."""
        spent = self.spent

        def timed(cls, name, key):
            original = getattr(cls, name)

            def wrapper(*args, **kwargs):
                start, cpu = time.perf_counter(), time.thread_time()
                try:
                    return original(*args, **kwargs)
                finally:
                    spent[key] += time.perf_counter() - start
                    spent[key + " cpu"] += time.thread_time() - cpu

            setattr(cls, name, wrapper)

        timed(bucket_mod.BaguaBucket, "execute", "execute")
        timed(bucket_mod._Op, "_round", "comm")
        # Its segments are posted and waited for in run() itself, not through _round.
        timed(bucket_mod.DecentralizedSynchronousOp, "run", "comm")
        timed(bucket_mod.DecentralizedSynchronousOp, "copy_back_peer_weight", "copy_back")


def make_algorithm(name: str):
    """The algorithm ``name`` (decentralized ones gossip between ranks on one host)."""
    if name == "gradient_allreduce":
        return gradient_allreduce.GradientAllReduceAlgorithm()
    if name == "decentralized":
        return decentralized.DecentralizedAlgorithm(
            hierarchical=False, peer_selection_mode="shift_one"
        )
    if name == "low_precision_decentralized":
        return decentralized.LowPrecisionDecentralizedAlgorithm(hierarchical=False)
    raise ValueError(f"unknown algorithm {name!r}")


def run(config: str, args: argparse.Namespace, clock: Clock) -> list[dict[str, float]]:
    """Train ``args.steps`` timed steps of ``config``; per step its pieces (ms)."""
    torch.manual_seed(0)
    model = MLP(1024, 1024, 10, depth=5)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    if config != "compute":
        name, flatten = config.rsplit("/", 1)
        model = model.with_bagua([opt], make_algorithm(name), do_flatten=flatten == "flat")
    x, y = torch.randn(args.batch, 1024), torch.randint(0, 10, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    bagua.barrier()
    clock.take()
    out = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        wall = (time.perf_counter() - start) * 1e3
        spent = clock.take()
        comm = spent.get("comm", 0.0)
        copy = spent.get("execute", 0.0) - comm + spent.get("copy_back", 0.0)
        copy_cpu = (spent.get("execute cpu", 0.0) - spent.get("comm cpu", 0.0)) + spent.get(
            "copy_back cpu", 0.0
        )
        out.append({"step": wall, "copy": copy, "copy cpu": copy_cpu, "comm": comm})
    if config != "compute":
        model.bagua_ddp.detach()
    bagua.barrier()
    return out


def _names(allowed: tuple[str, ...]):
    """An argparse ``type=``: comma-separated names from ``allowed``."""

    def parse(text: str) -> str:
        unknown = [n for n in text.split(",") if n not in allowed]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {unknown[0]!r} in {text!r}; choose from {','.join(allowed)}"
            )
        return text

    return parse


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithms", type=_names(ALGORITHMS), default=",".join(ALGORITHMS))
    parser.add_argument(
        "--flatten",
        type=_names(("copy", "flat")),
        default="copy,flat",
        help="do_flatten False (copy), True",
    )
    # Medians over the timed steps and reps: at least one of each.
    parser.add_argument("--steps", type=argtypes.at_least(1), default=20)
    parser.add_argument("--warmup", type=argtypes.at_least(0), default=3)
    parser.add_argument("--reps", type=argtypes.at_least(1), default=3)
    parser.add_argument("--batch", type=argtypes.at_least(1), default=32)
    parser.add_argument("--out", default="results")
    args = parser.parse_args()
    bagua.init_process_group()
    torch.set_num_threads(1)  # one core per rank: ranks share the host
    clock = Clock()
    clock.patch()
    configs = ["compute"] + [
        f"{a}/{f}" for a in args.algorithms.split(",") for f in args.flatten.split(",")
    ]
    rows: dict[str, list[dict[str, float]]] = {c: [] for c in configs}
    for _ in range(args.reps):
        for c in configs:
            rows[c] += run(c, args, clock)
    gathered = [None] * bagua.get_world_size()
    torch.distributed.all_gather_object(gathered, rows)
    if bagua.get_rank() == 0:
        merged = {c: [r for ranks in gathered for r in ranks[c]] for c in configs}
        compute = statistics.median(r["step"] for r in merged["compute"])
        table = {}
        lines = [
            f"{bagua.get_world_size()} ranks (loopback, gloo), MLP 5.26 M, SGD, batch "
            f"{args.batch}, {args.reps} x {args.steps} steps; medians over steps and ranks (ms)",
            "",
            "| algorithm | do_flatten | step | compute | copy | copy cpu | comm | copy % |",
            "|---|---|---:|---:|---:|---:|---:|---:|",
        ]
        for c in configs[1:]:
            med = {k: statistics.median(r[k] for r in merged[c]) for k in merged[c][0]}
            med["compute"] = compute
            table[c] = med
            name, flatten = c.rsplit("/", 1)
            lines.append(
                f"| {name} | {flatten == 'flat'} | {med['step']:.1f} | {compute:.1f} "
                f"| {med['copy']:.1f} | {med['copy cpu']:.1f} | {med['comm']:.1f} "
                f"| {100 * med['copy'] / med['step']:.1f} |"
            )
        text = "\n".join(lines)
        print(text)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "bagua_overhead.md").write_text(text + "\n")
        (out / "bagua_overhead.json").write_text(json.dumps(table, indent=2) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
