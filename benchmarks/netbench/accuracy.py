"""Time to accuracy: the per-rank script of ``python -m benchmarks.netbench --preset accuracy``.

    gossamer run --nnodes H --node-rank K ... -m benchmarks.netbench.accuracy --out f.json ...

Every strategy trains the same MLP from the same initial weights on scikit-learn's bundled
digits (1797 8x8 images, read from the installed package; a fixed 20 % test split), each
rank on its own shard, with SGD (momentum 0.9) and ``--batch`` images per rank per step, for
``--steps`` steps. Every ``--eval-every`` steps the clock stops, the optimizer is
synchronised, and the test accuracy of every rank's own model is measured; the mean over
ranks is the strategy's accuracy at that time. The clock is the sum over segments of the
slowest rank's training time, so evaluation costs nothing and the job's pace is its slowest
rank's. Rank 0 writes one JSON row per strategy: the curve, the first time and step at which
the accuracy reached ``--target``, and the final accuracy.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import gossamer
from benchmarks.netbench.runner import job_arguments
from benchmarks.netbench.worker import param_bytes, release, wrap
from gossamer.data import load_digits
from gossamer.models import MLP

STRATEGIES = ("ddp", "gradient-allreduce", "awc/exp2", "atc/exp2", "atc/one-peer", "win-put")


def digits(seed: int = 0) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """``((train_x, train_y), (test_x, test_y))``: digits as 64 features in [0, 1]."""
    x, y = load_digits(flatten=True)  # bundled with scikit-learn: no download
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    return (x[train], y[train]), (x[test], y[test])


def _accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        return (model(x).argmax(dim=1) == y).float().mean().item()


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def train(strategy: str, data, args: argparse.Namespace) -> dict:
    """Train ``strategy`` for ``args.steps`` steps; the same row on every rank."""
    (train_x, train_y), (test_x, test_y) = data
    rank, size = gossamer.rank(), gossamer.size()
    shard_x, shard_y = train_x[rank::size], train_y[rank::size]
    torch.manual_seed(0)  # the same initial model on every rank and for every strategy
    model = MLP(64, args.hidden, 10, depth=args.depth)
    sgd = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    net, opt = wrap(strategy, model, sgd)
    loss_fn = nn.CrossEntropyLoss()
    batches = torch.Generator().manual_seed(1000 + rank)
    clock, curve, reached = 0.0, [], None
    gossamer.barrier()
    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        batch = torch.randint(0, len(shard_y), (args.batch,), generator=batches)
        opt.zero_grad()
        loss_fn(net(shard_x[batch]), shard_y[batch]).backward()
        opt.step()
        if step % args.eval_every and step != args.steps:
            continue
        if hasattr(opt, "synchronize"):
            opt.synchronize()
        clock += _slowest(time.perf_counter() - start)
        accuracy = gossamer.allreduce(torch.tensor([_accuracy(model, test_x, test_y)])).item()
        curve.append((step, clock, accuracy))
        if reached is None and accuracy >= args.target:
            reached = (step, clock)
        gossamer.barrier()
        start = time.perf_counter()
    release(strategy, opt)
    return {
        "strategy": strategy,
        "params_bytes": param_bytes(model),
        "batch": args.batch,
        "ranks": size,
        "target": args.target,
        "steps": args.steps,
        "step_s": clock / args.steps,
        "steps_to_target": reached[0] if reached else None,
        "time_to_target_s": reached[1] if reached else None,
        "final_accuracy": curve[-1][2],
        "curve": curve,
    }


def main(argv: list[str] | None = None) -> None:
    """Train every strategy in turn and write rank 0's rows to ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    job_arguments(parser)
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--target", type=float, default=0.95)
    args = parser.parse_args(argv)
    gossamer.init()
    torch.set_num_threads(1)
    data = digits()
    rows = []
    for strategy in (s for s in args.strategies.split(",") if s):
        row = train(strategy, data, args) | json.loads(args.meta)
        rows.append(row)
        if gossamer.rank() == 0:
            reached = row["time_to_target_s"]
            print(
                f"netbench accuracy: {strategy}: "
                + (f"{reached:.1f} s to {args.target:.0%}" if reached else "target not reached")
                + f", final {row['final_accuracy']:.2%}, {row['step_s'] * 1e3:.0f} ms/step",
                flush=True,
            )
    if gossamer.rank() == 0:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
