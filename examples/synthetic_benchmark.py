"""Synthetic training throughput: images per second per rank and in total.

Run on 4 local ranks (any N works; with plain ``python`` it is a world of one)::

    gossamer run -np 4 examples/synthetic_benchmark.py
    gossamer run -np 4 examples/synthetic_benchmark.py --optimizer ddp
    gossamer run -np 4 examples/synthetic_benchmark.py --optimizer atc --dynamic

BlueFog's ``pytorch_benchmark.py`` method (itself Horovod's): every rank trains on one fixed
batch of random images and labels with plain SGD (lr 0.01), after broadcasting the initial
parameters. ``--num-warmup-batches`` steps run untimed; then ``--num-iters`` times,
``--num-batches-per-iter`` full steps (zero_grad, forward, cross-entropy, backward, step)
are timed together, giving one img/s figure per iteration. Rank 0 prints its own figure per
iteration, then the per-rank throughput as the mean over ranks of each rank's mean, +- 1.96
times the pooled standard deviation (a 95 % interval for one rank's iteration), and the
total as the sum over ranks of their means, +- 1.96 times the square root of the summed
variances.

Models (defined in :mod:`gossamer.models`): ``resnet``, a ResNet-18-style network on
32x32x3 images, and ``mlp``, two hidden layers of 512 units on the same images, flattened.
``--optimizer``: ``ddp`` is ``torch.nn.parallel.DistributedDataParallel`` (the reference);
``gradient_allreduce`` is gossamer's equivalent; ``awc`` (the default, as BlueFog's
neighbour-allreduce optimizer), ``atc``, ``win_put`` and ``push_sum`` average parameters with
the neighbours in the exponential-two graph, or with one peer per step under ``--dynamic``
(the one-peer exponential schedule, as BlueFog's benchmark uses on one machine).
"""

from __future__ import annotations

import argparse
import statistics
import timeit

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import gossamer
from gossamer import optim
from gossamer import topology as topo
from gossamer.models import MLP, SmallResNet

OPTIMIZERS = {
    "gradient_allreduce": optim.GradientAllreduce,
    "awc": optim.AdaptWithCombine,
    "atc": optim.AdaptThenCombine,
    "win_put": optim.WindowPut,
    "push_sum": optim.PushSum,
}
NEIGHBOURLY = ("awc", "atc", "win_put", "push_sum")  # the ones a topology applies to


def _checked(kind, test, rule: str):
    """An argparse ``type=``: ``kind(text)``, refused unless ``test(value)`` ("must be rule")."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {rule}; got {text}")
        return value

    return parse


_POSITIVE = _checked(int, lambda n: n >= 1, ">= 1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("resnet", "mlp"), default="resnet")
    parser.add_argument("--optimizer", choices=("ddp", *OPTIMIZERS), default="awc")
    parser.add_argument("--dynamic", action="store_true", help="one peer per step")
    parser.add_argument("--batch-size", type=_POSITIVE, default=32, help="per rank")
    parser.add_argument(
        "--num-warmup-batches", type=_checked(int, lambda n: n >= 0, ">= 0"), default=3
    )
    parser.add_argument("--num-batches-per-iter", type=_POSITIVE, default=5)
    parser.add_argument("--num-iters", type=int, default=5)
    parser.add_argument("--num-classes", type=_POSITIVE, default=10)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.dynamic and args.optimizer not in NEIGHBOURLY:
        parser.error(f"--dynamic needs one of {', '.join(NEIGHBOURLY)}")
    if args.num_iters < 2:
        parser.error("--num-iters must be at least 2 (the spread needs two iterations)")

    gossamer.init()
    rank, size = gossamer.rank(), gossamer.size()
    torch.manual_seed(args.seed)
    if args.model == "resnet":
        model = SmallResNet(classes=args.num_classes)
    else:
        model = MLP(3 * 32 * 32, 512, args.num_classes, depth=2)
    optim.broadcast_parameters(model.state_dict(), root_rank=0)
    base = torch.optim.SGD(model.parameters(), lr=0.01)
    if args.optimizer == "ddp":
        model = DistributedDataParallel(model)  # on gossamer's process group (the default)
        opt = base
    else:
        where = {}
        if args.optimizer in NEIGHBOURLY:
            graph = topo.exponential_two(size)
            if args.dynamic:
                where["schedule"] = topo.one_peer_exponential(graph, rank)
            else:
                where["topology"] = graph
        opt = OPTIMIZERS[args.optimizer](base, model, **where)
    optim.broadcast_optimizer_state(base, root_rank=0)

    # One fixed batch per rank: the benchmark measures the step, not the data pipeline.
    generator = torch.Generator().manual_seed(args.seed + 1 + rank)
    data = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
    target = torch.randint(0, args.num_classes, (args.batch_size,), generator=generator)

    def benchmark_step() -> None:
        opt.zero_grad()
        F.cross_entropy(model(data), target).backward()
        opt.step()

    def log(text: str) -> None:
        if rank == 0:
            print(text, flush=True)

    params = sum(p.numel() for p in model.parameters())
    how = args.optimizer + (", one peer per step" if args.dynamic else "")
    log(f"Model: {args.model} ({params / 1e6:.2f} M parameters), batch size {args.batch_size}")
    log(f"Optimizer: {how}; number of ranks: {size}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    rates = []
    for it in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        rates.append(args.batch_size * args.num_batches_per_iter / seconds)
        log(f"Iter #{it}: {rates[-1]:.1f} img/sec per rank")
    if hasattr(opt, "free"):
        opt.free()  # the window optimizers' windows (collective)

    # [mean, variance] of every rank, so that slow and fast ranks both show.
    mine = torch.tensor([[statistics.mean(rates), statistics.variance(rates)]])
    every = gossamer.allgather(mine.double())
    means, variances = every[:, 0], every[:, 1]
    per_rank, per_rank_spread = means.mean().item(), 1.96 * variances.mean().sqrt().item()
    total, total_spread = means.sum().item(), 1.96 * variances.sum().sqrt().item()
    log(f"Img/sec per rank: {per_rank:.1f} +- {per_rank_spread:.1f}")
    log(f"Total img/sec on {size} rank(s): {total:.1f} +- {total_spread:.1f}")
    gossamer.shutdown()


if __name__ == "__main__":
    main()
